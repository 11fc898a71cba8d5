"""manifests/: valid Kubernetes objects (offline schemas), least privilege, hardened pods, and an
Envoy bootstrap identical to what `kvroute envoy-config` writes."""

from __future__ import annotations

import copy
import shlex
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from controller import logic
from extproc.cli import envoy_layout, parser
from extproc.envoy.bootstrap import render
from tests.crd_schema import ROOT, crd_validator, documents
from tests.k8s_objects import pod

MANIFESTS = sorted((ROOT / "manifests").glob("*.yaml"))
CUSTOM_KINDS = {"KVRoutingPolicy", "ClusterKopfPeering"}
K8S_VERSION = "1.37.0"


def all_documents() -> list[tuple[str, dict[str, Any]]]:
    return [(f"{p.name}:{d['kind']}/{d['metadata']['name']}", d) for p in MANIFESTS for d in documents(p)]


def by_kind(kind: str) -> list[dict[str, Any]]:
    return [d for _, d in all_documents() if d["kind"] == kind]


@pytest.mark.parametrize(
    ("where", "doc"),
    [x for x in all_documents() if x[1]["kind"] not in CUSTOM_KINDS],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_builtin_objects_validate_against_kubernetes_schemas(where, doc):
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_example_policy_validates_against_the_crd():
    (example,) = by_kind("KVRoutingPolicy")
    crd_validator().validate(example)


@pytest.mark.parametrize(
    "change",
    [
        {"routing": {"blockSize": 12}},
        {"routing": {"blockSize": 0}},
        {"routing": {"locationTTLSeconds": 0}},
        {"routing": {"capacityBlocks": "lots"}},
        {"routing": {"capacityBlocks": 0}},
        {"routing": {"balanceRelGate": 0}},
        {"routing": {"sessionHeaders": ["x session"]}},
        {"targetPort": 1.5},
        {"selector": {"matchExpressions": [{"key": "a", "operator": "Near"}]}},
    ],
)
def test_the_crd_rejects_bad_policies(change):
    (example,) = by_kind("KVRoutingPolicy")
    bad = copy.deepcopy(example)
    for key, value in change.items():
        bad["spec"][key] = (
            {**bad["spec"].get(key, {}), **value} if isinstance(value, dict) and key == "routing" else value
        )
    assert list(crd_validator().iter_errors(bad))


def test_the_crd_requires_selector_and_port():
    (example,) = by_kind("KVRoutingPolicy")
    for field in ("selector", "targetPort"):
        bad = copy.deepcopy(example)
        del bad["spec"][field]
        assert list(crd_validator().iter_errors(bad))


def test_operator_status_fits_the_crd_status_schema():
    (example,) = by_kind("KVRoutingPolicy")
    status = logic.desired_status(example, [logic.pod_summary(pod("a"))], "2026-11-29T10:00:00Z")
    crd_validator().validate({**example, "status": status})


def test_crd_shape():
    (crd,) = [d for d in by_kind("CustomResourceDefinition") if d["spec"]["group"] == "kvroute.io"]
    assert crd["spec"]["scope"] == "Namespaced" and crd["spec"]["names"]["shortNames"] == ["kvrp"]
    (version,) = crd["spec"]["versions"]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Backends"] == ".status.readyBackends" and columns["Age"] == ".metadata.creationTimestamp"


def rules(kind: str, name: str) -> list[tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]]:
    (role,) = [d for d in by_kind(kind) if d["metadata"]["name"] == name]
    return [(tuple(r["apiGroups"]), tuple(r["resources"]), tuple(r["verbs"])) for r in role["rules"]]


def test_rbac_is_least_privilege():
    assert rules("ClusterRole", "kvroute-controller") == [
        (("",), ("pods",), ("get", "list", "watch")),
        (("kvroute.io",), ("kvroutingpolicies",), ("get", "list", "watch")),
        (("kvroute.io",), ("kvroutingpolicies/status",), ("patch",)),
        (("kopf.dev",), ("clusterkopfpeerings",), ("get", "list", "watch", "patch")),
    ]
    assert rules("Role", "kvroute-extproc") == [(("kvroute.io",), ("kvroutingpolicies",), ("get", "list", "watch"))]


KVROUTE_DEPLOYMENTS = [d for d in by_kind("Deployment") if d["metadata"]["namespace"] == "kvroute"]


def test_kvroute_runs_controller_extproc_and_envoy():
    assert sorted(d["metadata"]["name"] for d in KVROUTE_DEPLOYMENTS) == [
        "kvroute-controller",
        "kvroute-envoy",
        "kvroute-extproc",
    ]


@pytest.mark.parametrize("deployment", KVROUTE_DEPLOYMENTS, ids=lambda d: d["metadata"]["name"])
def test_pods_are_hardened_and_probed(deployment):
    spec = deployment["spec"]["template"]["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    for container in spec["containers"]:
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert container["resources"]["requests"]
        assert container["livenessProbe"] and container["readinessProbe"]
        if container["image"].startswith("ghcr.io/kvroute/"):
            assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
            assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"


def test_envoy_bootstrap_is_what_envoy_config_writes():
    path = ROOT / "manifests" / "envoy.yaml"
    command = next(line for line in path.read_text().splitlines() if "kvroute envoy-config" in line)
    layout = envoy_layout(parser().parse_args(shlex.split(command.split("kvroute", 1)[1])))
    (config_map,) = by_kind("ConfigMap")
    assert config_map["data"]["envoy.yaml"] == render(layout)
    bootstrap = yaml.safe_load(config_map["data"]["envoy.yaml"])
    assert bootstrap["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"


def test_extproc_follows_the_example_policy_and_rbac_covers_it():
    (extproc,) = [d for d in by_kind("Deployment") if d["metadata"]["name"] == "kvroute-extproc"]
    args = extproc["spec"]["template"]["spec"]["containers"][0]["args"]
    namespace, name = args[args.index("--policy") + 1].split("/")
    (policy,) = by_kind("KVRoutingPolicy")
    assert (policy["metadata"]["namespace"], policy["metadata"]["name"]) == (namespace, name)
    (role,) = by_kind("Role")
    assert role["metadata"]["namespace"] == namespace


def test_manifest_files_exist():
    assert {p.name for p in MANIFESTS} >= {
        "crd.yaml",
        "rbac.yaml",
        "controller.yaml",
        "extproc.yaml",
        "envoy.yaml",
        "example.yaml",
    }
    assert Path(ROOT / "Dockerfile").exists()


def test_kind_sim_fleet_is_valid():
    for doc in documents(ROOT / "manifests" / "kind" / "sim-fleet.yaml"):
        if doc["kind"] == "KVRoutingPolicy":
            crd_validator().validate(doc)
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
