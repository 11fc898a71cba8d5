"""Multi-session workloads in Mooncake format.

`skewed` (the default): a few heavy sessions, many light ones (`skewed-large`: four times as
many). Heavy sessions run many turns over contexts that grow fast (agents); light sessions run a
few short turns (chat). All share one system-prompt block. `agentic`: 120 sessions of 4 turns
over 8 shared system prompts of 4 blocks (2,048 tokens) each, contexts growing a block per turn,
the shape where issue 11 found kvroute's learned index predicting far more cache than vLLM had.
Each line carries a `session_id`, so replay keeps each session's turns in order, as a real
client does.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import orjson

from bench.workloads.trace import BLOCK_TOKENS


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
    system_prompts: int = 1  # distinct system prompts; session i starts with prompt i % system_prompts
    system_blocks: int = 1  # blocks of each system prompt


SHAPES = {
    "skewed": SkewShape(),
    # four times the sessions, for load sweeps: the closed loop can offer up to 248 concurrent requests
    "skewed-large": SkewShape(heavy_sessions=8, light_sessions=240, spread_s=120.0),
    "agentic": SkewShape(
        heavy_sessions=0,
        light_sessions=120,
        light_turns=4,
        light_start_blocks=6,
        light_growth_blocks=1,
        spread_s=60.0,
        think_s=2.0,
        system_prompts=8,
        system_blocks=4,
    ),
}


def generate(shape: SkewShape, seed: int = 0) -> list[dict]:
    """The workload's records, ordered by timestamp."""
    rng = random.Random(seed)
    size = shape.system_blocks
    systems = [list(range(k * size, (k + 1) * size)) for k in range(shape.system_prompts)]
    next_id = shape.system_prompts * size  # the ids before are the shared system prompts
    records = []
    kinds = [("heavy", i) for i in range(shape.heavy_sessions)] + [("light", i) for i in range(shape.light_sessions)]
    for session, (kind, number) in enumerate(kinds):
        heavy = kind == "heavy"
        turns = shape.heavy_turns if heavy else shape.light_turns
        blocks = shape.heavy_start_blocks if heavy else shape.light_start_blocks
        growth = shape.heavy_growth_blocks if heavy else shape.light_growth_blocks
        ids = list(systems[session % shape.system_prompts])
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
