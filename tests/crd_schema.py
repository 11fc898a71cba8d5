"""Validate custom resources offline against a CRD's structural schema (OpenAPI v3.0 dialect)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import yaml

ROOT = Path(__file__).resolve().parent.parent


def _to_jsonschema(node: Any) -> Any:
    """Kubernetes extensions into plain JSON Schema: int-or-string becomes an anyOf."""
    if isinstance(node, list):
        return [_to_jsonschema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _to_jsonschema(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    return out


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def crd_validator(crd_path: Path = ROOT / "manifests" / "crd.yaml") -> jsonschema.Draft4Validator:
    crd = documents(crd_path)[0]
    schema = _to_jsonschema(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    return jsonschema.Draft4Validator(schema)
