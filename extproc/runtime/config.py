"""ext_proc configuration: defaults, then a YAML file, then KVROUTE_* environment, then flags.

Flat keys for the process (ports, backends, health checks) and a `routing` mapping for the
routing core's Settings. The same names work everywhere: `grpc_port` in YAML is
`KVROUTE_GRPC_PORT` in the environment and `--grpc-port` on the command line; routing settings
are `routing.block_size` / `KVROUTE_BLOCK_SIZE` / `--block-size`.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from extproc.core.backends import Backend, Role, parse_address
from extproc.core.settings import NON_NEGATIVE, POSITIVE, Bounds, Settings, check_value, text_parser


def _key(default: Any, text: str, bounds: Bounds | None = None, choices: tuple[str, ...] = ()) -> Any:
    return field(default=default, metadata={"help": text, "bounds": bounds, "choices": choices})


HOSTS = ("grpc_host", "admin_host", "control_host")  # listen addresses: empty would mean every interface


PORT = Bounds(minimum=0, maximum=65_535)
COUNT = Bounds(minimum=1)


@dataclass(frozen=True, slots=True)
class ExtProcConfig:
    """Everything `kvroute extproc` needs to run; each process key declared once, with its help."""

    grpc_host: str = _key("127.0.0.1", "ext_proc listen address")
    grpc_port: int = _key(9002, "ext_proc gRPC port", PORT)
    authz_port: int = _key(
        0,
        "ext_authz HTTP port, the faster transport (Envoy asks each request's route over HTTP/1.1 and its "
        "access log reports each end to the same port; docs/envoy.md), with the gRPC port's TLS files if "
        "given; 0: off. With replica_store, each request's end reaches the replica that decided it through the store",
        PORT,
    )
    admin_host: str = _key("127.0.0.1", "admin HTTP listen address")
    admin_port: int = _key(9003, "monitoring HTTP port: /metrics, /healthz, /readyz (read-only, no auth)", PORT)
    control_host: str = _key("127.0.0.1", "control HTTP listen address")
    control_port: int = _key(0, "control HTTP port: /v1/query, /v1/notify, /v1/release, /debug/state; 0: off", PORT)
    control_token_file: str = _key("", "file holding the control port's bearer token (required with control_port)")
    grpc_token_file: str = _key(
        "", "file holding the token Envoy must send as `authorization: Bearer` gRPC metadata; empty: no check"
    )
    grpc_tls_cert_file: str = _key("", "PEM certificate for TLS on the ext_proc port (with grpc_tls_key_file)")
    grpc_tls_key_file: str = _key("", "PEM private key of grpc_tls_cert_file")
    grpc_tls_self_signed: bool = _key(
        False, "TLS on the ext_proc port with a certificate made at start (what endpoint-picker gateways expect)"
    )
    grpc_tls_client_ca_file: str = _key(
        "",
        "PEM CA: mutual TLS, every client must present a certificate it signed (only Envoy holds one); "
        "needs grpc_tls_cert_file",
    )
    destination_fallback: bool = _key(
        False,
        "name a second choice after a comma in the destination, for kvroute's own override_host Envoy (which "
        "retries it); off by default: gateways' ORIGINAL_DST clusters take the destination as one address",
    )
    backends: tuple[Backend, ...] = _key(
        (),
        "ip:port of each vLLM server, ip:port@ROLE in a disaggregated fleet (prefill, decode, both; `--backend` "
        "repeatable; a list in YAML)",
    )
    health_interval_s: float = _key(2.0, "seconds between backend /health probes", POSITIVE)
    health_probes_per_s: float = _key(
        200.0,
        "at most this many /health probes a second: a larger fleet is probed a slice per round, each backend "
        "less often (a backend Envoy reports refusing connections is still probed at once)",
        POSITIVE,
    )
    health_timeout_s: float = _key(1.0, "timeout of one probe", POSITIVE)
    unhealthy_after: int = _key(2, "failed probes before a backend is dropped", COUNT)
    max_message_bytes: int = _key(64 * 1024 * 1024, "largest gRPC message (request body) accepted", COUNT)
    max_stream_age_s: float = _key(
        3600.0, "an ext_proc stream older than this is closed and its load released", POSITIVE
    )
    max_streams: int = _key(4096, "concurrent ext_proc streams per connection from Envoy", COUNT)
    stop_grace_s: float = _key(
        20.0,
        "on SIGTERM, seconds the ext_proc streams still open may take to end (a gateway's full-duplex stream "
        "lasts as long as its response streams; held requests are answered first). Keep it below the pod's "
        "terminationGracePeriodSeconds less its preStop (60 - 35 in the manifests and chart)",
        NON_NEGATIVE,
    )
    lease_ttl_s: float = _key(300.0, "seconds a /v1/query lease holds its reservation if never released", POSITIVE)
    engine_scrape_interval_s: float = _key(
        0.25,
        "seconds between scrapes of each backend's /metrics (engine load, restarts, KV size); 0: off",
        NON_NEGATIVE,
    )
    engine_scrapes_per_s: float = _key(
        400.0,
        "at most this many /metrics scrapes a second: a larger fleet is scraped a slice per round, each backend "
        "less often (past 2 s between samples its engine's counts no longer steer load: kvroute's own do)",
        POSITIVE,
    )
    kv_events: bool = _key(
        True, "subscribe to the KV cache events of every backend that publishes them (GET /kv_event_sources)"
    )
    kv_events_read_gap_s: float = _key(
        0.02,
        "approximate mode: after reading a backend's KV event batches, read its next ones this much later at "
        "the earliest (an engine publishes one per step, and each wake-up costs CPU; the first after a quiet "
        "spell is read at once). 0.25 saved the ext_proc 0.1-0.2 s of CPU a vLLM-CPU run, but a streamed "
        "request that ends before its batch is read gives the TTFT model no evidence (SLO admission then "
        "fails open). Precise mode, whose picture they are, reads them as they come",
        NON_NEGATIVE,
    )
    replica_store: str = _key(
        "",
        "redis:// or rediss:// URL of the store sibling replicas share learning, sessions and load through; "
        "empty: this replica routes alone (needs an explicit hash_key, the same on every replica)",
    )
    replica_store_password_file: str = _key("", "file holding the replica store's password (AUTH); empty: none")
    replica_group: str = _key(
        "", "key prefix of the replicas that share a picture (default: kvroute:<policy> or kvroute:default)"
    )
    log_level: str = _key("info", "debug, info, warning, error", choices=("debug", "info", "warning", "error"))
    policy: str = _key(
        "",
        "NAMESPACE/NAME of a KVRoutingPolicy to follow live (Kubernetes); several, comma-separated: each "
        "request goes to the policy whose backends list its model (docs/design.md#several-policies-in-one-ext_proc)",
    )
    policies: tuple[UnitConfig, ...] = _key(
        (),
        "without Kubernetes, several policies in one ext_proc (YAML only): a list of {name, backends, routing}, "
        "each routing over the top-level one; instead of `policy` and `backends`",
    )
    routing: Settings = field(default_factory=Settings)

    def units(self) -> tuple[UnitConfig, ...]:
        """The policies this process serves, each with the backends and settings it starts with
        (a followed policy's come from its status, live); one when nothing says otherwise."""
        if self.policies:
            return self.policies
        followed = [name for name in self.policy.split(",") if name]
        if len(followed) > 1:
            return tuple(UnitConfig(name, name, (), self.routing) for name in followed)
        return (UnitConfig(self.policy or "default", self.policy, self.backends, self.routing),)

    def __post_init__(self) -> None:
        """Every value of its type and within its bounds, whatever its source (YAML skips the
        text parsers): a NaN interval stopped the health probes for good, a negative stream age cut
        every stream, `"false"` from YAML read as on; and no two listeners on one port."""
        for f in fields(self):
            value = getattr(self, f.name)
            check_value(f.name, type(f.default), f.metadata.get("bounds"), value)
            if f.metadata.get("choices") and value.lower() not in f.metadata["choices"]:
                raise ValueError(f"{f.name} must be one of {', '.join(f.metadata['choices'])}, got {value!r}")
            if f.name in HOSTS and not value.strip():
                raise ValueError(f"{f.name} must name an address (0.0.0.0 for every interface), got {value!r}")
        ports = [p for p in (self.grpc_port, self.admin_port, self.authz_port, self.control_port) if p]
        if len(ports) != len(set(ports)):
            raise ValueError(f"the ext_proc's ports must differ, got {ports}")


@dataclass(frozen=True, slots=True)
class UnitConfig:
    """One policy an ext_proc serves: its name (metrics' `policy` label, replica group), the
    KVRoutingPolicy it follows if any, its first backends and its routing settings."""

    name: str
    follow: str
    backends: tuple[Backend, ...]
    routing: Settings


_STRUCTURED = ("backends", "policies", "routing")  # keys that are not one value of text
# process key -> how it is read from text, by the type of its default
_PROCESS_KEYS = {f.name: text_parser(type(f.default)) for f in fields(ExtProcConfig) if f.name not in _STRUCTURED}
DEFAULTS = {f.name: f.default for f in fields(ExtProcConfig) if f.name in _PROCESS_KEYS}
PROCESS_HELP = {f.name: f.metadata["help"] for f in fields(ExtProcConfig) if f.name != "routing"}
_ROUTING_KEYS = {f.name for f in fields(Settings)}


def parse_backend(item: str | Mapping[str, Any]) -> Backend:
    """A backend from `ip:port`, `ip:port@role` or `{address: ip:port, models: [...], role: ...}`
    (role: prefill, decode or both, the default)."""
    if isinstance(item, str):
        address, _, role = item.partition("@")
        return Backend(parse_address(address), role=Role.parse(role) if role else Role.BOTH)
    if not isinstance(item, Mapping) or "address" not in item:
        raise ValueError(f"a backend is ip:port or {{address: ip:port, models: [...], role: ...}}, got {item!r}")
    models = item.get("models") or []
    if not isinstance(models, list):
        raise ValueError(f"a backend's models are a list, got {models!r}")
    role = Role.parse(item.get("role", Role.BOTH))
    return Backend(parse_address(str(item["address"])), frozenset(str(m) for m in models), role=role)


def _from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for key in [*_PROCESS_KEYS, *_ROUTING_KEYS, "backends"]:
        raw = environ.get("KVROUTE_" + key.upper())
        if raw is None:
            continue
        if key == "backends":
            values[key] = [b for b in raw.split(",") if b.strip()]
        else:
            try:
                if key in _ROUTING_KEYS:
                    values.setdefault("routing", {})[key] = _cast_routing(key, raw)
                else:
                    values[key] = _PROCESS_KEYS[key](raw)
            except (ValueError, TypeError) as exc:
                raise ValueError(f"KVROUTE_{key.upper()}={raw!r}: {exc}") from None
    return values


def _cast_routing(key: str, raw: str) -> Any:
    return next(f.metadata["parse"] for f in fields(Settings) if f.name == key)(raw)


def _merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    merged = {**base, **{k: v for k, v in top.items() if k != "routing"}}
    merged["routing"] = {**base.get("routing", {}), **top.get("routing", {})}
    return merged


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags for every key; unset flags leave lower layers alone."""
    parser.add_argument("--config", help="YAML config file (also KVROUTE_CONFIG)")
    parser.add_argument("--backend", action="append", dest="backends", help=PROCESS_HELP["backends"])
    for key, parse in _PROCESS_KEYS.items():
        parser.add_argument(
            "--" + key.replace("_", "-"),
            dest=key,
            type=parse,
            default=None,
            help=f"{PROCESS_HELP[key]} (default: {default_text(DEFAULTS[key])})",
        )
    for f in fields(Settings):
        parser.add_argument(
            "--" + f.name.replace("_", "-"), dest="routing_" + f.name, type=f.metadata["parse"], help=f.metadata["help"]
        )


def load(args: argparse.Namespace | None = None, environ: Mapping[str, str] = os.environ) -> ExtProcConfig:
    """Merge the layers and validate; raises ValueError with a clear message on bad values."""
    flags = vars(args) if args is not None else {}
    values: dict[str, Any] = {"routing": {}}
    path = flags.get("config") or environ.get("KVROUTE_CONFIG")
    if path:
        try:
            loaded = yaml.safe_load(Path(path).read_text()) or {}
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: not YAML: {exc}") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: the config file must be a mapping")
        for key, kind, shape in (
            ("routing", dict, "a mapping"),
            ("backends", list, "a list"),
            ("policies", list, "a list"),
        ):
            if key in loaded and not isinstance(loaded[key], kind):
                raise ValueError(f"{path}: {key} must be {shape}, got {loaded[key]!r}")
        values = _merge(values, loaded)
    values = _merge(values, _from_env(environ))
    cli: dict[str, Any] = {k: v for k, v in flags.items() if k in _PROCESS_KEYS and v is not None}
    if flags.get("backends"):
        cli["backends"] = flags["backends"]
    cli["routing"] = {
        k.removeprefix("routing_"): v for k, v in flags.items() if k.startswith("routing_") and v is not None
    }
    values = _merge(values, cli)
    unknown = set(values) - set(_PROCESS_KEYS) - set(_STRUCTURED)
    if unknown:
        raise ValueError(f"unknown config keys: {sorted(unknown)}")
    if values.get("control_port") and not values.get("control_token_file"):
        raise ValueError("control_port needs control_token_file: the control API is never open")
    if bool(values.get("grpc_tls_cert_file")) != bool(values.get("grpc_tls_key_file")):
        raise ValueError("grpc_tls_cert_file and grpc_tls_key_file go together")
    if values.get("grpc_tls_cert_file") and values.get("grpc_tls_self_signed"):
        raise ValueError("grpc_tls_self_signed or a certificate file, not both")
    if values.get("grpc_tls_client_ca_file") and not values.get("grpc_tls_cert_file"):
        raise ValueError("grpc_tls_client_ca_file needs grpc_tls_cert_file: clients verify the server too")
    if values.get("replica_store") and "hash_key" not in values["routing"] and not values.get("policies"):
        raise ValueError("replica_store needs an explicit hash_key, the same on every replica")
    if values.get("authz_port") and values.get("grpc_tls_self_signed"):
        raise ValueError(
            "authz_port takes its TLS from grpc_tls_cert_file (and grpc_tls_client_ca_file for mutual TLS), "
            "not from a self-signed certificate"
        )
    followed = (values.get("policy") or "").split(",")
    if values.get("policy") and (len(set(followed)) < len(followed) or not all(map(_namespaced, followed))):
        raise ValueError(f"policy must be NAMESPACE/NAME, or several comma-separated, got {values['policy']!r}")
    if len(followed) > 1 and values.get("backends"):
        raise ValueError("several policies take their backends from their status: give policy or backends")
    policies = _policies(values.pop("policies", None) or [], values)
    backends = tuple(parse_backend(b) for b in values.pop("backends", []) or [])
    routing = Settings.from_mapping(values.pop("routing"))
    loaded = ExtProcConfig(backends=backends, policies=policies, routing=routing, **values)
    for path in (loaded.control_token_file, loaded.grpc_token_file):  # read now, not after a port opened
        if path:
            read_token(path)
    return loaded


def _namespaced(name: str) -> bool:
    """NAMESPACE/NAME, each part non-empty and without spaces."""
    namespace, _, rest = name.partition("/")
    return bool(namespace and rest) and "/" not in rest and not any(c.isspace() for c in name)


def _policies(items: Any, values: Mapping[str, Any]) -> tuple[UnitConfig, ...]:
    """The YAML `policies` list: each {name, backends, routing}, its routing over the top-level
    one (so a shared hash_key, say, is set once)."""
    if not items:
        return ()
    if values.get("policy") or values.get("backends"):
        raise ValueError("policies replace policy and backends: give one or the other")
    if not isinstance(items, list) or not all(isinstance(item, Mapping) for item in items):
        raise ValueError("policies must be a list of {name, backends, routing} mappings")
    units = []
    for item in items:
        unknown = set(item) - {"name", "backends", "routing"}
        name = str(item.get("name") or "")
        if unknown or not name:
            raise ValueError(f"policy {name!r}: needs a name, and has only name, backends, routing; got {sorted(item)}")
        backends = tuple(parse_backend(b) for b in item.get("backends") or [])
        merged = {**values["routing"], **(item.get("routing") or {})}
        if values.get("replica_store") and "hash_key" not in merged:
            raise ValueError(f"policy {name!r}: replica_store needs an explicit hash_key, the same on every replica")
        routing = Settings.from_mapping(merged)
        units.append(UnitConfig(name, "", backends, routing))
    if len({unit.name for unit in units}) < len(units):
        raise ValueError("policies need distinct names")
    return tuple(units)


def default_text(value: Any) -> str:
    if isinstance(value, tuple):
        return ", ".join(v if isinstance(v, str) else "=".join(map(str, v)) for v in value) or "none"
    return "none" if value == "" else str(value).lower() if isinstance(value, bool) else str(value)


def read_token(path: str) -> str:
    """A secret from a file (a mounted Secret), surrounding whitespace removed; never empty."""
    token = Path(path).read_text().strip()
    if not token:
        raise ValueError(f"{path}: the token file is empty")
    return token
