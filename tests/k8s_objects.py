"""Realistic Kubernetes objects for operator and follower tests."""

from __future__ import annotations

from typing import Any


def pod(
    name: str,
    ip: str = "10.1.0.1",
    ready: bool = True,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    terminating: bool = False,
    port_name: str = "http",
    port: int = 8000,
) -> dict[str, Any]:
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": "llm",
        "uid": f"uid-{name}",
        "labels": {"app": "vllm", **(labels or {})},
        "annotations": annotations or {},
    }
    if terminating:
        metadata["deletionTimestamp"] = "2026-11-29T10:00:00Z"
    status: dict[str, Any] = {
        "phase": "Running",
        "conditions": [
            {"type": "Initialized", "status": "True"},
            {"type": "Ready", "status": "True" if ready else "False"},
            {"type": "ContainersReady", "status": "True" if ready else "False"},
        ],
    }
    if ip:
        status["podIP"] = ip
        status["podIPs"] = [{"ip": ip}]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {
            "containers": [
                {
                    "name": "vllm",
                    "image": "vllm/vllm-openai:v0.11.0",
                    "ports": [{"name": port_name, "containerPort": port, "protocol": "TCP"}],
                }
            ]
        },
        "status": status,
    }


def policy(name: str = "default", generation: int = 1, **spec: Any) -> dict[str, Any]:
    body = {"selector": {"matchLabels": {"app": "vllm"}}, "targetPort": "http", **spec}
    return {
        "apiVersion": "kvroute.io/v1alpha1",
        "kind": "KVRoutingPolicy",
        "metadata": {"name": name, "namespace": "llm", "generation": generation},
        "spec": body,
        "status": {},
    }
