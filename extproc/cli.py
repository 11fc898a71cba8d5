"""`kvroute` command line: one subcommand per job."""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvroute", description="KV-cache-aware routing for vLLM fleets.")
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    core = bench.add_parser("core", help="decision CPU time and memory per index entry (JSON lines)")
    core.add_argument("--block-size", type=int, default=512, help="bytes per block (default: 512)")
    core.add_argument("--quick", action="store_true", help="a few iterations per case, for smoke runs")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.command == "bench" and args.bench == "core":
        from bench import core

        core.main(args.block_size, args.quick)
