"""Whom a request belongs to, in the ecosystem's words: its objective (an `InferenceObjective`,
whose priority picks its band; below zero is sheddable), its flow (whom it is fair-shared for) and
its TTFT objective. The headers are llm-d's, the current name first and then the alias gateways
still send; the gateway sets them, never the client (the gateway strips them from clients).

Every value is bounded: a flow id longer than `MAX_FLOW_ID` is replaced by a digest of it, a TTFT
objective that is not a positive number of milliseconds below a day is ignored, an objective no
one defined gets the default priority. None of it is an error.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from typing import NamedTuple

from extproc.core.settings import MAX_FLOW_ID

OBJECTIVE_HEADERS = ("x-llm-d-inference-objective", "x-gateway-inference-objective")
FAIRNESS_HEADERS = ("x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id")
TTFT_HEADERS = ("x-llm-d-slo-ttft-ms", "x-slo-ttft-ms")
# The request's priority for the engine's own scheduler: vLLM (0.32) reads it before the body's
# `priority` field and serves lower first. kvroute sets it on what it routes (minus the objective's
# priority); a client's own copy never reaches an engine (the gateway strips or overwrites it).
ENGINE_PRIORITY_HEADER = "x-vllm-priority"
DEFAULT_FLOW = "default-flow"  # llm-d's name for requests that name no flow
MAX_TTFT_MS = 86_400_000.0


class RequestClass(NamedTuple):
    """A request's place in flow control."""

    priority: int
    flow: str
    ttft_s: float | None  # its TTFT objective, if it has one
    objective: str | None  # the objective it named, if any
    known: bool  # the objective it named is defined (or it named none)


def _first(headers: Mapping[str, str], names: tuple[str, ...]) -> str:
    for name in names:
        value = headers.get(name, "").strip()
        if value:
            return value
    return ""


def bounded_id(value: str, limit: int = MAX_FLOW_ID) -> str:
    """A client-named identifier (a flow, a tenant) kept apart from every other, at most about
    `limit` characters: a longer one is replaced by a digest of it."""
    if len(value) <= limit:
        return value
    return "sha256:" + hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def _ttft_s(value: str) -> float | None:
    try:
        ms = float(value)
    except ValueError:
        return None
    return ms / 1000 if math.isfinite(ms) and 0 < ms <= MAX_TTFT_MS else None


def objective_priority(headers: Mapping[str, str], priorities: Mapping[str, int], default_priority: int = 0) -> int:
    """The priority of the objective the request names (the default if it names none, or one not defined)."""
    return _priority(_first(headers, OBJECTIVE_HEADERS), priorities, default_priority)


def _priority(objective: str, priorities: Mapping[str, int], default_priority: int) -> int:
    return priorities.get(objective, default_priority) if objective else default_priority


def classify(
    headers: Mapping[str, str], priorities: Mapping[str, int], tenant_header: str = "", default_priority: int = 0
) -> RequestClass:
    """The request's class from its headers (lower-case names, as Envoy sends them). `priorities`:
    each defined objective's priority. The flow is the fairness id, else the tenant, else the
    default flow."""
    named = _first(headers, OBJECTIVE_HEADERS)
    objective = named or None
    priority = _priority(named, priorities, default_priority)
    flow = _first(headers, FAIRNESS_HEADERS) or (tenant_header and headers.get(tenant_header, "").strip())
    ttft = _first(headers, TTFT_HEADERS)
    return RequestClass(
        priority,
        bounded_id(flow) if flow else DEFAULT_FLOW,
        _ttft_s(ttft) if ttft else None,
        objective,
        objective is None or objective in priorities,
    )
