"""Whom a request belongs to (extproc/core/objectives.py): llm-d's headers, bounded."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from extproc.core.objectives import DEFAULT_FLOW, classify
from extproc.core.settings import MAX_FLOW_ID

PRIORITIES = {"critical": 10, "batch": -1}


def test_the_current_header_wins_over_its_alias():
    headers = {
        "x-llm-d-inference-objective": "critical",
        "x-gateway-inference-objective": "batch",
        "x-llm-d-inference-fairness-id": "team-a",
        "x-gateway-inference-fairness-id": "team-b",
        "x-llm-d-slo-ttft-ms": "500",
        "x-slo-ttft-ms": "9000",
    }
    assert classify(headers, PRIORITIES) == (10, "team-a", 0.5, "critical", True)


def test_the_older_names_gateways_still_send_are_read():
    headers = {"x-gateway-inference-objective": "batch", "x-gateway-inference-fairness-id": "t", "x-slo-ttft-ms": "2"}
    assert classify(headers, PRIORITIES) == (-1, "t", 0.002, "batch", True)


def test_an_unknown_objective_gets_the_default_priority_and_is_flagged():
    assert classify({"x-llm-d-inference-objective": "nope"}, PRIORITIES, default_priority=3) == (
        3,
        DEFAULT_FLOW,
        None,
        "nope",
        False,
    )


def test_the_flow_falls_back_to_the_tenant_then_the_default():
    assert classify({"x-tenant": "acme"}, {}, tenant_header="x-tenant").flow == "acme"
    assert classify({"x-tenant": "acme"}, {}).flow == DEFAULT_FLOW
    assert classify({}, {}) == (0, DEFAULT_FLOW, None, None, True)


def test_a_long_flow_id_becomes_a_bounded_digest_and_stays_distinct():
    a = classify({"x-llm-d-inference-fairness-id": "x" * 10_000}, {}).flow
    b = classify({"x-llm-d-inference-fairness-id": "x" * 9_999 + "y"}, {}).flow
    assert len(a) <= MAX_FLOW_ID and a != b and a.startswith("sha256:")


@given(st.text(max_size=50))
def test_any_ttft_header_is_a_positive_bounded_objective_or_none(value):
    ttft = classify({"x-llm-d-slo-ttft-ms": value}, {}).ttft_s
    assert ttft is None or 0 < ttft <= 86_400
