"""`kvroute-dev bench floors`: what the routing call costs over each transport Envoy offers, at the
least (constant-answer routers, bench/harness/constant_routers.py), beside kvroute itself.

One set of fast simulated backends (no prefill or decode time, one output token) behind one Envoy
per transport, side by side in one run: Envoy alone (round robin, no routing call); the external
processor as kvroute's Envoy configures it (request headers, buffered body, response headers: three
messages on one stream), and sent the request side only (two: what learning from somewhere other
than the response headers would leave); external authorization over gRPC and over HTTP/1.1, each
sent the body; and kvroute's own ext_proc. For each
case (body size x concurrency) every stack gets the same follow-up requests, in turn, and Envoy's
and the router process's CPU per request are read from /proc, separately. `--rounds N` repeats
the cycle, so a difference can be told from this machine's noise.
"""

from __future__ import annotations

import asyncio
import copy
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from bench.experiments.latency import FAST_SIM, followups, load_figures, send_all
from bench.harness.processes import cpu_seconds, wait_tcp
from bench.harness.stack import Stack
from extproc.envoy.bootstrap import BODY_LIMIT
from extproc.envoy.headers import DESTINATION_HEADER

CASES = [(8_000, 1), (8_000, 16), (84_000, 1), (84_000, 16)]  # (body bytes, concurrency)
# Stacks in the order each case runs them; "none": Envoy alone, "kvroute": the product.
TRANSPORTS = (
    "none",
    "ext_proc",
    "ext_proc_request",
    "ext_authz_grpc",
    "ext_authz_http",
    "ext_authz_raw",
    "kvroute",
    "kvroute_authz",
    "kvroute_authz_no_flow_control",
    "kvroute_no_flow_control",
)
# Not among them: "ext_proc_body", the external processor sent the buffered body only (its request
# headers SKIPped, one message instead of three). It cannot route: Envoy passes the headers on at
# once, its router picks the upstream host then, and the body reply's destination comes too late
# (tests/test_bench_floors.py shows it round robin on Envoy 1.40).
_TYPES = "type.googleapis.com/envoy."
# What the ext_proc variants are sent: the request side only (no response headers: two messages),
# or the buffered body only.
_PROCESSING = {
    "ext_proc_request": {"request_header_mode": "SEND", "response_header_mode": "SKIP"},
    "ext_proc_body": {"request_header_mode": "SKIP", "response_header_mode": "SKIP"},
}


def _filters(bootstrap: dict[str, Any]) -> list[dict[str, Any]]:
    manager = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    filters: list[dict[str, Any]] = manager["typed_config"]["http_filters"]
    return filters


def _router_cluster(bootstrap: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "kvroute_extproc")


def envoy_edit(transport: str) -> Callable[[dict[str, Any]], None] | None:
    """How the transport's Envoy differs from kvroute's own (None: not at all). The ext_authz
    filters take the ext_proc filter's place, forward the same headers, and call the same
    cluster (plain HTTP/1.1 with an HTTP health check for ext_authz_http)."""
    if transport in ("none", "ext_proc") or transport.startswith("kvroute"):
        return None

    def edit(bootstrap: dict[str, Any]) -> None:
        filters = _filters(bootstrap)
        index = next(i for i, f in enumerate(filters) if f["name"] == "envoy.filters.http.ext_proc")
        ext_proc = filters[index]["typed_config"]
        if transport in _PROCESSING:
            ext_proc["processing_mode"] = {**_PROCESSING[transport], "request_body_mode": "BUFFERED"}
            return
        authz: dict[str, Any] = {
            "@type": _TYPES + "extensions.filters.http.ext_authz.v3.ExtAuthz",
            "transport_api_version": "V3",
            "failure_mode_allow": True,
            "with_request_body": {"max_request_bytes": BODY_LIMIT, "allow_partial_message": False},
            "allowed_headers": copy.deepcopy(ext_proc["forward_rules"]["allowed_headers"]),
        }
        cluster = _router_cluster(bootstrap)
        if transport == "ext_authz_grpc":
            authz["with_request_body"]["pack_as_bytes"] = True
            authz["grpc_service"] = {"envoy_grpc": {"cluster_name": cluster["name"]}, "timeout": "10s"}
        else:
            address = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
            socket = address["socket_address"]
            authz["http_service"] = {
                "server_uri": {
                    "uri": f"http://{socket['address']}:{socket['port_value']}",
                    "cluster": cluster["name"],
                    "timeout": "10s",
                },
                "path_prefix": "/route",
                "authorization_response": {"allowed_upstream_headers": {"patterns": [{"exact": DESTINATION_HEADER}]}},
            }
            del cluster["typed_extension_protocol_options"]  # HTTP/1.1, kept alive
            cluster["health_checks"][0].pop("grpc_health_check")
            cluster["health_checks"][0]["http_health_check"] = {"path": "/health"}
        filters[index] = {"name": "envoy.filters.http.ext_authz", "typed_config": authz}

    return edit


@dataclass
class ConstantStack(Stack):
    """A stack whose router is a constant-answer server of the transport's protocol."""

    constant: str = "ext_proc"  # the floors' transport it answers (its Envoy is set by `envoy_edit`)
    answers: Sequence[str] = ()  # the backends its answers name, in turn (default: every one)

    def start_extproc(self) -> None:
        protocol = "ext_proc" if self.constant.startswith("ext_proc") else self.constant
        named = self.answers or self.backends
        argv = [sys.executable, "-m", "bench.harness.constant_routers", protocol, str(self.grpc_port), *named]
        process = self._spawn("extproc", argv)
        wait_tcp("127.0.0.1", self.grpc_port, process=process)


def _stack(transport: str, workdir: Path, backends: list[str]) -> Stack:
    if transport == "none":
        return Stack(workdir, backends=backends, ext_proc=False)
    if transport == "kvroute":
        return Stack(workdir, backends=backends)
    if transport == "kvroute_authz":  # the product over its ext_authz transport (extproc/envoy/authz.py)
        return Stack(workdir, backends=backends, transport="ext_authz")
    if transport.endswith("_no_flow_control"):  # what flow control costs a fleet with room
        layout = {"transport": "ext_authz"} if transport.startswith("kvroute_authz") else {}
        return Stack(workdir, backends=backends, extproc_args=["--flow-control=false"], **layout)
    return ConstantStack(workdir, backends=backends, envoy_edit=envoy_edit(transport), constant=transport)


def _timed(stack: Stack, bodies: list[bytes], concurrency: int) -> dict[str, float | None]:
    """One load through a stack: latency, and Envoy's and the router's CPU per request (µs)."""
    envoy = [stack.processes["envoy"].pid]
    router = [stack.processes["extproc"].pid] if "extproc" in stack.processes else []
    before = cpu_seconds(envoy), cpu_seconds(router)
    latencies, wall = asyncio.run(send_all(stack.url, bodies, concurrency))
    after = cpu_seconds(envoy), cpu_seconds(router)
    count = len(latencies)
    return {
        **load_figures(latencies, wall),
        "envoy_cpu_us": round((after[0] - before[0]) / count * 1e6, 1),
        "router_cpu_us": round((after[1] - before[1]) / count * 1e6, 1) if router else None,
    }


def measure(
    requests: int, workdir: Path, rounds: int = 1, transports: Sequence[str] = TRANSPORTS
) -> list[dict[str, Any]]:
    """One row per round, case and transport (Envoy alone, "none", always runs: the others' base)."""
    plain = Stack(workdir / "none", sims=4, sim_args=FAST_SIM, ext_proc=False)
    rows: list[dict[str, Any]] = []
    with plain:
        backends = list(plain.backends)
        stacks = {"none": plain}
        try:
            for transport in (t for t in TRANSPORTS[1:] if t in transports):
                stacks[transport] = _stack(transport, workdir / transport, backends).start()
            for round_ in range(1, rounds + 1):
                for size, concurrency in CASES:
                    bodies = followups(size, requests)
                    for transport, stack in stacks.items():
                        asyncio.run(send_all(stack.url, bodies[:50], concurrency))  # warm-up
                        figures = _timed(stack, bodies, concurrency)
                        case = {"round": round_, "body_bytes": len(bodies[0]), "concurrency": concurrency}
                        rows.append({**case, "transport": transport, **figures})
        finally:
            for transport, stack in stacks.items():
                if transport != "none":
                    stack.stop()
    return rows


def main(requests: int, rounds: int, transports: Sequence[str] = TRANSPORTS) -> None:
    with tempfile.TemporaryDirectory(prefix="kvroute-floors-") as tmp:
        for row in measure(requests, Path(tmp), rounds, transports):
            print(orjson.dumps(row).decode(), flush=True)
