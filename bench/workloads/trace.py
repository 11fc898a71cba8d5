"""Request traces: Mooncake JSONL (timestamp, input/output lengths, per-block hash ids, optional
session_id) or JSONL of ready OpenAI chat requests (`{"body": {...}, "session_id"?, "timestamp"?}`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson

BLOCK_TOKENS = 512  # Mooncake's hash ids each stand for 512 prompt tokens


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace. `body` is set for ready OpenAI requests, `hash_ids` for Mooncake."""

    index: int
    timestamp_ms: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()
    session_id: str | None = None
    body: dict[str, Any] | None = field(default=None, compare=False)
    adapter: str | None = None  # the LoRA adapter it asks for (its `model`), else the fleet's model


def _parse(index: int, record: dict[str, Any]) -> TraceRequest:
    session = record.get("session_id")
    session = None if session is None else str(session)
    adapter = record.get("adapter")
    adapter = None if adapter is None else str(adapter)
    if "body" in record:
        body = record["body"]
        if not isinstance(body, dict) or "messages" not in body:
            raise ValueError(f"line {index + 1}: 'body' must be an OpenAI chat request")
        output = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        return TraceRequest(index, float(record.get("timestamp", 0)), 0, int(output), (), session, body, adapter)
    try:
        return TraceRequest(
            index,
            float(record["timestamp"]),
            int(record["input_length"]),
            int(record["output_length"]),
            tuple(int(h) for h in record["hash_ids"]),
            session,
            adapter=adapter,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"line {index + 1}: not a Mooncake record ({exc})") from None


def read(path: Path, limit: int | None = None, max_input_tokens: int | None = None) -> list[TraceRequest]:
    """The first `limit` requests of a trace, in file order; with `max_input_tokens`, each prompt
    cut to that many tokens (`truncate`)."""
    out: list[TraceRequest] = []
    with path.open("rb") as lines:
        for line in lines:
            if limit is not None and len(out) >= limit:
                break
            if line.strip():
                out.append(_parse(len(out), orjson.loads(line)))
    return truncate(out, max_input_tokens) if max_input_tokens else out


def from_records(records: list[dict[str, Any]]) -> list[TraceRequest]:
    """Requests from trace records already in memory (a generated workload's), in their order."""
    return [_parse(index, record) for index, record in enumerate(records)]


def truncate(requests: list[TraceRequest], max_input_tokens: int) -> list[TraceRequest]:
    """Keep at most `max_input_tokens` of each prompt (whole leading blocks), for backends with a
    short context or slow prefill. Prefix sharing among the kept blocks is unchanged."""
    out = []
    for request in requests:
        if request.body is not None or request.input_tokens <= max_input_tokens:
            out.append(request)
            continue
        keep = max(1, max_input_tokens // BLOCK_TOKENS)
        out.append(replace(request, input_tokens=keep * BLOCK_TOKENS, hash_ids=request.hash_ids[:keep]))
    return out


def working_set_blocks(requests: list[TraceRequest]) -> int:
    """Distinct 512-token prefix blocks a trace slice touches (its cache working set): a trie of
    hash ids, since a block is only reusable after the same preceding blocks."""
    nodes: dict[tuple[int, int], int] = {}
    for request in requests:
        parent = -1
        for hash_id in request.hash_ids:
            parent = nodes.setdefault((parent, hash_id), len(nodes))
    return len(nodes)


def chains(requests: list[TraceRequest]) -> list[list[TraceRequest]]:
    """Requests that must go one after another: a session's requests in order; any other request
    alone. Ordered by their first request."""
    groups: dict[str, list[TraceRequest]] = {}
    out: list[list[TraceRequest]] = []
    for request in requests:
        if request.session_id is None:
            out.append([request])
        elif request.session_id in groups:
            groups[request.session_id].append(request)
        else:
            groups[request.session_id] = [request]
            out.append(groups[request.session_id])
    return out
