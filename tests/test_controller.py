"""The operator's logic (plain functions), its reconciler, and what its kopf layer registers."""

from __future__ import annotations

import asyncio
from typing import Any

import kopf
import pytest

import controller.operator as operator
from controller import logic
from controller.late_crds import Insights
from controller.reconciler import Reconciler
from tests.k8s_objects import inference_pool, pod, policy, pool_policy

T0, T1 = "2026-11-29T10:00:00Z", "2026-11-29T10:05:00Z"


def summaries(*pods: dict[str, Any]) -> list[dict[str, Any]]:
    return [logic.pod_summary(p) for p in pods]


def status(spec_policy: dict[str, Any], *pods: dict[str, Any], now: str = T0) -> dict[str, Any]:
    return logic.desired_status(spec_policy, summaries(*pods), now)


def test_ready_pods_become_backends_with_named_ports():
    result = status(policy(), pod("b", "10.1.0.2"), pod("a", "10.1.0.1"))
    assert result["backends"] == [
        {"pod": "a", "ip": "10.1.0.1", "port": 8000, "ready": True, "models": []},
        {"pod": "b", "ip": "10.1.0.2", "port": 8000, "ready": True, "models": []},
    ]
    assert result["readyBackends"] == 2
    assert [(c["type"], c["status"], c["reason"]) for c in result["conditions"]] == [
        ("Ready", "True", "Reconciled"),
        ("BackendsAvailable", "True", "ReadyPods"),
        ("RoutingAccepted", "True", "Accepted"),
    ]


def pools(*bodies: dict[str, Any]) -> list[dict[str, Any]]:
    return [logic.pool_summary(b) for b in bodies]


def test_a_policy_on_an_inference_pool_routes_to_each_pod_ip_times_each_target_port():
    pods = summaries(pod("b", "10.1.0.2"), pod("a", "10.1.0.1"), pod("x", "10.1.0.9", labels={"app": "other"}))
    pool = inference_pool("chat", ports=(8001, 8000), labels={"app": "vllm"})
    result = logic.desired_status(
        pool_policy("chat"), pods, T0, pools(pool, inference_pool("other", labels={"app": "other"}))
    )
    assert [(b["pod"], b["ip"], b["port"]) for b in result["backends"]] == [
        ("a", "10.1.0.1", 8000),
        ("a", "10.1.0.1", 8001),
        ("b", "10.1.0.2", 8000),
        ("b", "10.1.0.2", 8001),
    ]
    assert result["readyBackends"] == 4 and result["conditions"][0]["status"] == "True"


def test_a_missing_or_portless_pool_routes_nowhere_and_says_why():
    pods = summaries(pod("a", "10.1.0.1"))
    missing = logic.desired_status(pool_policy("chat"), pods, T0, pools(inference_pool("other")))
    assert missing["backends"] == [] and missing["conditions"][1]["reason"] == "PoolNotFound"
    assert "'chat'" in missing["conditions"][1]["message"]
    portless = logic.desired_status(pool_policy("chat"), pods, T0, pools(inference_pool("chat", ports=())))
    assert portless["backends"] == [] and portless["conditions"][1]["reason"] == "PoolHasNoPorts"
    # the pool's selector, not the policy's leftovers, decides: a pool selecting nothing gives nothing
    elsewhere = logic.desired_status(pool_policy("chat"), pods, T0, pools(inference_pool("chat", labels={"app": "x"})))
    assert elsewhere["conditions"][1]["reason"] == "NoMatchingPods"


def test_unknown_routing_fields_are_reported_in_a_condition():
    result = status(policy(routing={"blocksize": 256, "prefixStickRatio": 0.7}), pod("a", "10.1.0.1"))
    accepted = next(c for c in result["conditions"] if c["type"] == "RoutingAccepted")
    assert (accepted["status"], accepted["reason"]) == ("False", "UnknownFields")
    assert "blocksize" in accepted["message"] and "prefixStickRatio" not in accepted["message"]


@pytest.mark.parametrize(
    "unready",
    [pod("a", ready=False), pod("a", terminating=True), pod("a", ip="")],
    ids=["not-ready", "terminating", "no-ip"],
)
def test_unready_terminating_or_ipless_pods_are_listed_but_not_ready(unready):
    result = status(policy(), unready)
    assert result["backends"][0]["ready"] is False
    assert result["readyBackends"] == 0
    assert result["conditions"][1]["reason"] == "NoReadyPods"
    assert result["conditions"][0]["status"] == "False"


def test_selector_semantics():
    labels = {"app": "vllm", "tier": "gpu", "zone": "a"}
    assert logic.selector_matches({"matchLabels": {"app": "vllm"}}, labels)
    assert not logic.selector_matches({"matchLabels": {"app": "other"}}, labels)
    assert logic.selector_matches({"matchExpressions": [{"key": "tier", "operator": "In", "values": ["gpu"]}]}, labels)
    assert not logic.selector_matches(
        {"matchExpressions": [{"key": "zone", "operator": "NotIn", "values": ["a"]}]}, labels
    )
    assert logic.selector_matches({"matchExpressions": [{"key": "zone", "operator": "Exists"}]}, labels)
    assert not logic.selector_matches({"matchExpressions": [{"key": "zone", "operator": "DoesNotExist"}]}, labels)
    assert not logic.selector_matches({}, labels)  # an empty selector selects nothing


def test_label_change_moves_a_pod_in_and_out_of_the_selector():
    selected = policy(selector={"matchLabels": {"app": "vllm", "pool": "blue"}})
    assert status(selected, pod("a", labels={"pool": "green"}))["backends"] == []
    assert status(selected, pod("a", labels={"pool": "blue"}))["readyBackends"] == 1


def test_ip_change_and_readiness_flip_change_the_status():
    before = status(policy(), pod("a", "10.1.0.1"))
    moved = status(policy(), pod("a", "10.1.0.9"))
    flipped = status(policy(), pod("a", "10.1.0.1", ready=False))
    assert logic.status_differs(before, moved)
    assert logic.status_differs(before, flipped)
    assert not logic.status_differs(before, status(policy(), pod("a", "10.1.0.1"), now=T1))


def test_numeric_port_unknown_port_name_and_no_matching_pods():
    assert status(policy(targetPort=9000), pod("a"))["backends"][0]["port"] == 9000
    assert status(policy(targetPort="9001"), pod("a"))["backends"][0]["port"] == 9001
    missing = status(policy(targetPort="grpc"), pod("a"))
    assert missing["backends"] == [] and missing["conditions"][1]["reason"] == "PortNotFound"
    nobody = status(policy(), pod("x", labels={"app": "other"}))
    assert nobody["conditions"][1]["reason"] == "NoMatchingPods"


def test_models_from_spec_label_or_annotation():
    labelled = pod("a", labels={logic.MODELS_KEY: "llama"})
    annotated = pod("b", annotations={logic.MODELS_KEY: "qwen, llama"})
    result = status(policy(), labelled, annotated)
    assert [b["models"] for b in result["backends"]] == [["llama"], ["llama", "qwen"]]
    assert status(policy(models=["m1"]), labelled)["backends"][0]["models"] == ["m1"]


def test_transition_time_is_kept_while_the_condition_holds():
    first = status(policy(), pod("a"))
    later = logic.desired_status({**policy(), "status": first}, summaries(pod("a"), pod("b", "10.1.0.2")), T1)
    assert later["conditions"][0]["lastTransitionTime"] == T0
    down = logic.desired_status({**policy(), "status": later}, summaries(pod("a", ready=False)), T1)
    assert down["conditions"][0]["lastTransitionTime"] == T1


def test_observed_generation_follows_the_policy():
    assert status(policy(generation=7), pod("a"))["observedGeneration"] == 7


def record(namespace: str, body: dict[str, Any]) -> dict[str, Any]:
    """What the policy index holds for a policy."""
    return {
        "name": body["metadata"]["name"],
        "metadata": body["metadata"],
        "spec": body["spec"],
        "status": body["status"],
    }


def test_reconciler_collapses_bursts_and_writes_only_changes():
    patches: list[tuple[str, str, dict[str, Any]]] = []

    async def patch(namespace: str, name: str, new: dict[str, Any]) -> None:
        patches.append((namespace, name, new))

    async def scenario() -> None:
        reconciler = Reconciler(patch, debounce_s=0.05, clock=lambda: T0)
        task = asyncio.create_task(reconciler.run())
        pods = {"llm": summaries(pod("a"))}
        policies = {
            "llm": [record("llm", policy("p1")), record("llm", policy("p2", selector={"matchLabels": {"x": "y"}}))]
        }
        for _ in range(50):  # a burst of events
            reconciler.touch("llm", pods, policies, {})
        await asyncio.sleep(0.3)
        assert len(patches) == 2 and {p[1] for p in patches} == {"p1", "p2"}
        # the patched statuses come back through the index: nothing more to write
        policies["llm"] = [{**r, "status": p[2]} for r, p in zip(policies["llm"], patches, strict=True)]
        reconciler.touch("llm", pods, policies, {})
        await asyncio.sleep(0.2)
        assert len(patches) == 2
        pods["llm"] = summaries(pod("a"), pod("b", "10.1.0.2"))
        reconciler.touch("llm", pods, policies, {})
        await asyncio.sleep(0.2)
        assert [p[1] for p in patches[2:]] == ["p1"]
        task.cancel()

    asyncio.run(scenario())


def test_reconciler_reports_and_retries_failed_patches():
    calls: list[str] = []

    async def flaky(_namespace: str, name: str, _status: dict[str, Any]) -> None:
        calls.append(name)
        if len(calls) == 1:
            raise ConnectionError("API server unreachable")

    async def scenario() -> None:
        reconciler = Reconciler(flaky, debounce_s=0)
        reconciler.touch("llm", {"llm": summaries(pod("a"))}, {"llm": [record("llm", policy())]}, {})
        await reconciler.settle(["llm"])
        assert reconciler.last_error and "unreachable" in reconciler.last_error
        await reconciler.settle(["llm"])
        assert reconciler.last_error is None and reconciler.patches == 1

    asyncio.run(scenario())


def test_kopf_layer_registers_indexes_events_and_lifecycle():
    registry = operator.REGISTRY
    indexes = {
        h.id: (h.selector.group, h.selector.version, h.selector.any_name) for h in registry._indexing.get_all_handlers()
    }
    assert indexes == {
        "pods_by_namespace": ("", "v1", "pods"),
        "policies_by_namespace": ("kvroute.io", "v1alpha1", "kvroutingpolicies"),
        "pools_by_namespace": ("inference.networking.k8s.io", "v1", "inferencepools"),
    }
    watched = {(h.selector.group, h.selector.any_name) for h in registry._watching.get_all_handlers()}
    assert watched == {
        ("", "pods"),
        ("kvroute.io", "kvroutingpolicies"),
        ("inference.networking.k8s.io", "inferencepools"),
    }
    assert not registry._changing.get_all_handlers()  # nothing that would write finalizers or annotations
    assert not registry._spawning.get_all_handlers()
    activities = {h.activity.value for h in registry._activities.get_all_handlers()}
    assert activities == {"startup", "cleanup", "authentication"}


def test_kopf_handlers_feed_the_reconciler():
    body = kopf.Body(pod("a"))
    assert operator.pods_by_namespace(namespace="llm", body=body) == {"llm": logic.pod_summary(pod("a"))}
    indexed = operator.policies_by_namespace(namespace="llm", name="default", body=kopf.Body(policy(generation=3)))
    assert indexed["llm"]["metadata"] == {"generation": 3} and indexed["llm"]["spec"]["targetPort"] == "http"
    touched: list[str] = []

    class Recorder:
        def touch(self, namespace: str, pods: Any, policies: Any, pools: Any) -> None:
            touched.append(namespace)

    memo = kopf.Memo(reconciler=Recorder())
    operator.changed(namespace="llm", memo=memo, pods_by_namespace={}, policies_by_namespace={}, pools_by_namespace={})
    pool = operator.pools_by_namespace(namespace="llm", body=kopf.Body(inference_pool("p", (8000, 8001))))
    assert pool == {"llm": {"name": "p", "selector": {"matchLabels": {"app": "vllm"}}, "targetPorts": [8000, 8001]}}
    assert touched == ["llm"]


def test_startup_configures_kopf_quietly(monkeypatch):
    settings = kopf.OperatorSettings()

    async def local() -> Any:
        return operator.client.Configuration(host="https://127.0.0.1:1")

    monkeypatch.setattr(operator, "_client_configuration", local)
    memo = kopf.Memo(health_host="127.0.0.1", health_port=0, insights=Insights())

    async def scenario() -> None:
        await operator.start(settings=settings, memo=memo)
        assert len(memo.late_crd_tasks) == 2 and not any(task.done() for task in memo.late_crd_tasks)
        await operator.stop(memo=memo)
        assert all(task.cancelled() for task in memo.late_crd_tasks)

    asyncio.run(scenario())
    assert settings.posting.enabled is False and settings.scanning.disabled is False  # a later pool CRD is seen
    assert settings.peering.mandatory is True and settings.peering.priority > 0


def test_a_malformed_policy_does_not_stop_the_others():
    patched: list[str] = []

    async def patch(_namespace: str, name: str, _status: dict[str, Any]) -> None:
        patched.append(name)

    async def scenario() -> None:
        reconciler = Reconciler(patch, debounce_s=0)
        broken = record("llm", policy("broken"))
        del broken["spec"]["targetPort"]  # the CRD forbids it; a reconciler must survive it anyway
        reconciler.touch("llm", {"llm": summaries(pod("a"))}, {"llm": [record("llm", policy("good")), broken]}, {})
        await reconciler.settle(["llm"])
        assert patched == ["good"] and reconciler.errors == 1 and "broken" in reconciler.last_error

    asyncio.run(scenario())


def test_the_reconciler_settles_pool_policies_when_their_pool_appears():
    patched: list[dict[str, Any]] = []

    async def patch(_namespace: str, _name: str, new: dict[str, Any]) -> None:
        patched.append(new)

    async def scenario() -> None:
        reconciler = Reconciler(patch, debounce_s=0)
        pods = {"llm": summaries(pod("a"))}
        reconciler.touch("llm", pods, {"llm": [record("llm", pool_policy("chat"))]}, {})
        await reconciler.settle(["llm"])
        reconciler.touch(
            "llm", pods, {"llm": [record("llm", pool_policy("chat"))]}, {"llm": pools(inference_pool("chat"))}
        )
        await reconciler.settle(["llm"])

    asyncio.run(scenario())
    assert [p["readyBackends"] for p in patched] == [0, 1]
    assert patched[0]["conditions"][1]["reason"] == "PoolNotFound"
