"""`kvroute-dev bench core`: CPU cost of one routing decision, and memory per index entry.

Each timed iteration is what the ext_proc does per request: parse the raw body, build the CBR
and chain, look up the index, decide and reserve, release the prefill, learn, finish. The body
is a long conversation the index already knows, plus a new last message, as in a follow-up.
`--precise` times the same in precise mode (tokenizing with the tiny model's tokenizer, the
index fed by BlockStored events): a follow-up turn, and cold (a conversation never seen).
`--backends 4,64,256,1024` times the same lifecycles as the fleet grows (`run_scale`).
"""

from __future__ import annotations

import gc
import random
import statistics
import time
import tracemalloc
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import orjson

from bench.experiments.decisions import started
from bench.workload import conversation
from extproc.core.backends import Backend
from extproc.core.engine import BlockStored
from extproc.core.request import parse_request
from extproc.core.router import Router
from extproc.core.settings import Settings

BODY_SIZES = (8_000, 84_000, 2_000_000)
INDEX_SIZES = (10_000, 1_000_000)
BACKENDS = tuple(Backend(f"10.0.0.{i}:8000") for i in range(1, 5))


@dataclass(frozen=True, slots=True)
class Case:
    body_bytes: int
    index_entries: int
    iterations: int


def _fill(router: Router, entries: int, rng: random.Random) -> float:
    """Fill the index with random chains spread over the backends; return bytes per entry."""
    chain_len = 64
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    learned = 0
    while learned < entries:
        for backend in BACKENDS:
            n = min(chain_len, entries - learned)
            router.index.learn([rng.getrandbits(60) for _ in range(n)], backend.address, 0.0)
            learned += n
            if learned >= entries:
                break
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return (after - before) / router.state().index_entries


def _bodies(size: int, count: int) -> Iterator[bytes]:
    """The same conversation with a different final question each time."""
    body = conversation(size, seed=size)
    for i in range(count):
        body["messages"].append({"role": "user", "content": f"question {i}: what happened next?"})
        yield orjson.dumps(body)
        body["messages"].pop()


def _decide(router: Router, raw: bytes, now: float, backends: Sequence[Backend] = BACKENDS) -> tuple[float, str]:
    """One full request lifecycle; its CPU time in microseconds and its label."""
    start = time.perf_counter_ns()
    exchange = router.begin(router.parse(raw, {}), backends, now)
    started(router, exchange, exchange.decision.backend or "", now)
    exchange.end()
    return (time.perf_counter_ns() - start) / 1000, exchange.decision.label.value


def run_case(case: Case, block_size: int) -> dict[str, float | int]:
    """Time `case.iterations` full decisions; return the figures as one JSON-ready dict."""
    capacity = case.index_entries // len(BACKENDS) + 100_000
    settings = Settings(block_size=block_size, hash_key=b"k" * 16, capacity_blocks=capacity, location_ttl_s=1e9)
    router = Router(settings)
    bytes_per_entry = _fill(router, case.index_entries, random.Random(1))
    warm = parse_request(orjson.dumps(conversation(case.body_bytes, seed=case.body_bytes)))
    router.learn(warm, BACKENDS[0].address, 1.0)
    bodies = list(_bodies(case.body_bytes, case.iterations))
    gc.collect()
    decided = [_decide(router, raw, 2.0 + i) for i, raw in enumerate(bodies)]
    timings = sorted(t for t, _ in decided)
    return {
        "body_bytes": len(bodies[0]),
        "index_entries": router.state().index_entries,
        "block_size": block_size,
        "blocks": len(router.chain_of(router.parse(bodies[-1], {}))),
        "iterations": case.iterations,
        "decide_p50_us": round(statistics.median(timings), 1),
        "decide_p99_us": round(timings[min(len(timings) - 1, int(len(timings) * 0.99))], 1),
        "bytes_per_entry": round(bytes_per_entry, 1),
        "label": decided[-1][1],
    }


def run_precise(body_bytes: int, iterations: int, block_tokens: int = 128) -> dict[str, float | int | str]:
    """Precise mode on one conversation: follow-up and cold decisions, and the tokenizer cache's
    memory per cached token. The engine's events are synthesized from the tokens it would cache."""
    import tempfile
    from pathlib import Path

    from bench.harness.tiny_model import tokenizer_files
    from extproc.vllm.tokenizer import ChatTokenizer

    with tempfile.TemporaryDirectory() as directory:
        tokenizer_files(Path(directory))
        tokenizer = ChatTokenizer(directory)
        cold_tokenizer = ChatTokenizer(directory, cache_tokens=0)
    router = Router(Settings(hash_key=b"k" * 16))
    router.use_precise(tokenizer)
    base = conversation(body_bytes, seed=body_bytes)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    tokenizer.tokens(base)  # fills the piece cache; the result is dropped, the cache is what stays
    gc.collect()
    per_token = (tracemalloc.get_traced_memory()[0] - before) / max(1, tokenizer.cached_tokens)
    tracemalloc.stop()
    tokens = list(tokenizer.tokens(base) or [])
    full = len(tokens) // block_tokens * block_tokens
    hashes = tuple(range(1, full // block_tokens + 1))
    router.engine_events(BACKENDS[0].address, [BlockStored(hashes, None, tuple(tokens[:full]), block_tokens, ())])
    bodies = list(_bodies(body_bytes, iterations))
    warm = [_decide(router, raw, 2.0 + i) for i, raw in enumerate(bodies)]
    router.use_precise(cold_tokenizer)  # no piece cache: every prompt tokenized whole, as the first time
    router.engine_events(BACKENDS[0].address, [BlockStored(hashes, None, tuple(tokens[:full]), block_tokens, ())])
    cold = [_decide(router, raw, 2.0 + i)[0] for i, raw in enumerate(bodies[: max(5, iterations // 10)])]
    timings = sorted(t for t, _ in warm)
    return {
        "mode": "precise",
        "body_bytes": len(bodies[0]),
        "prompt_tokens": len(tokens),
        "blocks": full // block_tokens,
        "iterations": iterations,
        "followup_p50_us": round(statistics.median(timings), 1),
        "followup_p99_us": round(timings[min(len(timings) - 1, int(len(timings) * 0.99))], 1),
        "cold_p50_us": round(statistics.median(cold), 1),
        "tokenizer_bytes_per_cached_token": round(per_token, 2),
        "label": warm[-1][1],
    }


SCALE_BLOCKS_PER_BACKEND = 4096
SCALE_CHAIN = 16


def fleet(size: int) -> list[Backend]:
    """`size` distinct backend addresses."""
    return [Backend(f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}:8000") for i in range(size)]


def _percentiles(timings: list[float]) -> tuple[float, float]:
    ordered = sorted(timings)
    return round(statistics.median(ordered), 1), round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], 1)


def run_scale(size: int, iterations: int, block_size: int = 512) -> dict[str, float | int | str]:
    """A fleet of `size` backends whose index holds 4,096 cached blocks each (random chains of 16):
    index memory, and full lifecycles of a new 8 KB prompt (nothing cached anywhere) and of a
    follow-up turn of an 84 KB conversation cached on one backend."""
    backends = tuple(fleet(size))  # as the pool hands them over: one tuple while the set is unchanged
    capacity = SCALE_BLOCKS_PER_BACKEND * 2
    router = Router(Settings(block_size=block_size, hash_key=b"k" * 16, capacity_blocks=capacity, location_ttl_s=1e9))
    rng = random.Random(size)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for backend in backends:
        for _ in range(SCALE_BLOCKS_PER_BACKEND // SCALE_CHAIN):
            router.index.learn([rng.getrandbits(60) for _ in range(SCALE_CHAIN)], backend.address, 0.0)
    memory = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    entries = router.state().index_entries
    fresh = [orjson.dumps(conversation(8_000, seed=1_000_000 + i, turn_bytes=500)) for i in range(iterations)]
    known = conversation(84_000, seed=84_000)
    router.learn(parse_request(orjson.dumps(known)), backends[0].address, 1.0)
    followups = list(_bodies(84_000, iterations))
    gc.collect()
    new = [_decide(router, raw, 2.0 + i, backends) for i, raw in enumerate(fresh)]
    follow = [_decide(router, raw, 2.0 + iterations + i, backends) for i, raw in enumerate(followups)]
    new_p50, new_p99 = _percentiles([t for t, _ in new])
    follow_p50, follow_p99 = _percentiles([t for t, _ in follow])
    return {
        "backends": size,
        "index_entries": entries,
        "index_mib": round(memory / 2**20, 1),
        "bytes_per_entry": round(memory / entries, 1),
        "iterations": iterations,
        "new_8kb_p50_us": new_p50,
        "new_8kb_p99_us": new_p99,
        "followup_84kb_p50_us": follow_p50,
        "followup_84kb_p99_us": follow_p99,
        "new_label": new[-1][1],
        "followup_label": follow[-1][1],
    }


def cases(quick: bool) -> list[Case]:
    """All body x index sizes; `quick` trims iterations for smoke runs."""
    out = []
    for entries in INDEX_SIZES:
        for size in BODY_SIZES:
            iterations = max(20, 20_000_000 // size) if not quick else 5
            out.append(Case(size, entries, min(iterations, 1000)))
    return out


def main(block_size: int, quick: bool, precise: bool = False, backends: Sequence[int] = ()) -> None:
    if backends:
        for size in backends:
            print(orjson.dumps(run_scale(size, 20 if quick else 300, block_size)).decode(), flush=True)
        return
    if precise:
        for size in BODY_SIZES[:2]:
            print(orjson.dumps(run_precise(size, 5 if quick else 200)).decode(), flush=True)
        return
    for case in cases(quick):
        print(orjson.dumps(run_case(case, block_size)).decode(), flush=True)
