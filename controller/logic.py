"""Pods + policy -> status: the operator's whole logic, as plain functions of plain dicts.

A pod is a ready backend when its Ready condition is True, it is not terminating, it has an IP,
and the target port resolves on it (a number, or a container port name). The selector and ports are
the policy's own, or those of the InferencePool it references (`spec.poolRef`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import orjson

from controller.reuse import POLICY_ANNOTATION
from extproc.core.backends import Role
from extproc.core.policy import MODELS_KEY, ROLE_LABELS, StatusBackend, routing_changes
from extproc.core.settings import Settings

_DEFAULTS = Settings()  # what spec.routing's values are checked against (as the ext_proc applies them)
# A status is one object, and etcd refuses one past 1.5 MiB: a status too large to write would keep
# the last backends published (deleted pods' addresses included) for good. So it names at most
# MAX_BACKENDS backends taking at most MAX_BACKENDS_BYTES written (a condition says when more are
# selected), each with a bounded model list, and every condition message is cut to MAX_MESSAGE
# characters. (The counts alone did not bound it: 190 pods naming 32 long models each took 1.5 MiB.)
MAX_BACKENDS = 4096
MAX_BACKENDS_BYTES = 1 << 20
MAX_MODELS = 32
MAX_MODEL_NAME = 256
MAX_MESSAGE = 1024


def selector_matches(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """Kubernetes LabelSelector semantics: every matchLabels pair and every expression must hold.

    An empty selector matches nothing here: a policy must say which pods it routes to.
    """
    match_labels = selector.get("matchLabels") or {}
    expressions = selector.get("matchExpressions") or []
    if not match_labels and not expressions:
        return False
    if any(labels.get(key) != value for key, value in match_labels.items()):
        return False
    for expression in expressions:
        key, operator = expression["key"], expression["operator"]
        values = frozenset(
            expression.get("values") or ()
        )  # (a list's `in` is a scan: 120,000 values, 0.66 s a 1,000 pods)
        present = key in labels
        if operator == "In" and not (present and labels[key] in values):
            return False
        if operator == "NotIn" and present and labels[key] in values:
            return False
        if operator == "Exists" and not present:
            return False
        if operator == "DoesNotExist" and present:
            return False
    return True


def pod_summary(pod: Mapping[str, Any]) -> dict[str, Any]:
    """What the operator keeps of a pod: small, and all that status needs."""
    metadata = pod.get("metadata") or {}
    status = pod.get("status") or {}
    ports: dict[str, int] = {}
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name"):
                ports[port["name"]] = port["containerPort"]
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    return {
        "name": metadata.get("name", ""),
        "uid": metadata.get("uid", ""),
        "labels": dict(metadata.get("labels") or {}),
        "models": (metadata.get("labels") or {}).get(MODELS_KEY) or (metadata.get("annotations") or {}).get(MODELS_KEY),
        "ip": status.get("podIP") or "",
        "policy": (metadata.get("annotations") or {}).get(POLICY_ANNOTATION),  # an ext_proc pod's policy
        "ready": ready and not metadata.get("deletionTimestamp"),
        "ports": ports,
    }


def pool_summary(pool: Mapping[str, Any]) -> dict[str, Any]:
    """What the operator keeps of an InferencePool: its name, pod selector and target ports."""
    spec = pool.get("spec") or {}
    metadata = pool.get("metadata") or {}
    return {
        "name": metadata.get("name", ""),
        "uid": metadata.get("uid", ""),
        "selector": dict(spec.get("selector") or {}),
        "targetPorts": [p["number"] for p in spec.get("targetPorts") or [] if isinstance(p.get("number"), int)],
    }


class Target(NamedTuple):
    """Which pods a policy routes to and on which ports, wherever they are declared; `problem` is
    (reason, message) when there is nothing to select with."""

    selector: Mapping[str, Any]
    ports: list[int | str]
    problem: tuple[str, str] | None = None


def target(spec: Mapping[str, Any], pools: Iterable[Mapping[str, Any]]) -> Target:
    """The policy's own selector and targetPort, or those of the InferencePool it references."""
    ref = spec.get("poolRef")
    if not ref:
        return Target(spec.get("selector") or {}, [spec["targetPort"]])
    pool = next((p for p in pools if p["name"] == ref.get("name")), None)
    if pool is None:
        return Target(
            {}, [], ("PoolNotFound", f"InferencePool {ref.get('name')!r} not found in the policy's namespace")
        )
    if not pool["targetPorts"]:
        return Target({}, [], ("PoolHasNoPorts", f"InferencePool {pool['name']!r} has no targetPorts"))
    return Target(pool["selector"], list(pool["targetPorts"]))


def _port(target_port: int | str, pod: Mapping[str, Any]) -> int | None:
    if isinstance(target_port, int):
        return target_port
    if target_port.isascii() and target_port.isdigit():  # ("²" is a digit too, and no number)
        return int(target_port)
    port: int | None = pod["ports"].get(target_port)
    return port


def _models(spec: Mapping[str, Any], pod: Mapping[str, Any]) -> list[str]:
    """The models a backend serves: the policy's list, else the pod's label or annotation; at
    most MAX_MODELS names of at most MAX_MODEL_NAME characters (a status must fit etcd's object
    limit whatever a pod's author writes)."""
    names = spec["models"] if spec.get("models") else {m.strip() for m in (pod["models"] or "").split(",")}
    return sorted({n for n in names if isinstance(n, str) and n and len(n) <= MAX_MODEL_NAME})[:MAX_MODELS]


def _role(spec: Mapping[str, Any], pod: Mapping[str, Any]) -> str:
    """The policy's role for every pod, else the pod's role label; a label naming no role counts
    as both (the pod still serves, whole requests)."""
    if spec.get("role"):
        return str(spec["role"])
    labels = pod["labels"]
    value = next((labels[key] for key in ROLE_LABELS if key in labels), Role.BOTH)
    try:
        return Role.parse(value).value
    except ValueError:
        return Role.BOTH.value


def backends(spec: Mapping[str, Any], to: Target, pods: Iterable[Mapping[str, Any]]) -> tuple[list[StatusBackend], int]:
    """The backends of every selected pod, one per target port (sorted by pod, then port), and how
    many selected pods lack a named port."""
    out: list[StatusBackend] = []
    portless = 0
    for pod in pods:
        if not selector_matches(to.selector, pod["labels"]):
            continue
        ports = [_port(p, pod) for p in to.ports]
        portless += None in ports
        ready = bool(pod["ready"] and pod["ip"])
        models = _models(spec, pod)
        role = _role(spec, pod)
        out.extend(
            StatusBackend(pod=pod["name"], ip=pod["ip"], port=port, ready=ready, models=models, role=role)
            for port in ports
            if port is not None
        )
    out.sort(key=lambda b: (b["pod"], b["port"]))
    return out, portless


def _condition(kind: str, ok: bool, reason: str, message: str, previous: Mapping[str, Any], now: str) -> dict[str, Any]:
    status = "True" if ok else "False"
    old = next((c for c in previous.get("conditions") or [] if c.get("type") == kind), None)
    since = old["lastTransitionTime"] if old and old.get("status") == status and old.get("lastTransitionTime") else now
    return {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message[:MAX_MESSAGE],
        "lastTransitionTime": since,
    }


def _routing_verdict(routing: Any) -> tuple[bool, str, str]:
    """Whether the ext_proc takes `spec.routing` as written, why not, in the condition's words.
    Values the CRD's schema lets through but the settings refuse (a bound the schema cannot say)
    are refused here too, so the condition says what the ext_procs do: keep their last settings."""
    try:
        changes, unknown = routing_changes(routing)
        dataclasses.replace(_DEFAULTS, **changes)
    except (ValueError, TypeError) as exc:
        return False, "InvalidValue", f"spec.routing not applied, the last accepted settings kept: {exc}"
    if unknown:
        return False, "UnknownFields", f"spec.routing fields kvroute does not know, ignored: {', '.join(unknown)}"
    return True, "Accepted", "every spec.routing field is known"


def _within_bounds(found: list[StatusBackend]) -> list[StatusBackend]:
    """The backends a status names: all of them, or as many as MAX_BACKENDS and MAX_BACKENDS_BYTES
    allow, the ready ones first (each pod's ports together)."""
    sizes = [len(orjson.dumps(backend)) for backend in found]
    if len(found) <= MAX_BACKENDS and sum(sizes) <= MAX_BACKENDS_BYTES:
        return found
    kept: list[StatusBackend] = []
    taken = 0
    for size, backend in sorted(zip(sizes, found, strict=True), key=lambda pair: not pair[1]["ready"]):
        if len(kept) == MAX_BACKENDS or taken + size > MAX_BACKENDS_BYTES:
            break
        kept.append(backend)
        taken += size
    return sorted(kept, key=lambda b: (b["pod"], b["port"]))


def desired_status(
    policy: Mapping[str, Any],
    pods: Iterable[Mapping[str, Any]],
    now: str,
    pools: Iterable[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """The status the policy should have, given the pods and InferencePools of its namespace."""
    spec = policy.get("spec") or {}
    previous = policy.get("status") or {}
    to = target(spec, pools)
    found, portless = backends(spec, to, pods)
    selected = len(found)
    found = _within_bounds(found)
    ready = sum(b["ready"] for b in found)
    if to.problem:
        reason, message = to.problem
    elif ready:
        reason, message = "ReadyPods", f"{ready} of {len(found)} selected backends are ready"
    elif found:
        reason, message = "NoReadyPods", f"none of {len(found)} selected backends is ready"
    elif portless:
        reason, message = "PortNotFound", f"{portless} selected pods have no port {to.ports[0]!r}"
    else:
        reason, message = "NoMatchingPods", "no pod matches the selector"
    if portless and found:
        message += f"; {portless} selected pods have no port {to.ports[0]!r}"
    if selected > len(found):
        message += f"; {selected} backends selected, the status names the first {len(found)} (the ready ones first)"
    available = _condition("BackendsAvailable", ready > 0, reason, message, previous, now)
    routable = _condition(
        "Ready",
        ready > 0,
        "Reconciled" if ready else "NoBackends",
        f"routing to {ready} backends" if ready else "no backend to route to",
        previous,
        now,
    )
    accepted = _condition("RoutingAccepted", *_routing_verdict(spec.get("routing")), previous, now)
    return {
        "backends": found,
        "readyBackends": ready,
        "observedGeneration": (policy.get("metadata") or {}).get("generation", 0),
        "conditions": [routable, available, accepted],
    }


def _comparable(status: Mapping[str, Any]) -> dict[str, Any]:
    conditions = [{k: v for k, v in c.items() if k != "lastTransitionTime"} for c in status.get("conditions") or []]
    comparable = {**{k: v for k, v in status.items() if k not in ("conditions", "kopf")}, "conditions": conditions}
    if isinstance(status.get("reuse"), Mapping):  # a ratio not known yet is written null, stored absent
        comparable["reuse"] = {k: v for k, v in status["reuse"].items() if v is not None}
    return comparable


def stale_status_keys(current: Mapping[str, Any] | None, desired: Mapping[str, Any]) -> list[str]:
    """Keys the stored status has and the operator no longer writes (a reuse summary from a run
    that read reuse, say): each would make every comparison differ, and never go by a merge patch
    that leaves it out."""
    return [key for key in current or {} if key not in desired and key != "kopf"]


def status_differs(current: Mapping[str, Any] | None, desired: Mapping[str, Any]) -> bool:
    """Whether a patch is needed; transition times alone never cause one."""
    return _comparable(current or {}) != _comparable(desired)
