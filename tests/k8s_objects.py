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


def pool_policy(pool: str, name: str = "default", **spec: Any) -> dict[str, Any]:
    """A KVRoutingPolicy whose backends come from an InferencePool."""
    body = policy(name, **spec)
    del body["spec"]["selector"], body["spec"]["targetPort"]
    body["spec"]["poolRef"] = {"name": pool}
    return body


def inference_pool(name: str, ports: tuple[int, ...] = (8000,), labels: dict[str, str] | None = None) -> dict[str, Any]:
    """An InferencePool (inference.networking.k8s.io/v1) selecting `app: vllm` pods by default."""
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": name, "namespace": "llm"},
        "spec": {
            "selector": {"matchLabels": labels or {"app": "vllm"}},
            "targetPorts": [{"number": p} for p in ports],
            "endpointPickerRef": {"name": "kvroute-picker", "port": {"number": 9002}},
        },
    }
