"""Pods + policy -> status: the operator's whole logic, as plain functions of plain dicts.

A pod is a ready backend when its Ready condition is True, it is not terminating, it has an IP,
and the policy's target port resolves on it (a number, or a container port name).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from controller.crd import MODELS_KEY, StatusBackend, routing_changes


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
        key, operator, values = expression["key"], expression["operator"], expression.get("values") or []
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
        "labels": dict(metadata.get("labels") or {}),
        "models": (metadata.get("labels") or {}).get(MODELS_KEY) or (metadata.get("annotations") or {}).get(MODELS_KEY),
        "ip": status.get("podIP") or "",
        "ready": ready and not metadata.get("deletionTimestamp"),
        "ports": ports,
    }


def _port(target: int | str, pod: Mapping[str, Any]) -> int | None:
    if isinstance(target, int):
        return target
    if target.isdigit():
        return int(target)
    return pod["ports"].get(target)


def _models(spec: Mapping[str, Any], pod: Mapping[str, Any]) -> list[str]:
    if spec.get("models"):
        return list(spec["models"])
    return sorted({m.strip() for m in (pod["models"] or "").split(",") if m.strip()})


def backends(spec: Mapping[str, Any], pods: Iterable[Mapping[str, Any]]) -> tuple[list[StatusBackend], int]:
    """The backends of every selected pod (sorted by name), and how many selected pods lack the port."""
    out = []
    portless = 0
    for pod in pods:
        if not selector_matches(spec.get("selector") or {}, pod["labels"]):
            continue
        port = _port(spec["targetPort"], pod)
        if port is None:
            portless += 1
            continue
        out.append(
            StatusBackend(
                pod=pod["name"],
                ip=pod["ip"],
                port=port,
                ready=bool(pod["ready"] and pod["ip"]),
                models=_models(spec, pod),
            )
        )
    out.sort(key=lambda b: b["pod"])
    return out, portless


def _condition(kind: str, ok: bool, reason: str, message: str, previous: Mapping[str, Any], now: str) -> dict[str, Any]:
    status = "True" if ok else "False"
    old = next((c for c in previous.get("conditions") or [] if c.get("type") == kind), None)
    since = old["lastTransitionTime"] if old and old.get("status") == status and old.get("lastTransitionTime") else now
    return {"type": kind, "status": status, "reason": reason, "message": message, "lastTransitionTime": since}


def desired_status(policy: Mapping[str, Any], pods: Iterable[Mapping[str, Any]], now: str) -> dict[str, Any]:
    """The status the policy should have, given the pods of its namespace."""
    spec = policy.get("spec") or {}
    previous = policy.get("status") or {}
    found, portless = backends(spec, pods)
    ready = sum(b["ready"] for b in found)
    if ready:
        reason, message = "ReadyPods", f"{ready} of {len(found)} selected pods are ready"
    elif found:
        reason, message = "NoReadyPods", f"none of {len(found)} selected pods is ready"
    elif portless:
        reason, message = "PortNotFound", f"{portless} selected pods have no port {spec.get('targetPort')!r}"
    else:
        reason, message = "NoMatchingPods", "no pod matches the selector"
    if portless and found:
        message += f"; {portless} selected pods have no port {spec.get('targetPort')!r}"
    available = _condition("BackendsAvailable", ready > 0, reason, message, previous, now)
    routable = _condition(
        "Ready",
        ready > 0,
        "Reconciled" if ready else "NoBackends",
        f"routing to {ready} backends" if ready else "no backend to route to",
        previous,
        now,
    )
    _, unknown = routing_changes(spec.get("routing"))
    accepted = _condition(
        "RoutingAccepted",
        not unknown,
        "UnknownFields" if unknown else "Accepted",
        f"spec.routing fields kvroute does not know, ignored: {', '.join(unknown)}"
        if unknown
        else "every spec.routing field is known",
        previous,
        now,
    )
    return {
        "backends": found,
        "readyBackends": ready,
        "observedGeneration": (policy.get("metadata") or {}).get("generation", 0),
        "conditions": [routable, available, accepted],
    }


def _comparable(status: Mapping[str, Any]) -> dict[str, Any]:
    conditions = [{k: v for k, v in c.items() if k != "lastTransitionTime"} for c in status.get("conditions") or []]
    return {**{k: v for k, v in status.items() if k not in ("conditions", "kopf")}, "conditions": conditions}


def status_differs(current: Mapping[str, Any] | None, desired: Mapping[str, Any]) -> bool:
    """Whether a patch is needed; transition times alone never cause one."""
    return _comparable(current or {}) != _comparable(desired)
