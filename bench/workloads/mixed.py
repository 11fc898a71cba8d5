"""A mixed trace for disaggregation: an agent trace's long prompts answered briefly, interleaved
with short prompts answered at length (what a chat or completion user sends beside the agents).

    python -m bench.workloads.mixed AGENT_TRACE OUT [--every 4] [--agent-output 16] [--short-output 128]

Writes Mooncake JSONL: every agent request as it was, its output set to `--agent-output` tokens,
and after every `--every`-th one a short request of its own (one 512-token block not shared with
anything, `--short-input` tokens of it, `--short-output` tokens out, a session of its own).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import orjson

SHORT_HASH_BASE = 1 << 40  # far above any trace's own hash ids: short prompts share nothing


def mix(agent: list[dict], every: int, agent_output: int, short_input: int, short_output: int) -> list[dict]:
    """The agent records with their outputs set, a short record after every `every`-th."""
    out = []
    for i, record in enumerate(agent):
        out.append({**record, "output_length": agent_output})
        if (i + 1) % every == 0:
            short = i // every
            out.append(
                {
                    "timestamp": record["timestamp"],
                    "input_length": short_input,
                    "output_length": short_output,
                    "hash_ids": [SHORT_HASH_BASE + short],
                    "session_id": f"short_{short:04d}",
                }
            )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("agent_trace", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--limit", type=int, default=None, help="first N agent requests")
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--agent-output", type=int, default=16)
    parser.add_argument("--short-input", type=int, default=256)
    parser.add_argument("--short-output", type=int, default=128)
    args = parser.parse_args(argv)
    lines = [orjson.loads(line) for line in args.agent_trace.read_bytes().splitlines() if line.strip()]
    records = mix(lines[: args.limit], args.every, args.agent_output, args.short_input, args.short_output)
    args.out.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))


if __name__ == "__main__":
    main()
