"""manifests/ against a live API server: the README's kubectl steps, the CRD's own validation,
least privilege as the server enforces it, and Deployments the controller manager turns into Pods."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from tests.controlplane import ROOT, ControlPlane
from tests.e2e import eventually

pytestmark = pytest.mark.k8s

MANIFESTS = ROOT / "manifests"
EXAMPLE = next(
    d for d in yaml.safe_load_all((MANIFESTS / "example.yaml").read_text()) if d["kind"] == "KVRoutingPolicy"
)


@pytest.fixture(scope="module")
def cluster(control_plane: ControlPlane):
    """The README's install steps, in its order; everything is deleted again afterwards."""
    cp = control_plane
    cp.kubectl("apply", "-f", str(MANIFESTS / "crd.yaml"), "-f", str(MANIFESTS / "kopf-peering-crd.yaml"))
    crds = ["crd/kvroutingpolicies.kvroute.io", "crd/clusterkopfpeerings.kopf.dev"]
    cp.kubectl("wait", "--for=condition=Established", *crds, "--timeout=60s")
    cp.kubectl("apply", "-f", str(MANIFESTS / "00-namespace.yaml"))
    cp.kubectl("-n", "kvroute", "create", "secret", "generic", "kvroute-hash-key", "--from-literal=key=" + "ab" * 16)
    cp.kubectl("apply", "-f", str(MANIFESTS))
    assert "unchanged" in cp.kubectl("apply", "-f", str(MANIFESTS)).stdout  # applying again changes nothing
    yield cp
    for path in sorted(MANIFESTS.glob("*.yaml")):
        if "crd" not in path.name:  # CRDs stay: deleting them would delete every policy
            cp.kubectl("delete", "--ignore-not-found", "--wait=false", "-f", str(path))


def test_the_crd_is_established_and_the_printer_columns_show(cluster: ControlPlane):
    crd = cluster.get("crd", "kvroutingpolicies.kvroute.io")
    assert any(c["type"] == "Established" and c["status"] == "True" for c in crd["status"]["conditions"])
    header = cluster.kubectl("get", "kvrp", "-n", "llm").stdout.splitlines()[0].split()
    assert header == ["NAME", "READY", "BACKENDS", "EFFICIENCY", "ACCURACY", "HIT", "RATE", "AGE"]


def test_the_example_policy_is_stored_unchanged(cluster: ControlPlane):
    stored = cluster.get("kvrp", "default", "-n", "llm")
    assert stored["spec"] == EXAMPLE["spec"]


def _policy(name: str, spec_changes: dict[str, Any]) -> dict[str, Any]:
    policy = copy.deepcopy(EXAMPLE)
    policy["metadata"] = {"name": name, "namespace": "llm"}
    for key, value in spec_changes.items():
        if key == "routing":
            policy["spec"]["routing"] = {**policy["spec"].get("routing", {}), **value}
        elif value is None:
            del policy["spec"][key]
        else:
            policy["spec"][key] = value
    return policy


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"routing": {"blockSize": 12}}, "multiple of 8"),
        ({"routing": {"blockSize": 0}}, "should be greater than or equal to 8"),
        ({"routing": {"locationTTLSeconds": 0}}, "should be greater than 0"),
        ({"routing": {"prefixStickRatio": -1}}, "should be greater than 0"),
        ({"routing": {"capacityBlocks": "lots"}}, "capacityBlocks"),
        ({"routing": {"capacityBlocks": 10**13}}, "at most 1000000000000"),
        ({"routing": {"activeRequestCost": 1e308}}, "should be less than or equal to"),
        ({"routing": {"balanceRelGate": "high"}}, "must be of type number"),
        ({"routing": {"sessionHeaders": ["x session"]}}, "should match"),
        ({"selector": {"matchExpressions": [{"key": "a", "operator": "Near"}]}}, "Unsupported value"),
        ({"targetPort": None}, "selector and targetPort go together"),
        ({"targetPort": 0}, "a port number from 1 to 65535"),
        ({"targetPort": 65536}, "a port number from 1 to 65535"),
        ({"targetPort": "Bad_Name"}, "or a container port name"),
        ({"selector": None}, "set either selector and targetPort, or poolRef"),
        ({"poolRef": {"name": "chat"}}, "set either selector and targetPort, or poolRef"),
        ({"poolRef": {}}, "Required value"),
        ({"replicas": 3}, 'unknown field "spec.replicas"'),
    ],
    ids=lambda x: str(x)[:40],
)
def test_the_server_rejects_bad_policies_with_the_schemas_message(cluster: ControlPlane, change, message):
    result = cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(_policy("bad", change)), check=False)
    assert result.returncode != 0 and message in result.stderr, result.stderr


def test_unknown_routing_fields_are_kept_for_the_operator_to_report(cluster: ControlPlane):
    cluster.apply([_policy("typo", {"routing": {"blocksize": 256}})])
    assert cluster.get("kvrp", "typo", "-n", "llm")["spec"]["routing"]["blocksize"] == 256
    cluster.kubectl("delete", "kvrp", "typo", "-n", "llm")


# What each ServiceAccount may do, and nothing more: (verb, resource, namespace or "" for cluster-wide).
CONTROLLER_MAY = [
    ("list", "pods", ""),
    ("watch", "pods", ""),
    ("get", "kvroutingpolicies.kvroute.io", ""),
    ("watch", "kvroutingpolicies.kvroute.io", ""),
    ("patch", "kvroutingpolicies.kvroute.io/status", "llm"),
    ("patch", "clusterkopfpeerings.kopf.dev#kvroute", ""),
    ("get", "clusterkopfpeerings.kopf.dev#kvroute", ""),
    ("watch", "clusterkopfpeerings.kopf.dev", ""),
    ("watch", "customresourcedefinitions.apiextensions.k8s.io", ""),
]  # InferencePools: `can-i` cannot name a resource whose CRD is absent; the grant list below pins them
CONTROLLER_MAY_NOT = [
    ("get", "customresourcedefinitions.apiextensions.k8s.io", ""),  # list/watch to notice new CRDs, no more
    ("get", "secrets", "kvroute"),
    ("list", "secrets", ""),
    ("create", "pods", "llm"),
    ("delete", "pods", "llm"),
    ("update", "kvroutingpolicies.kvroute.io", "llm"),
    ("patch", "kvroutingpolicies.kvroute.io", "llm"),
    ("delete", "kvroutingpolicies.kvroute.io", "llm"),
    ("create", "clusterkopfpeerings.kopf.dev", ""),
    ("patch", "clusterkopfpeerings.kopf.dev#another-operator", ""),  # kopf's peering objects of others
    ("patch", "clusterkopfpeerings.kopf.dev", ""),
    ("list", "configmaps", "kvroute"),
    ("create", "events", "llm"),
]
EXTPROC_MAY = [
    ("get", "kvroutingpolicies.kvroute.io", "llm"),
    ("watch", "kvroutingpolicies.kvroute.io", "llm"),
    ("create", "events.events.k8s.io", "llm"),  # a Warning on its policy
]
EXTPROC_MAY_NOT = [
    ("get", "kvroutingpolicies.kvroute.io", "kvroute"),
    ("create", "events.events.k8s.io", "kvroute"),
    ("list", "events.events.k8s.io", "llm"),
    ("create", "events", "llm"),
    ("list", "kvroutingpolicies.kvroute.io", ""),
    ("patch", "kvroutingpolicies.kvroute.io/status", "llm"),
    ("list", "pods", "llm"),
    ("get", "secrets", "kvroute"),
    ("get", "secrets", "llm"),
]


@pytest.mark.parametrize(
    ("account", "verb", "resource", "where", "allowed"),
    [("kvroute-controller", *c, True) for c in CONTROLLER_MAY]
    + [("kvroute-controller", *c, False) for c in CONTROLLER_MAY_NOT]
    + [("kvroute-extproc", *c, True) for c in EXTPROC_MAY]
    + [("kvroute-extproc", *c, False) for c in EXTPROC_MAY_NOT],
    ids=lambda x: str(x),
)
def test_each_service_account_can_do_what_it_needs_and_nothing_more(
    cluster: ControlPlane, account, verb, resource, where, allowed
):
    assert cluster.can_i("kvroute", account, verb, resource, where) is allowed


def test_no_role_is_wider_than_listed(cluster: ControlPlane):
    """A manifest that widens a role fails here: the server's whole grant list is pinned, beyond
    what every ServiceAccount gets by default (the namespace's `default` account, bound to nothing)."""
    baseline = cluster.granted("llm", "system:serviceaccount:kvroute:default")
    assert cluster.granted("llm", "system:serviceaccount:kvroute:kvroute-controller") - baseline == CONTROLLER_GRANTS
    assert cluster.granted("llm", "system:serviceaccount:kvroute:kvroute-extproc") - baseline == EXTPROC_GRANTS


# Each ServiceAccount's whole grant list in the vLLM namespace, beyond the namespace's default
# account's (tests/test_node_chart.py checks the chart's running pods against the same lists).
CONTROLLER_GRANTS = {
    ("pods", "get"), ("pods", "list"), ("pods", "watch"),
    ("kvroutingpolicies.kvroute.io", "get"), ("kvroutingpolicies.kvroute.io", "list"),
    ("kvroutingpolicies.kvroute.io", "watch"), ("kvroutingpolicies.kvroute.io/status", "patch"),
    ("clusterkopfpeerings.kopf.dev", "get"), ("clusterkopfpeerings.kopf.dev", "list"),
    ("clusterkopfpeerings.kopf.dev", "watch"), ("clusterkopfpeerings.kopf.dev", "patch"),
    ("inferencepools.inference.networking.k8s.io", "get"),
    ("inferencepools.inference.networking.k8s.io", "list"),
    ("inferencepools.inference.networking.k8s.io", "watch"),
    ("customresourcedefinitions.apiextensions.k8s.io", "list"),
    ("customresourcedefinitions.apiextensions.k8s.io", "watch"),
}  # fmt: skip
EXTPROC_GRANTS = {
    ("kvroutingpolicies.kvroute.io", "get"), ("kvroutingpolicies.kvroute.io", "list"),
    ("kvroutingpolicies.kvroute.io", "watch"), ("events.events.k8s.io", "create"),
    ("inferenceobjectives.llm-d.ai", "get"), ("inferenceobjectives.llm-d.ai", "list"),
    ("inferenceobjectives.llm-d.ai", "watch"),
    ("inferenceobjectives.inference.networking.x-k8s.io", "get"),
    ("inferenceobjectives.inference.networking.x-k8s.io", "list"),
    ("inferenceobjectives.inference.networking.x-k8s.io", "watch"),
}  # fmt: skip


def test_deployments_become_replicasets_and_pods_with_the_specs_as_stored(cluster: ControlPlane):
    def owners() -> set[str]:
        sets = cluster.get("replicasets", "-n", "kvroute")["items"]
        return {ref["name"] for rs in sets for ref in rs["metadata"].get("ownerReferences", [])}

    eventually(
        lambda: owners() == {"kvroute-controller", "kvroute-extproc", "kvroute-envoy"},
        timeout_s=60,
        message="a ReplicaSet for each Deployment",
    )
    eventually(
        lambda: len(cluster.get("pods", "-n", "kvroute")["items"]) >= 3, timeout_s=60, message="pods of the Deployments"
    )
    pods = cluster.get("pods", "-n", "kvroute")["items"]
    for pod in pods:
        assert pod["status"]["phase"] == "Pending"  # no kubelet here
        spec = pod["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        for container in spec["containers"]:
            assert container["securityContext"]["readOnlyRootFilesystem"] is True
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
            assert container["resources"]["requests"] and container["livenessProbe"] and container["readinessProbe"]
        if pod["metadata"]["name"].startswith("kvroute-extproc"):
            args = spec["containers"][0]["args"]
            assert args[args.index("--policy") + 1] == "llm/default"
            assert spec.get("automountServiceAccountToken", True) is True  # it reads its policy
            assert spec["containers"][0]["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "35"]
            assert spec["terminationGracePeriodSeconds"] > 35
        assert spec["topologySpreadConstraints"][0]["topologyKey"] == "kubernetes.io/hostname"
        if pod["metadata"]["name"].startswith("kvroute-envoy"):
            assert spec["automountServiceAccountToken"] is False
            drain = spec["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]  # run in tests/test_chart.py
            assert drain[:2] == ["sh", "-c"] and "/drain_listeners?graceful" in drain[2]
            assert "sleep 10" in drain[2] and "seq 75" in drain[2] and spec["terminationGracePeriodSeconds"] > 10 + 75
