"""`python -m tools.crd`: writes the KVRoutingPolicy CRD (manifests/crd.yaml and the chart's copy)
from the run-time contract (extproc/core/policy.py) and the routing settings' declarations: each
setting with a policy field becomes a `spec.routing` property with its type, bounds and help.
tests/test_settings.py fails if either file differs from what this renders.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import yaml

from extproc.core.backends import Role
from extproc.core.policy import GROUP, KIND, MODELS_KEY, PLURAL, ROLE_LABELS, VERSION, policy_fields
from extproc.core.settings import AUTO, HEADER_NAME, MAX_FLOW_ID, MAX_METRIC_FLOWS, MAX_PAIRS

ROOT = Path(__file__).resolve().parent.parent
CRD_FILES = (ROOT / "manifests" / "crd.yaml", ROOT / "charts" / "kvroute" / "crds" / "kvroutingpolicies.yaml")


def _property(f: dataclasses.Field[Any]) -> dict[str, Any]:
    """The OpenAPI schema of one routing setting, from its declaration."""
    schema: dict[str, Any] = {"description": f.metadata["help"]}
    special = f.metadata["schema"]
    if special == "headers":
        return {**schema, "type": "array", "items": {"type": "string", "pattern": f"^{HEADER_NAME}$"}}
    if special == "names":  # a short list of short names
        items = {"type": "string", "maxLength": MAX_FLOW_ID}
        return {**schema, "type": "array", "maxItems": MAX_METRIC_FLOWS, "items": items}
    if special in ("weights", "priorities"):  # name -> number
        number = (
            {"type": "number", "exclusiveMinimum": True, "minimum": 0}
            if special == "weights"
            else {
                "type": "integer",
                "format": "int32",
            }
        )
        return {**schema, "type": "object", "maxProperties": MAX_PAIRS, "additionalProperties": number}
    if special == "paths":  # name -> path
        path = {"type": "string", "minLength": 1, "maxLength": 4096}
        return {**schema, "type": "object", "maxProperties": MAX_PAIRS, "additionalProperties": path}
    if special == "header":  # a header name, or empty
        return {**schema, "type": "string", "pattern": f"^{HEADER_NAME.removesuffix('+')}*$"}
    if special == "path":
        return {**schema, "type": "string", "maxLength": 4096}
    if f.metadata["kind"] is bool:
        return {**schema, "type": "boolean"}
    if f.metadata["choices"]:
        return {**schema, "type": "string", "enum": list(f.metadata["choices"])}
    if f.metadata["kind"] is str:
        return {**schema, "type": "string"}
    kind = "integer" if f.metadata["kind"] is int else "number"
    bounds = f.metadata["bounds"]
    number: dict[str, Any] = {"type": kind}
    if bounds is not None:
        cast = int if kind == "integer" else float
        if bounds.minimum is not None:
            number["minimum"] = cast(bounds.minimum)
            if bounds.exclusive_minimum:
                number["exclusiveMinimum"] = True
        number["maximum"] = cast(bounds.maximum)
        if bounds.multiple_of is not None:
            number["multipleOf"] = bounds.multiple_of
    if special == "blocks_or_auto":  # a number or "auto"; a structural schema says so in CEL
        low, high = int(bounds.minimum), int(bounds.maximum)
        rule = f'type(self) == string ? self == "{AUTO}" : self >= {low} && self <= {high}'
        message = f'must be a number of blocks (at least {low}, at most {high}) or "{AUTO}"'
        return {
            **schema,
            "x-kubernetes-int-or-string": True,
            "x-kubernetes-validations": [{"rule": rule, "message": message}],
        }
    return {**schema, **number}


def routing_schema() -> dict[str, Any]:
    """`spec.routing`: unknown keys are kept (not pruned) so the operator can report them."""
    return {
        "description": "Routing settings; unset fields keep the ext_proc's own configuration (docs/settings.md).",
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": True,
        "properties": {key: _property(f) for key, f in policy_fields().items()},
    }


def _string_list() -> dict[str, Any]:
    return {"type": "array", "items": {"type": "string"}}


def crd() -> dict[str, Any]:
    """The CustomResourceDefinition of KVRoutingPolicy."""
    selector = {
        "description": "Label selector of the vLLM pods, in the policy's namespace.",
        "type": "object",
        "properties": {
            "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
            "matchExpressions": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["key", "operator"],
                    "properties": {
                        "key": {"type": "string"},
                        "operator": {"type": "string", "enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                        "values": _string_list(),
                    },
                },
            },
        },
    }
    backend = {
        "type": "object",
        "required": ["pod", "ip", "port", "ready"],
        "properties": {
            "pod": {"type": "string"},
            "ip": {"type": "string"},
            "port": {"type": "integer"},
            "ready": {"type": "boolean"},
            "models": _string_list(),
            "role": {"type": "string", "enum": [r.value for r in Role]},
        },
    }
    condition = {
        "type": "object",
        "required": ["type", "status"],
        "properties": {
            "type": {"type": "string"},
            "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
            "reason": {"type": "string"},
            "message": {"type": "string"},
            "lastTransitionTime": {"type": "string", "format": "date-time"},
        },
    }
    spec = {
        "type": "object",
        "x-kubernetes-validations": [
            {
                "rule": "has(self.poolRef) != has(self.selector)",
                "message": "set either selector and targetPort, or poolRef",
            },
            {"rule": "has(self.selector) == has(self.targetPort)", "message": "selector and targetPort go together"},
        ],
        "properties": {
            "poolRef": {
                "description": "An InferencePool (inference.networking.k8s.io/v1) in the policy's namespace whose "
                "selector and targetPorts name the backends (each ready pod IP x each target port), instead of "
                "selector and targetPort. Routing settings still come from this policy.",
                "type": "object",
                "required": ["name"],
                "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 253}},
            },
            "selector": selector,
            "targetPort": {
                "description": "The vLLM port, a number or a container port name.",
                "x-kubernetes-int-or-string": True,
                "x-kubernetes-validations": [
                    {  # (a port out of range was published and then dropped without a word)
                        "rule": "type(self) == int ? self >= 1 && self <= 65535 : size(self) <= 15 && "
                        "self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$') && self.matches('[a-z]')",
                        "message": "a port number from 1 to 65535, or a container port name (IANA_SVC_NAME)",
                    }
                ],
            },
            "models": {
                "description": "Models every selected pod serves. Otherwise read from the pod label or annotation "
                f"{MODELS_KEY} (comma-separated).",
                **_string_list(),
            },
            "role": {
                "description": "Role of every selected pod in a disaggregated fleet: prefill, decode or both. "
                f"Otherwise read from the pod label {ROLE_LABELS[0]} or {ROLE_LABELS[1]} (neither: both).",
                "type": "string",
                "enum": [r.value for r in Role],
            },
            "routing": routing_schema(),
        },
    }
    ratio = {"type": "number", "nullable": True}
    reuse = {
        "type": "object",
        "description": "Prefix reuse in prompt tokens, summed over the ext_proc replicas serving the policy since "
        "each started, read from their /metrics by the operator: available (the longest prefix any candidate held), "
        "routed (on the backend chosen), delivered (what the engines found cached, once per backend).",
        "properties": {
            "extprocs": {"type": "integer", "description": "ext_proc replicas read"},
            "extprocsExpected": {"type": "integer", "description": "ready ext_proc replicas serving the policy"},
            "promptTokens": {"type": "integer"},
            "availableTokens": {"type": "integer"},
            "routedTokens": {"type": "integer"},
            "deliveredTokens": {"type": "integer"},
            "routingEfficiency": {**ratio, "description": "routed / available"},
            "predictionAccuracy": {**ratio, "description": "delivered / routed"},
            "hitRate": {**ratio, "description": "delivered / prompt"},
        },
    }
    status = {
        "type": "object",
        "properties": {
            "backends": {"type": "array", "items": backend},
            "readyBackends": {"type": "integer"},
            "observedGeneration": {"type": "integer"},
            "conditions": {"type": "array", "items": condition},
            "reuse": reuse,
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": KIND.lower(),
                "shortNames": ["kvrp"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": [
                        {
                            "name": "Ready",
                            "type": "string",
                            "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
                        },
                        {
                            "name": "Backends",
                            "type": "integer",
                            "description": "ready backends",
                            "jsonPath": ".status.readyBackends",
                        },
                        {
                            "name": "Efficiency",
                            "type": "number",
                            "description": "routing efficiency: cached prefix routed to / longest available",
                            "jsonPath": ".status.reuse.routingEfficiency",
                        },
                        {
                            "name": "Accuracy",
                            "type": "number",
                            "description": "prediction accuracy: engines' cached tokens / kvroute's picture",
                            "jsonPath": ".status.reuse.predictionAccuracy",
                        },
                        {
                            "name": "Hit rate",
                            "type": "number",
                            "description": "engines' cached prompt tokens / prompt tokens",
                            "jsonPath": ".status.reuse.hitRate",
                        },
                        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                    ],
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "required": ["spec"],
                            "properties": {"spec": spec, "status": status},
                        }
                    },
                }
            ],
        },
    }


def render() -> str:
    """The CRD file's text, as committed in manifests/ and in the chart."""
    header = "# KVRoutingPolicy: which vLLM pods kvroute routes to, and how.\n"
    header += "# Generated by `python -m tools.crd` from extproc/core/policy.py and extproc/core/settings.py.\n"
    return header + yaml.safe_dump(crd(), sort_keys=False, width=120)


if __name__ == "__main__":
    text = render()
    for path in CRD_FILES:
        path.write_text(text)
    sys.stdout.write(f"wrote {', '.join(str(p.relative_to(ROOT)) for p in CRD_FILES)}\n")
