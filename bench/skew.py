"""A skewed multi-session workload in Mooncake format: a few heavy sessions, many light ones.

Heavy sessions run many turns over contexts that grow fast (agents); light sessions run a few
short turns (chat). All share one system-prompt block. Each line carries a `session_id`, so
replay keeps each session's turns in order, as a real client does.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import orjson

from bench.trace import BLOCK_TOKENS


@dataclass(frozen=True, slots=True)
class SkewShape:
    heavy_sessions: int = 4
    heavy_turns: int = 16
    heavy_start_blocks: int = 8
    heavy_growth_blocks: int = 3
    light_sessions: int = 60
    light_turns: int = 3
    light_start_blocks: int = 2
    light_growth_blocks: int = 1
    spread_s: float = 40.0
    think_s: float = 1.5
    output_tokens: int = 64


def generate(shape: SkewShape, seed: int = 0) -> list[dict]:
    """The workload's records, ordered by timestamp."""
    rng = random.Random(seed)
    next_id = 1  # id 0 is the shared system prompt
    records = []
    kinds = [("heavy", i) for i in range(shape.heavy_sessions)] + [("light", i) for i in range(shape.light_sessions)]
    for kind, number in kinds:
        heavy = kind == "heavy"
        turns = shape.heavy_turns if heavy else shape.light_turns
        blocks = shape.heavy_start_blocks if heavy else shape.light_start_blocks
        growth = shape.heavy_growth_blocks if heavy else shape.light_growth_blocks
        ids = [0]
        start = rng.uniform(0, shape.spread_s)
        for turn in range(turns):
            while len(ids) < blocks + turn * growth:
                ids.append(next_id)
                next_id += 1
            records.append(
                {
                    "timestamp": round((start + turn * shape.think_s) * 1000),
                    "input_length": len(ids) * BLOCK_TOKENS - rng.randrange(BLOCK_TOKENS // 2),
                    "output_length": shape.output_tokens,
                    "hash_ids": list(ids),
                    "session_id": f"{kind}-{number}",
                }
            )
    return sorted(records, key=lambda r: r["timestamp"])


def write(path: Path, shape: SkewShape = SkewShape(), seed: int = 0) -> None:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in generate(shape, seed)))
