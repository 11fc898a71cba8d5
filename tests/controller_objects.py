"""What the operator's tests share: policies' status as the logic computes it, index records."""

from __future__ import annotations

from typing import Any

from controller import logic

T0, T1 = "2026-11-29T10:00:00Z", "2026-11-29T10:05:00Z"


def summaries(*pods: dict[str, Any]) -> list[dict[str, Any]]:
    return [logic.pod_summary(p) for p in pods]


def status(spec_policy: dict[str, Any], *pods: dict[str, Any], now: str = T0) -> dict[str, Any]:
    return logic.desired_status(spec_policy, summaries(*pods), now)


def pools(*bodies: dict[str, Any]) -> list[dict[str, Any]]:
    return [logic.pool_summary(b) for b in bodies]


def record(namespace: str, body: dict[str, Any]) -> dict[str, Any]:
    """What the policy index holds for a policy."""
    return {
        "name": body["metadata"]["name"],
        "metadata": body["metadata"],
        "spec": body["spec"],
        "status": body["status"],
    }
