"""charts/kvroute rendered (with tests/helm_subset.py: no Helm binary can be installed here) and
validated: Kubernetes schemas, the CRD's own schema, and agreement with manifests/ and
`kvroute envoy-config`."""

from __future__ import annotations

import kubernetes_validate
import pytest
import yaml

from extproc.envoy.bootstrap import EnvoyLayout, render
from tests.crd_schema import ROOT, crd_validator, documents
from tests.helm_subset import Chart, _parse, _tokens

CHART = Chart(ROOT / "charts" / "kvroute")


def kinds(docs: list[dict]) -> list[str]:
    return sorted(f"{d['kind']}/{d['metadata']['name']}" for d in docs)


@pytest.mark.parametrize(
    "values",
    [{}, {"envoy": {"enabled": False}}, {"policy": {"create": False}}, {"controller": {"replicas": 3}}],
    ids=["defaults", "no-envoy", "no-policy", "three-controllers"],
)
def test_rendered_objects_are_valid(values):
    for doc in CHART.documents(values):
        if doc["kind"] == "KVRoutingPolicy":
            crd_validator().validate(doc)
        elif doc["kind"] != "ClusterKopfPeering":
            kubernetes_validate.validate(doc, "1.37.0", strict=True)


def test_defaults_install_everything():
    assert kinds(CHART.documents()) == [
        "ClusterKopfPeering/kvroute",
        "ClusterRole/kvroute-controller",
        "ClusterRoleBinding/kvroute-controller",
        "ConfigMap/kvroute-envoy",
        "CustomResourceDefinition/clusterkopfpeerings.kopf.dev",
        "CustomResourceDefinition/kvroutingpolicies.kvroute.io",
        "Deployment/kvroute-controller",
        "Deployment/kvroute-envoy",
        "Deployment/kvroute-extproc",
        "KVRoutingPolicy/default",
        "Role/kvroute-extproc",
        "RoleBinding/kvroute-extproc",
        "Service/kvroute-controller",
        "Service/kvroute-envoy",
        "Service/kvroute-extproc",
        "ServiceAccount/kvroute-controller",
        "ServiceAccount/kvroute-extproc",
    ]


def test_values_switch_parts_off_and_on():
    no_envoy = kinds(CHART.documents({"envoy": {"enabled": False}}))
    assert not [k for k in no_envoy if "envoy" in k]
    assert "KVRoutingPolicy/default" not in kinds(CHART.documents({"policy": {"create": False}}))
    (controller,) = [
        d
        for d in CHART.documents({"controller": {"replicas": 3}})
        if d["metadata"]["name"] == "kvroute-controller" and d["kind"] == "Deployment"
    ]
    assert controller["spec"]["replicas"] == 3


def test_envoy_bootstrap_is_what_envoy_config_writes():
    values = {"envoy": {"backends": {"host": "vllm-pods.prod.svc.cluster.local", "port": 8001}}}
    (config_map,) = [d for d in CHART.documents(values) if d["kind"] == "ConfigMap"]
    expected = render(
        EnvoyLayout(
            listen_host="0.0.0.0",
            listen_port=8080,
            admin_port=9901,
            extproc_host="kvroute-extproc.kvroute.svc.cluster.local",
            extproc_port=9002,
            backend_dns="vllm-pods.prod.svc.cluster.local:8001",
        )
    )
    assert config_map["data"]["envoy.yaml"] == expected


def test_chart_matches_the_plain_manifests():
    """Same CRDs, same RBAC rules, same policy spec as manifests/."""
    manifests = [d for p in sorted((ROOT / "manifests").glob("*.yaml")) for d in documents(p)]
    chart = CHART.documents()

    def pick(docs: list[dict], kind: str) -> list:
        return sorted(yaml.safe_dump(d.get("spec") or d.get("rules")) for d in docs if d["kind"] == kind)

    for kind in ("CustomResourceDefinition", "ClusterRole", "Role"):
        assert pick(chart, kind) == pick(manifests, kind), kind
    extproc = next(d for d in chart if d["kind"] == "Deployment" and d["metadata"]["name"] == "kvroute-extproc")
    args = extproc["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--policy") + 1] == "llm/default"


def test_renderer_trims_like_go_templates_and_refuses_the_unknown():
    chart = Chart.__new__(Chart)
    chart.defines = {}
    tree = _parse(
        _tokens("a:\n  {{- if .Values.on }}\n  b: {{ .Values.x | quote }}\n{{- end }}\nc: 1\n"), chart.defines
    )
    context = {"Values": {"on": True, "x": "y"}}
    assert chart._run(tree, context) == 'a:\n  b: "y"\nc: 1\n'
    assert chart._run(tree, {"Values": {"on": False}}) == "a:\nc: 1\n"
    with pytest.raises(NotImplementedError):
        _parse(_tokens("{{ range .Values.x }}{{ end }}"), {})
    with pytest.raises(NotImplementedError):
        chart._pipeline(".Values.x | upper", context)
