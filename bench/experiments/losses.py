"""`kvroute-dev bench losses`: where a router's cache reuse was lost, from a compare run's records.

The hit rate says how much a router reused; these figures say where the rest went. Per router:
follow-up turns by the share of their prompt found cached; returning turns, those sent to the
backend that served their session's previous turn, and how much of that turn's reusable prompt
they found evicted there; moves to another backend; and each backend's live sessions (started,
with turns still to come) and their footprint (tokens of each one's last prompt) over the run.
Side by side with a reference router: the requests where the router got at least `threshold`
fewer (or more) cached tokens, by the router's decision label.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from bench.workloads.trace import BLOCK_TOKENS, TraceRequest, read

THRESHOLD_TOKENS = 256  # a difference of two vLLM-CPU blocks counts as a win or a loss
POORLY_CACHED = 0.1  # a follow-up that found less than this share of its prompt cached
EVICTED = 0.5  # a returning turn that found less than this share of its reusable prompt


@dataclass(frozen=True, slots=True)
class Turn:
    """One served request of a session, with what the trace says it could reuse."""

    index: int
    session: str
    backend: str  # "" where the router does not say (sglang-router on vLLM)
    sent_at: float
    prompt_tokens: int
    cached_tokens: int
    decision: str
    reusable_tokens: int  # of its prompt, what the session's previous turn had computed (0 on a first turn)
    previous: Turn | None

    @property
    def lost_tokens(self) -> int:
        """Of what its previous turn computed, the tokens it did not find cached."""
        return max(0, self.reusable_tokens - self.cached_tokens)


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count


def turns(requests: Sequence[TraceRequest], records: Sequence[dict[str, Any]]) -> list[Turn]:
    """The served requests as session turns, in the order they were sent."""
    by_index = {r.index: r for r in requests}
    served = sorted((r for r in records if r["status"] == 200), key=lambda r: r["sent_at"])
    last: dict[str, Turn] = {}
    out: list[Turn] = []
    for record in served:
        request = by_index[record["index"]]
        session = request.session_id or f"request-{request.index}"
        previous = last.get(session)
        reusable = 0
        if previous is not None and request.hash_ids:
            shared = _common(by_index[previous.index].hash_ids, request.hash_ids)
            # the shared blocks in the engine's tokens (its prompt is the trace's length, templated)
            scale = record["prompt_tokens"] / max(1, request.input_tokens)
            reusable = min(previous.prompt_tokens, round(shared * BLOCK_TOKENS * scale))
        turn = Turn(
            record["index"],
            session,
            record["backend"] or "",
            record["sent_at"],
            record["prompt_tokens"],
            record["cached_tokens"],
            record.get("decision") or "-",  # "-": the router does not say why
            reusable,
            previous,
        )
        last[session] = turn
        out.append(turn)
    return out


def live_sessions(run: Sequence[Turn]) -> dict[str, dict[str, float]]:
    """Per backend, over the run (sampled at every send): sessions whose last turn it served and
    which have turns to come, and the tokens of their last prompts."""
    final = {t.session: t.index for t in run}
    holding: dict[str, Turn] = {}  # live session -> its latest turn
    counts: dict[str, list[int]] = defaultdict(list)
    tokens: dict[str, list[int]] = defaultdict(list)
    backends = sorted({t.backend for t in run})
    if not backends:
        return {}
    for turn in run:
        holding[turn.session] = turn
        if turn.index == final[turn.session]:
            del holding[turn.session]
        for backend in backends:
            mine = [t for t in holding.values() if t.backend == backend]
            counts[backend].append(len(mine))
            tokens[backend].append(sum(t.prompt_tokens for t in mine))
    out = {}
    for backend in backends:
        out[backend] = {
            "live_mean": round(statistics.mean(counts[backend]), 2),
            "live_max": max(counts[backend]),
            "footprint_mean_tokens": round(statistics.mean(tokens[backend])),
            "footprint_max_tokens": max(tokens[backend]),
        }
    if len(backends) == 2:
        a, b = (counts[x] for x in backends)
        difference = statistics.mean(abs(x - y) for x, y in zip(a, b, strict=True))
        out["imbalance"] = {"live_mean_abs_difference": round(difference, 2)}
    return out


def summary(run: Sequence[Turn]) -> dict[str, Any]:
    """One router's losses."""
    followups = [t for t in run if t.previous is not None]
    placed = [(t, t.previous.backend) for t in followups if t.previous is not None and t.backend and t.previous.backend]
    returning = [t for t, before in placed if t.backend == before and t.reusable_tokens]
    moved = [t for t, before in placed if t.backend != before]
    evicted = [t for t in returning if t.cached_tokens < EVICTED * t.reusable_tokens]
    lost = sum(t.lost_tokens for t in returning)
    first_label = {t.session: t.decision for t in run if t.previous is None}
    prompt = sum(t.prompt_tokens for t in run)
    return {
        "requests": len(run),
        "cached_share": round(sum(t.cached_tokens for t in run) / prompt, 4) if prompt else None,
        "first_turns_by_label": dict(Counter(t.decision for t in run if t.previous is None)),
        "followups": len(followups),
        "followups_poorly_cached": sum(1 for t in followups if t.cached_tokens < POORLY_CACHED * t.prompt_tokens),
        "returning": len(returning),
        "returning_evicted": len(evicted),
        "returning_lost_tokens": lost,
        "returning_lost_share": round(lost / sum(t.reusable_tokens for t in returning), 4) if returning else None,
        "evicted_by_first_placement": dict(Counter(first_label[t.session] for t in evicted)),
        "evicted_by_backend": dict(Counter(t.backend for t in evicted)),
        "moved": len(moved),
        "moved_lost_tokens": sum(t.lost_tokens for t in moved),
        "by_backend": live_sessions([t for t in run if t.backend]),
    }


def against(run: Sequence[Turn], reference: Sequence[Turn], threshold: int = THRESHOLD_TOKENS) -> dict[str, Any]:
    """Request by request against a reference router's run of the same trace."""
    theirs = {t.index: t for t in reference}
    worse: Counter[str] = Counter()
    better: Counter[str] = Counter()
    for turn in run:
        other = theirs.get(turn.index)
        if other is None:
            continue
        if turn.cached_tokens <= other.cached_tokens - threshold:
            worse[turn.decision] += 1
        elif turn.cached_tokens >= other.cached_tokens + threshold:
            better[turn.decision] += 1
    return {
        "worse_by_label": dict(worse),
        "worse": sum(worse.values()),
        "better_by_label": dict(better),
        "better": sum(better.values()),
    }


def report(results_dir: Path, trace: Path, reference: str | None = None) -> dict[str, Any]:
    """Every router's losses in a compare run (its results.json and records/), and each against
    `reference` when given."""
    results = orjson.loads((results_dir / "results.json").read_bytes())
    requests = read(trace, results["requests"], results.get("max_input_tokens"))
    runs = {
        name: turns(requests, orjson.loads((results_dir / "records" / f"{name}.json").read_bytes()))
        for name in results["routers"]
    }
    out: dict[str, Any] = {name: summary(run) for name, run in runs.items()}
    if reference is not None:
        for name, run in runs.items():
            if name != reference:
                out[name]["against_" + reference] = against(run, runs[reference])
    return out
