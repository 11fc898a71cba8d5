"""The Helm chart on a real node (tests/node.py): images built from the Dockerfile, pods run by a
kubelet through containerd and runc, Services by kube-proxy, names by CoreDNS.

The release runs the operator, the ext_proc, Envoy and (for three replicas) the chart's Redis;
three simulator pods (the Dockerfile's `simulator` target) stand in for vLLM behind the headless
Service the chart's Envoy resolves. The tests talk to pods by their addresses, which only exist
inside the node's network namespace.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from bench.harness.tiny_model import tokenizer_files
from tests.controlplane import ROOT
from tests.e2e import eventually, get, metric, post
from tests.node import Node
from tests.node_images import IMAGE_NAMES
from tests.test_k8s_manifests import CONTROLLER_GRANTS, EXTPROC_GRANTS

pytestmark = [pytest.mark.k8s, pytest.mark.node]

SYSTEM, LLM, RELEASE = "kvroute-system", "llm", "kvr"
SIMS = 3
BODY = {"model": "sim-model", "max_tokens": 2}
SMALL = {"requests": {"cpu": "10m", "memory": "32Mi"}}  # two cores for the whole node
TOKENIZER_PATH = "/etc/kvroute/tokenizer"


def simulator_objects() -> list[dict[str, Any]]:
    """The vLLM stand-ins of the kind walkthrough (manifests/kind/sim-fleet.yaml): its Namespace,
    Deployment and headless Service `vllm`, with the locally built simulator image; its policy is
    left out, as the chart makes one."""
    objects = [o for o in yaml.safe_load_all((ROOT / "manifests" / "kind" / "sim-fleet.yaml").read_text()) if o]
    for deployment in (o for o in objects if o["kind"] == "Deployment"):
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            container.update(image=IMAGE_NAMES["simulator"], imagePullPolicy="Never")
            container["resources"] = SMALL
    return [o for o in objects if o["kind"] != "KVRoutingPolicy"]


def chart_values(extproc_replicas: int, tokenizer_config_map: str = "") -> dict[str, Any]:
    """The chart's values for this node; with a tokenizer ConfigMap, precise mode reading it."""
    repository, tag = IMAGE_NAMES["kvroute"].rsplit(":", 1)
    routing: dict[str, Any] = {"blockSize": 512, "decisionHeaders": True}
    tokenizer: dict[str, Any] = {}
    if tokenizer_config_map:
        routing |= {"index": "precise", "tokenizerPath": TOKENIZER_PATH}
        tokenizer = {"mountPath": TOKENIZER_PATH, "volume": {"configMap": {"name": tokenizer_config_map}}}
    return {
        "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
        "controller": {"replicas": 1, "resources": SMALL},
        "extproc": {
            "replicas": extproc_replicas,
            "resources": SMALL,
            "replicaStore": {"deploy": extproc_replicas > 1, "image": IMAGE_NAMES["redis"], "resources": SMALL},
            "tokenizer": tokenizer,
        },
        "envoy": {"image": IMAGE_NAMES["envoy"], "replicas": 1, "resources": SMALL},
        # the x-kvroute-* answers these tests read (off by default: they name pod addresses)
        "policy": {"routing": routing},
    }


class Release:
    """The installed chart and the simulator pods, with helpers to reach them."""

    def __init__(self, node: Node) -> None:
        assert node.cp is not None
        self.node = node
        self.cp = node.cp
        self.values = ROOT / "charts" / "kvroute" / "values.yaml"

    def install(self, extproc_replicas: int, verb: str = "install", tokenizer_config_map: str = "") -> None:
        values = self.node.workdir / f"values-{extproc_replicas}{tokenizer_config_map}.yaml"
        values.write_text(yaml.safe_dump(chart_values(extproc_replicas, tokenizer_config_map)))
        chart = str(ROOT / "charts" / "kvroute")
        self.cp.helm(verb, RELEASE, chart, "-n", SYSTEM, "--create-namespace", "-f", str(values))
        self.wait_rolled_out()

    def wait_rolled_out(self) -> None:
        """Every Deployment's new pods available and its old ones gone (a replaced ext_proc keeps
        answering through its preStop wait, with the settings it started with)."""
        for namespace in (SYSTEM, LLM):
            for name in self.cp.kubectl("get", "deploy", "-n", namespace, "-o", "name").stdout.split():
                self.cp.kubectl("rollout", "status", name, "-n", namespace, "--timeout=110s")
            eventually(lambda ns=namespace: not self.terminating(ns), 90, f"the replaced pods in {namespace} to stop")

    def terminating(self, namespace: str) -> bool:
        return any(p["metadata"].get("deletionTimestamp") for p in self.cp.get("pods", "-n", namespace)["items"])

    def pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        return self.cp.get("pods", "-n", namespace, "-l", selector)["items"]

    def ready_ips(self, namespace: str, selector: str) -> set[str]:
        ips = set()
        for pod in self.pods(namespace, selector):
            conditions = pod["status"].get("conditions", [])
            if pod["metadata"].get("deletionTimestamp") is None and any(
                c["type"] == "Ready" and c["status"] == "True" for c in conditions
            ):
                ips.add(pod["status"]["podIP"])
        return ips

    @property
    def envoy(self) -> str:
        (ip,) = self.ready_ips(SYSTEM, "app.kubernetes.io/component=envoy")
        return f"http://{ip}:8080"

    def status_backends(self) -> set[str]:
        status = self.cp.get("kvrp", "default", "-n", LLM).get("status") or {}
        return {f"{b['ip']}:{b['port']}" for b in status.get("backends", []) if b["ready"]}

    def chat(self, content: str, session: str | None = None) -> dict[str, str]:
        headers = {"x-session-id": session} if session else {}
        status, response_headers, body = post(
            self.envoy, {**BODY, "messages": [{"role": "user", "content": content}]}, headers
        )
        assert status == 200, body
        return response_headers

    def exec(self, namespace: str, pod: str, *argv: str, check: bool = True) -> str:
        return self.cp.kubectl("exec", "-n", namespace, pod, "--", *argv, check=check).stdout


@pytest.fixture(scope="module")
def release(node: Node):
    assert node.cp is not None
    release = Release(node)
    node.cp.apply(simulator_objects())
    release.install(extproc_replicas=1)
    yield release
    node.cp.helm("uninstall", RELEASE, "-n", SYSTEM, "--wait=false", check=False)
    node.cp.kubectl("delete", "namespace", LLM, "--wait=false", check=False)


def test_every_pod_runs_our_images_and_becomes_ready_through_its_probes(release: Release):
    pods = release.pods(SYSTEM, "app.kubernetes.io/instance=kvr") + release.pods(LLM, "app=vllm")
    images = {c["image"] for pod in pods for c in pod["spec"]["containers"]}
    assert images == {IMAGE_NAMES["kvroute"], IMAGE_NAMES["envoy"], IMAGE_NAMES["simulator"]}
    components = Counter(p["metadata"]["labels"].get("app.kubernetes.io/component", "vllm") for p in pods)
    assert components == {"controller": 1, "extproc": 1, "envoy": 1, "vllm": SIMS}
    for pod in pods:
        assert all(c["ready"] for c in pod["status"]["containerStatuses"]), pod["metadata"]["name"]
        assert all(c["restartCount"] == 0 for c in pod["status"]["containerStatuses"]), pod["metadata"]["name"]


def test_the_extproc_runs_as_its_non_root_user_on_a_read_only_root(release: Release):
    (pod,) = release.pods(SYSTEM, "app.kubernetes.io/component=extproc")
    name = pod["metadata"]["name"]
    assert release.exec(SYSTEM, name, "id", "-u").strip() == "65532"
    result = release.cp.kubectl("exec", "-n", SYSTEM, name, "--", "touch", "/opt/kvroute/x", check=False)
    assert result.returncode != 0 and "Read-only file system" in result.stderr
    assert release.exec(SYSTEM, name, "kvroute", "--help").startswith("usage: kvroute")


def test_the_policy_lists_the_simulator_pods_and_envoy_reaches_them_through_kvroute(release: Release):
    sims = release.ready_ips(LLM, "app=vllm")
    assert len(sims) == SIMS
    eventually(lambda: release.status_backends() == {f"{ip}:8000" for ip in sims}, 30, "the status lists the pods")
    eventually(lambda: _routed(release), 60, "a request routed through Envoy and the ext_proc")
    headers = release.chat("hello")
    assert headers["x-kvroute-backend"] in {f"{ip}:8000" for ip in sims}
    assert headers["x-kvroute-decision"]


def _routed(release: Release) -> bool:
    status, headers, _ = post(release.envoy, {**BODY, "messages": [{"role": "user", "content": "ping"}]})
    return status == 200 and "x-kvroute-backend" in headers


def test_a_conversation_stays_on_its_pod_and_a_shared_prefix_follows_it(release: Release):
    history = "a long shared history of this conversation " * 60
    first = {release.chat(f"{history} turn {turn}", "conv-node")["x-kvroute-backend"] for turn in range(4)}
    assert len(first) == 1
    # a new conversation with the same long prefix goes where that prefix is cached
    follower = release.chat(f"{history} another question", "conv-node-2")
    assert follower["x-kvroute-backend"] in first
    assert follower["x-kvroute-decision"] == "prefix_match"


def test_the_service_accounts_have_exactly_the_pinned_rights(release: Release):
    """Each pod's own mounted token, asked for its whole grant list (beyond the namespace's default
    account's), gets what tests/test_k8s_manifests.py pins for the manifests: the chart's RBAC."""
    baseline = release.cp.granted(LLM, f"system:serviceaccount:{LLM}:default")
    for component, expected in (("controller", CONTROLLER_GRANTS), ("extproc", EXTPROC_GRANTS)):
        (pod,) = release.pods(SYSTEM, f"app.kubernetes.io/component={component}")
        assert pod["spec"]["serviceAccountName"] == f"{RELEASE}-{component}"
        token = release.exec(
            SYSTEM, pod["metadata"]["name"], "cat", "/var/run/secrets/kubernetes.io/serviceaccount/token"
        )
        assert release.cp.granted(LLM, token=token) - baseline == expected, component


def test_a_deleted_vllm_pod_leaves_the_status_and_the_routing_within_seconds(release: Release):
    before = release.ready_ips(LLM, "app=vllm")
    victim = next(p for p in release.pods(LLM, "app=vllm") if p["status"].get("podIP") in before)
    gone = f"{victim['status']['podIP']}:8000"
    release.cp.kubectl("delete", "pod", "-n", LLM, victim["metadata"]["name"], "--wait=false")
    eventually(lambda: gone not in release.status_backends(), 15, "the deleted pod leaves the status")
    replicas = [f"http://{ip}:9003" for ip in release.ready_ips(SYSTEM, "app.kubernetes.io/component=extproc")]
    healthy = f'kvroute_backend_healthy{{backend="{gone}"}} 1'
    eventually(  # each ext_proc follows the status through its own watch, a moment later
        lambda: not any(healthy in get(r, "/metrics")[2].decode() for r in replicas), 15, "the ext_procs drop it"
    )
    for i in range(20):
        assert release.chat(f"after the deletion {i} " * 20)["x-kvroute-backend"] != gone
    release.wait_rolled_out()  # the Deployment's replacement, for the tests after this one


def test_three_replicas_share_through_the_charts_redis(release: Release):
    release.install(extproc_replicas=3, verb="upgrade")
    assert len(release.ready_ips(SYSTEM, "app.kubernetes.io/component=extproc")) == 3
    assert len(release.ready_ips(SYSTEM, "app.kubernetes.io/component=replica-store")) == 1
    replicas = [f"http://{ip}:9003" for ip in release.ready_ips(SYSTEM, "app.kubernetes.io/component=extproc")]
    eventually(lambda: all(metric(r, "kvroute_replica_store_connected ") == 1 for r in replicas), 60, "replicas share")
    eventually(lambda: _routed(release), 60, "routing through three replicas")
    # Envoy opens a stream per request to any replica: the conversation stays put because the
    # replicas share its binding through Redis (once it has reached each of them)
    sessions = [metric(r, "kvroute_sessions ") for r in replicas]
    history = "three replicas, one conversation " * 60
    backends, labels = set(), []
    for turn in range(6):
        headers = release.chat(f"{history} turn {turn}", "conv-replicas")
        backends.add(headers["x-kvroute-backend"])
        labels.append(headers["x-kvroute-decision"])
        eventually(
            lambda: all(metric(r, "kvroute_sessions ") == n + 1 for r, n in zip(replicas, sessions, strict=True)),
            15,
            "every replica knows the conversation",
        )
    assert len(backends) == 1 and labels[1:] == ["session_match"] * 5


def test_a_rolling_update_of_the_extproc_under_steady_traffic_fails_no_request(release: Release):
    """Three replicas replaced one at a time under steady requests: each answered, and routed by
    kvroute rather than failed open (a stream Envoy opens to a stopped replica would be), thanks to
    the preStop wait, readiness and the drain on SIGTERM."""
    outcomes: list[tuple[int, bool]] = []  # (status, routed by kvroute rather than failed open)
    failures: list[str] = []  # what each other answer said, for the assertion's message
    stop = threading.Event()
    envoy = release.envoy

    def traffic() -> None:
        i = 0
        while not stop.is_set():
            try:
                status, headers, body = post(envoy, {**BODY, "messages": [{"role": "user", "content": f"steady {i}"}]})
                outcomes.append((status, "x-kvroute-backend" in headers))
                if outcomes[-1] != (200, True):
                    kvroute = {k: v for k, v in headers.items() if k.startswith("x-kvroute")}
                    failures.append(f"{time.strftime('%H:%M:%S')} {status} {kvroute} {body[:200]!r}")
            except OSError as exc:  # a reset or a timeout is a failed request, not the end of the traffic
                outcomes.append((0, False))
                failures.append(f"{time.strftime('%H:%M:%S')} {exc!r}")
            i += 1

    thread = threading.Thread(target=traffic, daemon=True)
    thread.start()
    try:
        time.sleep(2)
        before = {p["metadata"]["name"] for p in release.pods(SYSTEM, "app.kubernetes.io/component=extproc")}
        release.cp.kubectl("rollout", "restart", f"deployment/{RELEASE}-extproc", "-n", SYSTEM)
        release.wait_rolled_out()  # the new replicas ready, the old ones through preStop and gone
        after = {p["metadata"]["name"] for p in release.pods(SYSTEM, "app.kubernetes.io/component=extproc")}
        time.sleep(3)
    finally:
        stop.set()
        thread.join(60)
    assert not before & after  # every replica was replaced
    assert len(outcomes) > 20
    assert Counter(outcomes) == {(200, True): len(outcomes)}, failures


def test_the_node_resolves_service_names_and_routes_cluster_ips(release: Release):
    """CoreDNS and kube-proxy, as the chart relies on them: Envoy's ext_proc cluster is a DNS name,
    the ext_procs reach Redis and the API server by Service."""
    (pod,) = release.pods(SYSTEM, "app.kubernetes.io/component=controller")
    service = f"{RELEASE}-extproc.{SYSTEM}.svc.cluster.local"
    script = (
        "import socket, json, urllib.request; print(json.dumps(["
        f"socket.gethostbyname('{service}'), socket.gethostbyname('kubernetes.default.svc.cluster.local'),"
        f"urllib.request.urlopen('http://{service}:9003/healthz', timeout=10).status]))"
    )
    extproc_ip, api_ip, status = json.loads(release.exec(SYSTEM, pod["metadata"]["name"], "python", "-c", script))
    assert extproc_ip.startswith("10.96.") and api_ip == "10.96.0.1"
    assert status == 200  # through the Service's cluster IP, which kube-proxy routes to a replica


def test_precise_mode_reads_the_tokenizer_from_its_mounted_volume(release: Release, tmp_path: Path):
    """The chart's tokenizer volume as the kubelet mounts it (a ConfigMap, read-only, read by the
    non-root ext_proc): every replica runs precise mode with it, and routing goes on."""
    tokenizer_files(tmp_path / "tokenizer")
    release.cp.kubectl("create", "configmap", "tiny-tokenizer", "-n", SYSTEM, f"--from-file={tmp_path / 'tokenizer'}")
    release.install(extproc_replicas=3, verb="upgrade", tokenizer_config_map="tiny-tokenizer")
    replicas = [f"http://{ip}:9003" for ip in release.ready_ips(SYSTEM, "app.kubernetes.io/component=extproc")]
    assert len(replicas) == 3
    for replica in replicas:
        readyz = json.loads(get(replica, "/readyz")[2])
        assert not any("tokenizer" in w for w in readyz["warnings"]), readyz
        assert any("without KV events" in w for w in readyz["warnings"]), readyz  # precise; the simulators publish none
    assert release.chat("precise on the node " * 100)["x-kvroute-decision"]
