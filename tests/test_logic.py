"""controller/logic.py: a policy's desired status from pods and pools, as plain functions."""

from __future__ import annotations

import pytest

from controller import logic
from tests.controller_objects import T0, T1, pools, status, summaries
from tests.k8s_objects import inference_pool, pod, policy, pool_policy


def test_ready_pods_become_backends_with_named_ports():
    result = status(policy(), pod("b", "10.1.0.2"), pod("a", "10.1.0.1"))
    assert result["backends"] == [
        {"pod": "a", "ip": "10.1.0.1", "port": 8000, "ready": True, "models": [], "role": "both"},
        {"pod": "b", "ip": "10.1.0.2", "port": 8000, "ready": True, "models": [], "role": "both"},
    ]
    assert result["readyBackends"] == 2
    assert [(c["type"], c["status"], c["reason"]) for c in result["conditions"]] == [
        ("Ready", "True", "Reconciled"),
        ("BackendsAvailable", "True", "ReadyPods"),
        ("RoutingAccepted", "True", "Accepted"),
    ]


def test_a_pods_role_comes_from_the_policy_else_kvroutes_label_else_llm_ds():
    vllm = {"app": "vllm"}
    pods = (
        pod("a", "10.1.0.1", labels={**vllm, "kvroute.io/role": "prefill", "llm-d.ai/role": "decode"}),
        pod("b", "10.1.0.2", labels={**vllm, "llm-d.ai/role": "Decode"}),
        pod("c", "10.1.0.3", labels={**vllm, "llm-d.ai/role": "sidecar"}),  # names no role: serves whole
        pod("d", "10.1.0.4"),
    )
    assert [b["role"] for b in status(policy(), *pods)["backends"]] == ["prefill", "decode", "both", "both"]
    assert {b["role"] for b in status(policy(role="decode"), *pods)["backends"]} == {"decode"}


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
    "routing", [{"flowWeights": {"a": 2_000_000}}, {"queueMetricFlows": [""]}, {"flowWeights": {"a" * 200: 1}}]
)
def test_a_value_the_schema_lets_through_but_the_settings_refuse_is_not_accepted(routing):
    """The condition says what the ext_procs do with it: keep their last accepted settings."""
    result = status(policy(routing=routing), pod("a", "10.1.0.1"))
    accepted = next(c for c in result["conditions"] if c["type"] == "RoutingAccepted")
    assert (accepted["status"], accepted["reason"]) == ("False", "InvalidValue")
    assert "last accepted settings kept" in accepted["message"]
    assert result["readyBackends"] == 1  # the backends are published all the same


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


def test_a_status_stays_within_what_the_api_server_stores_whatever_the_policy_and_pods_say():
    """etcd refuses an object past 1.5 MiB, and a status not written keeps the last backends
    published: at most MAX_BACKENDS backends (the ready ones first, a condition saying how many
    more were selected), MAX_MODELS names of bounded length each, messages cut."""
    import orjson

    many = [pod(f"p{i:05}", f"10.{i // 250}.{i % 250}.1", ready=i % 3 != 0) for i in range(logic.MAX_BACKENDS + 500)]
    result = status(policy(), *many)
    ready = sum(i % 3 != 0 for i in range(logic.MAX_BACKENDS + 500))
    assert len(result["backends"]) == logic.MAX_BACKENDS and result["readyBackends"] == ready  # all the ready
    assert f"{logic.MAX_BACKENDS + 500} backends selected" in result["conditions"][1]["message"]
    names = ",".join(f"model-{i}-" + "x" * 200 for i in range(5000)) + "," + "y" * 10_000
    crowded = status(policy(), pod("a", annotations={logic.MODELS_KEY: names}))
    assert len(crowded["backends"][0]["models"]) == logic.MAX_MODELS
    assert all(len(m) <= logic.MAX_MODEL_NAME for m in crowded["backends"][0]["models"])
    unknown = status(policy(routing={f"field{i}": 1 for i in range(100_000)}), pod("a"))
    assert all(len(c["message"]) <= logic.MAX_MESSAGE for c in unknown["conditions"])
    assert len(orjson.dumps(result)) < 1_000_000  # a full status, with room to spare
    # each pod naming 32 models of 250 characters: the counts alone let 190 of them take 1.5 MiB
    models = ",".join(f"m{i:02}-" + "z" * 246 for i in range(logic.MAX_MODELS))
    heavy = [
        pod(f"h{i:03}", f"10.9.{i}.1", ready=i % 2 == 0, annotations={logic.MODELS_KEY: models}) for i in range(250)
    ]
    bounded = status(policy(), *heavy)
    assert sum(len(orjson.dumps(backend)) for backend in bounded["backends"]) <= logic.MAX_BACKENDS_BYTES
    assert 0 < len(bounded["backends"]) < 250 and bounded["readyBackends"] == 125  # every ready one named
    assert "250 backends selected" in bounded["conditions"][1]["message"]


def test_a_target_port_of_unicode_digits_is_a_port_name_not_a_crash():
    result = status(policy(targetPort="²"), pod("a"))
    assert result["backends"] == [] and result["conditions"][1]["reason"] == "PortNotFound"


def test_a_selector_of_many_values_is_matched_without_scanning_them():
    values = [f"v{i}" for i in range(120_000)]
    selector = {"matchExpressions": [{"key": "app", "operator": "NotIn", "values": values}]}
    calls = 0

    class Counting(str):
        def __eq__(self, other: object) -> bool:
            nonlocal calls
            calls += 1
            return str.__eq__(self, other)

        __hash__ = str.__hash__

    assert logic.selector_matches(selector, {"app": Counting("vllm")})
    assert calls < 10, calls
