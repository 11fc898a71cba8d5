"""Cache pressure: how much of their context returning conversations find evicted, and what it
widens (the balance gates) or turns off (a home's pull among equal holders)."""

from __future__ import annotations

import pytest

from extproc.core.decision import Label
from extproc.core.pressure import MAX_GATE_FACTOR, CachePressure
from tests.test_router import FLEET, chat, make_router, serve


def test_nothing_lost_keeps_the_configured_gates():
    pressure = CachePressure()
    for _ in range(100):
        pressure.returned(50, 50)
        pressure.returned(50, 80)  # more than before (another conversation shares its head): nothing lost
    assert pressure.lost == 0 and pressure.gate_factor() == 1.0


def test_the_gates_widen_with_the_share_lost_and_stop_at_the_cap():
    pressure = CachePressure()
    pressure.returned(0, 0)  # no known previous prompt: no sample
    assert pressure.lost == 0
    for _ in range(200):
        pressure.returned(100, 75)
    assert pressure.lost == pytest.approx(0.25, abs=1e-3)
    assert pressure.gate_factor() == pytest.approx(0.75**-5, rel=1e-2)  # about 4
    for _ in range(200):
        pressure.returned(100, 0)
    assert pressure.gate_factor() == MAX_GATE_FACTOR


def test_homes_keep_their_heads_among_equal_holders_only_while_little_is_lost():
    pressure = CachePressure()
    assert pressure.home_ties()
    for _ in range(200):
        pressure.returned(100, 85)  # 15 % lost
    assert pressure.home_ties()
    for _ in range(200):
        pressure.returned(100, 70)  # 30 % lost: starved
    assert not pressure.home_ties()


def test_a_running_mean_recovers_when_contexts_survive_again():
    pressure = CachePressure()
    for _ in range(100):
        pressure.returned(100, 0)
    for _ in range(100):
        pressure.returned(100, 100)
    assert pressure.lost < 0.01


def test_a_refused_return_is_no_sample_its_retries_would_count_again():
    """A conversation whose context is gone, refused (every backend at its request limit) and
    retried: no return was served, so the pressure does not move; served, it counts once."""
    router = make_router(max_backend_requests=1)
    history: list[dict[str, str]] = []
    for turn in range(2):
        question = f"turn {turn}: " + "word " * 300
        home = serve(router, chat(history, "s", question), turn).backend
        history += [{"role": "user", "content": question}, {"role": "assistant", "content": "answer " * 200}]
    assert home is not None
    router.index.remove_backend(home)  # its context evicted from the picture
    busy = [router.loads.reserve(b.address, 1) for b in FLEET]
    for retry in range(5):
        exchange = router.begin(chat(history, "s", "again"), FLEET, 30 + retry)
        assert exchange.decision.label is Label.SHED
    assert router.pressure.lost == 0
    for reservation in busy:
        reservation.finish()
    router.begin(chat(history, "s", "again"), FLEET, 40).end()
    assert router.pressure.lost > 0
