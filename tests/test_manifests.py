"""manifests/ offline, for the fast lane: valid Kubernetes objects (1.37 schemas), hardened pods, and an
Envoy bootstrap identical to what `kvroute envoy-config` writes. The live API server checks the CRD,
the policies and RBAC (tests/test_k8s_manifests.py)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from extproc.cli import envoy_layout, parser
from extproc.envoy.bootstrap import render

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = sorted((ROOT / "manifests").glob("*.yaml"))
CUSTOM_KINDS = {"KVRoutingPolicy", "ClusterKopfPeering"}
K8S_VERSION = "1.37.0"


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


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


def test_crd_shape():
    (crd,) = [d for d in by_kind("CustomResourceDefinition") if d["spec"]["group"] == "kvroute.io"]
    assert crd["spec"]["scope"] == "Namespaced" and crd["spec"]["names"]["shortNames"] == ["kvrp"]
    (version,) = crd["spec"]["versions"]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Backends"] == ".status.readyBackends" and columns["Age"] == ".metadata.creationTimestamp"


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


def test_kind_sim_fleet_builtin_objects_are_valid():
    for doc in documents(ROOT / "manifests" / "kind" / "sim-fleet.yaml"):
        if doc["kind"] not in CUSTOM_KINDS:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
