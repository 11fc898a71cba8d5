"""The decision pipeline's seam: stages assembled in one place, a new rule added without touching
the router, and a decision that is never changed after it is made."""

from __future__ import annotations

import pytest

from extproc.core.adapters import AdapterBook
from extproc.core.backends import Backend
from extproc.core.decision import CandidateCost, Label
from extproc.core.pipeline import Pipeline, assemble
from extproc.core.request import PromptRequest, parse_request
from extproc.core.router import Router
from extproc.core.rules import Standing
from extproc.core.settings import Settings

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
FLEET = [Backend(A), Backend(B), Backend(C, frozenset({"other"}))]


def chat(text: str) -> PromptRequest:
    return parse_request({"model": "m", "messages": [{"role": "user", "content": text}]}, {})


def test_a_rule_is_one_line_where_the_pipeline_is_assembled():
    def prefer_b(standing: Standing) -> tuple[CandidateCost, Label] | None:
        picked = next((c for c in standing.room if c.backend == B), None)
        return (picked, Label.PREFIX_HOME) if picked is not None else None

    router = Router(Settings(hash_key=bytes(16)))
    default = assemble(AdapterBook())
    router.pipeline = Pipeline(default.filters, default.terms, default.admission, (prefer_b, *default.rules))
    for i in range(4):
        exchange = router.begin(chat(f"q{i}"), FLEET, float(i))
        assert (exchange.decision.label, exchange.decision.backend) == (Label.PREFIX_HOME, B)
        exchange.end()


def test_candidates_are_the_healthy_backends_serving_the_model():
    fleet = [*FLEET, Backend("10.0.0.4:8000", healthy=False)]
    assert assemble(AdapterBook()).candidates(chat("q"), fleet) == [A, B]
    assert assemble(AdapterBook()).candidates(chat("q"), []) == []


def test_admission_sheds_when_every_candidate_is_at_its_limit():
    router = Router(Settings(hash_key=bytes(16), max_backend_requests=1))
    held = [router.begin(chat(f"q{i}"), FLEET, 0.0) for i in range(2)]
    assert {e.decision.backend for e in held} == {A, B}
    shed = router.begin(chat("q2"), FLEET, 0.0)
    assert (shed.decision.label, shed.decision.backend, shed.reservation) == (Label.SHED, None, None)


def test_a_decision_is_not_changed_after_it_is_made():
    exchange = Router(Settings(hash_key=bytes(16))).begin(chat("q"), FLEET, 0.0)
    with pytest.raises(AttributeError):
        exchange.decision.label = Label.FALLBACK  # type: ignore[misc]
    assert exchange.reservation is not None and exchange.end()
