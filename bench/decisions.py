"""`kvroute-dev bench decisions`: a trace through the routing core alone, deterministically.

No processes, no clocks, no concurrency noise: trace time is the clock, a fixed key hashes, four
backends serve, each request's response starts at once and it ends when the eighth request
after it begins; a third of the requests carry a session header; backend 3 leaves for requests
1,500-1,999, and backend 1 reports a KV size. The digest of every decision (label, backend,
second choice, matched/total blocks) shows whether a change of code changed any routing.
"""

from __future__ import annotations

import hashlib
from collections import Counter, deque
from pathlib import Path
from typing import Any

import orjson

from bench import trace
from bench.prompts import PromptBuilder
from extproc.core.backends import Backend
from extproc.core.request import parse_request
from extproc.core.router import Exchange, ResponseStart, Router
from extproc.core.settings import Settings

WINDOW = 8
BACKENDS = [Backend(f"10.0.0.{i}:8000") for i in range(4)]


def run(path: Path, limit: int, out: Path | None = None) -> dict[str, Any]:
    """Replay `limit` requests of the trace; return hit rate, labels and the decisions' digest."""
    requests = trace.read(path, limit)
    builder = PromptBuilder("sim-model", 4.0, 16)
    router = Router(Settings(hash_key=bytes(16), capacity_blocks=3000))
    router.set_backend_capacity(BACKENDS[1].address, 2000 * 128)
    inflight: deque[Exchange] = deque()
    lines = []
    matched = total = 0
    for request in requests:
        now = request.timestamp_ms / 1000.0
        live = BACKENDS[:3] if 1500 <= request.index < 2000 else BACKENDS
        if request.index == 1500:
            router.remove_backend(BACKENDS[3].address)
        session = str(request.hash_ids[0] % 40) if request.hash_ids else "0"
        headers = {"x-session-id": session} if request.index % 3 == 0 else {}
        parsed = parse_request(orjson.dumps(builder.body(request)), headers, router.settings.session_headers)
        exchange = router.begin(parsed, live, now)
        decision = exchange.decision
        served = ResponseStart(decision.backend or "", known=True, status=200, from_upstream=True)
        router.response_started(exchange, served, now)
        inflight.append(exchange)
        if len(inflight) > WINDOW:
            inflight.popleft().end()
        matched += decision.matched_blocks
        total += decision.total_blocks
        blocks = f"{decision.matched_blocks}/{decision.total_blocks}"
        lines.append(f"{decision.label.value} {decision.backend} {decision.second} {blocks}")
    text = "\n".join(lines)
    if out is not None:
        out.write_text(text)
    return {
        "requests": len(lines),
        "hit_rate": round(matched / total, 4) if total else 0.0,
        "labels": dict(Counter(line.split()[0] for line in lines)),
        "digest": hashlib.sha256(text.encode()).hexdigest(),
    }
