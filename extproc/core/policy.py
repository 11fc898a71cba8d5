"""The KVRoutingPolicy contract at run time, one leaf for the operator (writer) and the
ext_proc's follower (reader): API coordinates, the `status.backends` entry shape, and
`spec.routing` -> routing settings, derived from the settings' declarations (settings.py).
The CRD that enforces it is generated from this and the declarations by `tools/crd.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypedDict

from extproc.core.settings import Settings

GROUP = "kvroute.io"
VERSION = "v1alpha1"
PLURAL = "kvroutingpolicies"
KIND = "KVRoutingPolicy"
# The connect and read limits, in seconds, of every API call but a watch, the ext_proc's followers'
# and the operator's: kubernetes-asyncio sets none by default, so a call that met a half-open
# connection held its caller for good (a follower still saying it was connected while its
# backends froze; the operator's statuses, while its probes stayed green).
CALL_TIMEOUT = (10.0, 60.0)
POOL_GROUP, POOL_VERSION, POOL_PLURAL = (
    "inference.networking.k8s.io",
    "v1",
    "inferencepools",
)  # Gateway API Inference Extension
# InferenceObjective (llm-d; a request names one in x-llm-d-inference-objective): the current API
# first, then the deprecated one, read only where the current one is not installed (as llm-d does).
OBJECTIVE_APIS = (("llm-d.ai", "v1alpha2"), ("inference.networking.x-k8s.io", "v1alpha2"))
OBJECTIVE_PLURAL = "inferenceobjectives"
MODELS_KEY = "kvroute.io/models"  # pod label or annotation: comma-separated served model names
# Pod labels naming a server's role in a disaggregated fleet (prefill, decode, both): kvroute's own
# first, then llm-d's convention. Neither: both.
ROLE_LABELS = ("kvroute.io/role", "llm-d.ai/role")


class StatusBackend(TypedDict):
    """One selected pod in `status.backends`; the follower routes to the ready ones."""

    pod: str
    ip: str
    port: int
    ready: bool
    models: list[str]
    role: str  # prefill, decode or both (absent in a status written before roles: both)


def ready_backends(status: Mapping[str, Any] | None) -> list[tuple[str, str, list[str], str]]:
    """(ip, port, models, role) of every ready backend the operator published."""
    out = []
    for item in (status or {}).get("backends") or []:
        if item.get("ready") and item.get("ip") and item.get("port"):
            role = str(item.get("role") or "both")
            out.append((str(item["ip"]), str(item["port"]), list(item.get("models") or ()), role))
    return out


def objective_terms(objective: Mapping[str, Any]) -> tuple[str | None, int] | None:
    """An InferenceObjective's pool (its `poolRef` name) and priority (unset: 0; below 0:
    sheddable); None when malformed."""
    spec = objective.get("spec")
    if not isinstance(spec, Mapping):
        return None
    pool_ref = spec.get("poolRef")
    pool = pool_ref.get("name") if isinstance(pool_ref, Mapping) else None
    priority = spec.get("priority")
    if priority is None:
        priority = 0
    if isinstance(priority, bool) or not isinstance(priority, int) or not -(2**31) <= priority < 2**31:
        return None
    return (pool if isinstance(pool, str) else None), priority


def policy_fields() -> dict[str, dataclasses.Field[Any]]:
    """`spec.routing` key -> the routing setting it sets (never a secret one)."""
    return {
        f.metadata["policy"]: f
        for f in dataclasses.fields(Settings)
        if f.metadata["policy"] and not f.metadata["secret"]
    }


def routing_changes(routing: Mapping[str, Any] | None) -> tuple[dict[str, Any], list[str]]:
    """`spec.routing` -> (Settings field changes, unknown keys). Values are normalised and validated
    when the changes are applied to Settings, as from any other source; unknown keys are returned
    so callers can report them."""
    known = policy_fields()
    changes: dict[str, Any] = {}
    unknown = []
    for key, value in (routing or {}).items():
        f = known.get(key)
        if f is None:
            unknown.append(key)
        elif f.metadata["policy_value"] is not None:
            changes.update(f.metadata["policy_value"](value))
        else:
            changes[f.name] = value
    return changes, sorted(unknown)
