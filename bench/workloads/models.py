"""A synthetic multi-model, multi-tenant workload: the agentic shape (skew.py) once per model,
each copy with its own seed, session ids, tenants and blocks (only the shared system prompts
keep their ids, as an agent's configuration is the same whatever the model), merged by time.

Each request asks for its model (`TraceRequest.adapter`, which the prompt builder puts in the
body's `model`), and each session belongs to one of `tenants` tenants (`tenant_of`), sent as the
fairness header.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from bench.workloads import skew
from bench.workloads.trace import TraceRequest, from_records

FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
ID_SPACE = 1 << 32  # hash ids one copy's sessions may use
CHARS_PER_TOKEN = 4.0  # the simulator's, for the prompt builder


def generate(models: Sequence[str], sessions: int, tenants: int = 1, seed: int = 0) -> list[TraceRequest]:
    """`sessions` agentic sessions per model, indexed in time order."""
    shape = dataclasses.replace(skew.SHAPES["agentic"], light_sessions=sessions)
    merged: list[TraceRequest] = []
    for number, model in enumerate(models):
        copy = from_records(skew.generate(shape, seed=seed * len(models) + number + 1))
        shared = shape.system_prompts * shape.system_blocks  # the system prompts' ids come first
        offset = (seed * len(models) + number) * ID_SPACE  # each copy's own blocks, its own ids
        for request in copy:
            request = dataclasses.replace(
                request, hash_ids=tuple(h if h < shared else h + offset for h in request.hash_ids)
            )
            session = int(str(request.session_id).rsplit("-", 1)[-1])
            tenant = f"tenant-{(session + number) % tenants}"
            named = f"{tenant}/{model}/{request.session_id}"
            merged.append(dataclasses.replace(request, adapter=model, session_id=named))
    merged.sort(key=lambda r: (r.timestamp_ms, r.adapter or "", r.index))
    return [dataclasses.replace(r, index=i) for i, r in enumerate(merged)]


def tenant_of(request: TraceRequest) -> str:
    """The tenant a generated request belongs to."""
    return str(request.session_id).split("/", 1)[0]


def tenant_headers(request: TraceRequest) -> dict[str, str]:
    """The headers naming a generated request's tenant (its flow)."""
    return {FAIRNESS_HEADER: tenant_of(request)}
