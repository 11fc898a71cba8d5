"""`kvroute`: the product's command line, one subcommand per process it runs.

Each subcommand imports only what it runs. Developer tools (simulator, local stack, benchmarks)
are `kvroute-dev` (bench/cli.py): nothing here imports bench.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from extproc.envoy.bootstrap import (
    BACKEND_CLUSTERS,
    BODY_MODES,
    DESTINATION_SOURCES,
    HEAP_SHARE,
    TRANSPORTS,
    EnvoyLayout,
)
from extproc.runtime import config

_LAYOUT = EnvoyLayout()  # `kvroute envoy-config`'s defaults are the layout's


def parser() -> argparse.ArgumentParser:
    """The `kvroute` parser (also read by tests that check the manifests' flags)."""
    parser = argparse.ArgumentParser(prog="kvroute", description="KV-cache-aware routing for vLLM fleets.")
    commands = parser.add_subparsers(dest="command", required=True)

    config.add_arguments(commands.add_parser("extproc", help="run the Envoy external processor"))
    controller = commands.add_parser("controller", help="run the KVRoutingPolicy operator (kopf)")
    controller.add_argument("--health-host", default="0.0.0.0", help="address of /healthz and /readyz")
    controller.add_argument("--health-port", type=int, default=8080, help="port of /healthz and /readyz")
    controller.add_argument(
        "--reuse-interval",
        type=float,
        default=30.0,
        help="seconds between reads of the ext_procs' reuse counters into the policies' status (0: off)",
    )
    controller.add_argument(
        "--audit-interval",
        type=float,
        default=60.0,
        help="seconds between checks of the operator's watched objects against the API server, which drop "
        "those deleted while its watch was cut off (0: off)",
    )
    controller.add_argument(
        "--extproc-namespaces",
        type=lambda value: tuple(n for n in value.split(",") if n),
        default=(),
        help="comma-separated namespaces whose ext_proc pods may report reuse for policies of other namespaces, "
        "besides the namespace the operator runs in (a policy's own namespace always may)",
    )

    envoy = commands.add_parser("envoy-config", help="write an Envoy bootstrap that routes by kvroute")
    envoy.add_argument("--listen-port", type=int, default=_LAYOUT.listen_port)
    envoy.add_argument("--listen-host", default=_LAYOUT.listen_host)
    envoy.add_argument("--admin-port", type=int, default=_LAYOUT.admin_port)
    envoy.add_argument("--extproc-host", default=_LAYOUT.extproc_host)
    envoy.add_argument(
        "--extproc-port",
        type=int,
        action="append",
        help=f"ext_proc gRPC port (repeatable: replicas; default {_LAYOUT.extproc_ports[0]})",
    )
    envoy.add_argument("--backend", action="append", default=[], help="ip:port of a vLLM server (repeatable)")
    envoy.add_argument(
        "--backend-dns", default=_LAYOUT.backend_dns, help="NAME:PORT of a headless Service of the vLLM pods"
    )
    envoy.add_argument(
        "--admin-host", default=_LAYOUT.admin_host, help="Envoy admin address (0.0.0.0 for kubelet probes)"
    )
    envoy.add_argument("--message-timeout-ms", type=int, default=_LAYOUT.message_timeout_ms)
    envoy.add_argument("--no-ext-proc", action="store_true", help="plain round robin, for comparisons")
    envoy.add_argument(
        "--fail-closed",
        action="store_true",
        help="a dead ext_proc fails requests (5xx) instead of leaving them to round robin",
    )
    envoy.add_argument(
        "--backend-cluster",
        choices=BACKEND_CLUSTERS,
        default=_LAYOUT.backend_cluster,
        help="original_dst: connect to the one address kvroute names (override_host: run the ext_proc with "
        "--destination-fallback true, so Envoy can retry a second one)",
    )
    envoy.add_argument("--extproc-tls", action="store_true", help="connect to the ext_proc with TLS (not verified)")
    envoy.add_argument(
        "--no-graceful-close",
        action="store_true",
        help="reset each ext_proc stream at its request's end instead of half-closing it (docs/envoy.md)",
    )
    envoy.add_argument(
        "--extproc-mtls-dir",
        default=_LAYOUT.extproc_mtls_dir,
        help="mutual TLS to the ext_proc: folder with ca.crt, client.crt, client.key (`kvroute tls-certs`)",
    )
    envoy.add_argument(
        "--body-mode",
        choices=tuple(BODY_MODES),
        default=_LAYOUT.body_mode,
        help="how Envoy sends bodies to the ext_proc (full_duplex: as endpoint-picker gateways do)",
    )
    envoy.add_argument(
        "--destination-from",
        choices=tuple(DESTINATION_SOURCES),
        default=_LAYOUT.destination_from,
        help="where Envoy reads kvroute's choice: the destination header or `envoy.lb` dynamic metadata",
    )
    envoy.add_argument(
        "--extproc-token-file", default="", help="file with the token Envoy sends the ext_proc (its --grpc-token-file)"
    )
    envoy.add_argument(
        "--memory-limit-bytes",
        type=int,
        default=_LAYOUT.memory_limit_bytes,
        help=f"the Envoy container's memory limit: past {HEAP_SHARE} of it as heap Envoy refuses new requests "
        "(503); 0: off",
    )
    envoy.add_argument(
        "--forward-header", action="append", default=[], help="one more request header the ext_proc reads (repeatable)"
    )
    envoy.add_argument(
        "--transport",
        choices=TRANSPORTS,
        default=_LAYOUT.transport,
        help="how Envoy asks for each route: an ext_authz HTTP call whose request's end comes on the access log "
        "(the default: run the ext_proc with --authz-port), or an ext_proc gRPC stream (needed for prefill/decode "
        "splitting, full-duplex bodies, metadata and --extproc-tls; docs/envoy.md)",
    )
    envoy.add_argument(
        "--authz-port", type=int, action="append", help="the ext_proc's authz_port (repeatable: one per replica)"
    )
    envoy.add_argument("--output", "-o", help="file to write (default: stdout)")
    certs = commands.add_parser(
        "tls-certs", help="write a private CA and the ext_proc's and Envoy's certificates, for mutual TLS"
    )
    certs.add_argument("--out", required=True, help="folder to write ca.crt, server.crt/key, client.crt/key")
    certs.add_argument(
        "--host", action="append", default=[], help="a name or IP the ext_proc is reached at (repeatable)"
    )
    return parser


def envoy_layout(args: argparse.Namespace) -> EnvoyLayout:
    """The Envoy layout `kvroute envoy-config` flags describe."""
    from extproc.core.backends import parse_address
    from extproc.envoy.bootstrap import FORWARD_HEADERS
    from extproc.runtime.config import read_token

    return EnvoyLayout(
        listen_port=args.listen_port,
        listen_host=args.listen_host,
        admin_port=args.admin_port,
        admin_host=args.admin_host,
        extproc_host=args.extproc_host,
        extproc_ports=tuple(args.extproc_port or _LAYOUT.extproc_ports),
        backends=[parse_address(b) for b in args.backend],
        backend_dns=args.backend_dns,
        message_timeout_ms=args.message_timeout_ms,
        ext_proc=not args.no_ext_proc,
        destination_from=args.destination_from,
        body_mode=args.body_mode,
        extproc_tls=args.extproc_tls,
        extproc_mtls_dir=args.extproc_mtls_dir,
        fail_open=not args.fail_closed,
        backend_cluster=args.backend_cluster,
        graceful_close=not args.no_graceful_close,
        transport=args.transport,
        authz_ports=tuple(args.authz_port or _LAYOUT.authz_ports),
        extproc_token=read_token(args.extproc_token_file) if args.extproc_token_file else "",
        forward_headers=(*FORWARD_HEADERS, *(h.lower() for h in args.forward_header)),
        memory_limit_bytes=args.memory_limit_bytes,
    )


def _envoy_config(args: argparse.Namespace) -> None:
    from extproc.envoy.bootstrap import render

    try:
        layout = envoy_layout(args)
        text = render(layout)
    except ValueError as exc:  # a layout the flags describe but Envoy could not route by
        sys.exit(f"kvroute envoy-config: {exc}")
    if layout.ext_proc and layout.transport == "ext_authz":  # the authz port is off unless given: say so once
        ports = ", ".join(map(str, layout.authz_ports))
        sys.stderr.write(
            f"kvroute envoy-config: this Envoy asks each route over ext_authz on port {ports}: run the ext_proc "
            f"with --authz-port (else every request goes on unrouted, round robin), or use --transport ext_proc\n"
        )
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.command == "extproc":
        from extproc import service

        try:
            loaded = config.load(args)
        except (ValueError, OSError) as exc:  # a bad setting, a missing file: said, no traceback
            sys.exit(f"kvroute extproc: {exc}")
        service.main(loaded)
    elif args.command == "controller":
        from controller import operator

        operator.main(
            args.health_host, args.health_port, args.reuse_interval, args.audit_interval, args.extproc_namespaces
        )
    elif args.command == "envoy-config":
        _envoy_config(args)
    elif args.command == "tls-certs":
        from extproc.envoy.tls import issue_mutual

        for role, path in issue_mutual(Path(args.out), args.host).items():
            sys.stdout.write(f"{role}: {path}\n")


if __name__ == "__main__":
    main()
