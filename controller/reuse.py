"""A policy's prefix-reuse attribution, summed over the ext_proc replicas that serve it, for its
status and `kubectl get kvrp`.

Why the operator reads the replicas rather than the replicas writing their status: it already
lists every pod, holds the only write right on `kvroutingpolicies/status` and writes one patch per
policy; replicas writing would each need that right (the ext_proc keeps read-only rights) and
would race on one object. The replicas' admin port serves `/metrics` unauthenticated (for
Prometheus), so the operator reads what Prometheus reads.

Sums are since each replica started: prompt, available and routed tokens are each replica's own
requests, so they add up; delivered tokens are an engine's whole traffic as every replica reads it
from the same counter, so they are taken once per backend (the largest replica's count), as the
metric's own help says. Prometheus over a window is the better view of a change; this is the
summary.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from prometheus_client.parser import text_string_to_metric_families

from extproc.core.engine import MAX_COUNTER

# Pod annotation the chart sets on ext_proc pods: the policy (namespace/name) they serve, or
# several, comma-separated (one ext_proc serving several labels its metrics by policy).
POLICY_ANNOTATION = "kvroute.io/policy"
ADMIN_PORT = "admin"  # the ext_proc container's port serving /metrics


class ReplicaReuse(NamedTuple):
    """One replica's counters (tokens)."""

    prompt: float
    available: float
    routed: float
    delivered: Mapping[str, float]  # backend -> tokens its engine found cached


_FAMILIES = {
    "kvroute_prompt_tokens": "prompt",
    "kvroute_reuse_available_tokens": "available",
    "kvroute_reuse_routed_tokens": "routed",
    "kvroute_reuse_delivered_tokens": "delivered",
}


def parse(text: str, policy: str = "") -> ReplicaReuse:
    """The attribution counters of one replica's `/metrics` text, `policy`'s alone where the
    replica serves several (its samples carry a `policy` label); ValueError if it is not
    Prometheus text or holds none of them."""
    sums = {"prompt": 0.0, "available": 0.0, "routed": 0.0}
    delivered: dict[str, float] = {}
    found = False
    for family in text_string_to_metric_families(text):
        field = _FAMILIES.get(family.name)
        if field is None:
            continue
        found = True
        for sample in family.samples:
            if not sample.name.endswith("_total") or sample.labels.get("policy", policy) != policy:
                continue
            if not 0.0 <= sample.value <= MAX_COUNTER:  # NaN, infinite, negative or past what JSON's
                raise ValueError(f"{sample.name} is {sample.value}")  # integers and a float count exactly
            if field == "delivered":
                backend = sample.labels.get("backend", "")
                delivered[backend] = delivered.get(backend, 0.0) + sample.value
            else:
                sums[field] += sample.value
    if not found:
        raise ValueError("no kvroute reuse counters in the metrics")
    return ReplicaReuse(sums["prompt"], sums["available"], sums["routed"], delivered)


def _ratio(part: float, whole: float) -> float | None:
    return round(part / whole, 3) if whole > 0 else None


def summary(replicas: Iterable[ReplicaReuse], expected: int) -> dict[str, Any]:
    """`status.reuse`: the sums, the ratios (None where nothing was served yet) and how many of
    the `expected` ready replicas answered."""
    read = list(replicas)
    delivered: dict[str, float] = {}
    for replica in read:
        for backend, tokens in replica.delivered.items():
            delivered[backend] = max(delivered.get(backend, 0.0), tokens)
    prompt = sum(r.prompt for r in read)
    available = sum(r.available for r in read)
    routed = sum(r.routed for r in read)
    engine = sum(delivered.values())
    return {
        "extprocs": len(read),
        "extprocsExpected": expected,
        "promptTokens": round(prompt),
        "availableTokens": round(available),
        "routedTokens": round(routed),
        "deliveredTokens": round(engine),
        "routingEfficiency": _ratio(routed, available),
        "predictionAccuracy": _ratio(engine, routed),
        "hitRate": _ratio(engine, prompt),
    }


RATIOS = ("routingEfficiency", "predictionAccuracy", "hitRate")
RATIO_STEP = 0.005  # a ratio's move worth writing the status at once (they are rounded to 0.001)


def worth_writing(before: Mapping[str, Any] | None, after: Mapping[str, Any]) -> bool:
    """Whether a new summary says something the last one written did not: other replica counts,
    a ratio known or unknown, or one moved by RATIO_STEP. The token sums grow with any traffic;
    alone they wait for the reader's refresh (a status holds every backend: rewriting it on each
    read sent the whole object to every ext_proc every 30 s)."""
    if before is None or any(before.get(k) != after.get(k) for k in ("extprocs", "extprocsExpected")):
        return True
    for key in RATIOS:
        old, new = before.get(key), after.get(key)
        if (old is None) != (new is None) or (old is not None and abs(new - old) >= RATIO_STEP):
            return True
    return False


def extproc_endpoints(
    policy: str, pods: Mapping[str, Iterable[Mapping[str, Any]]], trusted: Iterable[str] = ()
) -> list[tuple[str, str]]:
    """(pod, http://ip:port) of every ready ext_proc pod serving `policy` (namespace/name), among
    `pods` by namespace: only from the policy's own namespace or a `trusted` one (where the
    operator's installation runs the ext_procs). A pod elsewhere that claims the policy would add
    figures of its own to another namespace's status."""
    out = []
    for namespace in _readable(policy, trusted):
        for pod in pods.get(namespace, ()):
            port = pod["ports"].get(ADMIN_PORT)
            if _serves(pod, policy) and pod["ready"] and pod["ip"] and port:
                host = f"[{pod['ip']}]" if ":" in pod["ip"] else pod["ip"]
                out.append((pod["name"], f"http://{host}:{port}"))
    return sorted(out)


def untrusted_claims(
    policy: str, pods: Mapping[str, Iterable[Mapping[str, Any]]], trusted: Iterable[str] = ()
) -> list[str]:
    """namespace/pod of every pod that claims `policy` from a namespace `extproc_endpoints` does not
    read: reported, never summed."""
    readable = _readable(policy, trusted)
    return sorted(
        f"{namespace}/{pod['name']}"
        for namespace, entries in pods.items()
        if namespace not in readable
        for pod in entries
        if _serves(pod, policy)
    )


def _readable(policy: str, trusted: Iterable[str]) -> set[str]:
    """The namespaces whose ext_procs may report for `policy`: its own and the trusted ones."""
    return {policy.partition("/")[0], *trusted}


def _serves(pod: Mapping[str, Any], policy: str) -> bool:
    return policy in (pod.get("policy") or "").split(",")


def leading(peering_status: Mapping[str, Any] | None, own_priority: int, now: datetime.datetime) -> bool:
    """Whether this operator replica is the one kopf's peering lets work: no live peer in the
    peering object's status has a higher priority (kopf's own rule, read from the same object)."""
    for peer in (peering_status or {}).values():
        if not isinstance(peer, Mapping):
            continue
        try:
            seen = datetime.datetime.fromisoformat(str(peer["lastseen"]))
            alive = seen + datetime.timedelta(seconds=float(peer.get("lifetime", 60))) > now
            if alive and int(peer["priority"]) > own_priority:
                return False
        except (KeyError, TypeError, ValueError):
            continue  # a malformed entry is not a leader
    return True
