"""A LoRA trace: requests for a few adapters of skewed popularity, each adapter's requests sharing
a system prompt of their own (what a fleet serving fine-tuned variants of one model sees).

    python -m bench.workloads.adapters OUT [--adapters 8] [--requests 240] [--skew 1.0] [--seed 1]

Writes Mooncake JSONL with an `adapter` per record: adapter k (of `adapter-0` ...) is picked with
weight 1 / (k + 1) ** skew; its prompt is its `--system-blocks` shared 512-token blocks then one
block of its own (`--question-tokens` of it), answered in `--output` tokens; one session per request.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import orjson

BLOCK_TOKENS = 512  # the trace format's block
QUESTION_HASH_BASE = 1 << 40  # far above the system prompts' ids: questions share nothing


def records(
    adapters: int, requests: int, skew: float, system_blocks: int, question_tokens: int, output: int, seed: int
) -> list[dict]:
    """The trace's records, in sending order."""
    rng = random.Random(seed)
    names = [f"adapter-{k}" for k in range(adapters)]
    weights = [1 / (k + 1) ** skew for k in range(adapters)]
    out = []
    for i in range(requests):
        k = rng.choices(range(adapters), weights)[0]
        out.append(
            {
                "timestamp": i * 100,
                "input_length": system_blocks * BLOCK_TOKENS + question_tokens,
                "output_length": output,
                "hash_ids": [k * system_blocks + b for b in range(system_blocks)] + [QUESTION_HASH_BASE + i],
                "session_id": f"r{i:05d}",
                "adapter": names[k],
            }
        )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--requests", type=int, default=240)
    parser.add_argument("--skew", type=float, default=1.0, help="Zipf exponent of the adapters' popularity")
    parser.add_argument("--system-blocks", type=int, default=2)
    parser.add_argument("--question-tokens", type=int, default=128)
    parser.add_argument("--output", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    trace = records(
        args.adapters, args.requests, args.skew, args.system_blocks, args.question_tokens, args.output, args.seed
    )
    args.out.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in trace))


if __name__ == "__main__":
    main()
