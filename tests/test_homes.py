"""Prefix homes: where each prompt head was first placed, kept after caches forget it; bounded."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.core import departures, homes
from extproc.core.homes import PrefixHomes


def test_homes_are_bounded_least_recently_used_first_out(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(homes, "CAPACITY", 3)
    table = PrefixHomes()
    for head in range(3):
        table.place(head, "A")
    assert table.get(0) == "A"  # used: now the most recent
    table.place(3, "B")
    assert len(table) == 3 and table.get(1) is None and table.get(0) == "A"
    table.remove_backend("A")
    assert table.get(0) is None and table.get(3) == "B"


def test_a_backend_that_left_loses_its_homes_as_they_are_met_and_a_return_brings_none_back(
    monkeypatch: pytest.MonkeyPatch,
):
    """Leaving is no pass over the table (65,536 homes took some 20 ms a backend); a backend back
    at the same address is home to none of the heads it had; past GONE_MOST gone, one pass."""
    table = PrefixHomes()
    for head in range(6):
        table.place(head, "ABC"[head % 3])
    kept = table._homes
    table.remove_backend("A")
    assert table._homes is kept and len(table) == 6  # nothing done yet
    assert table.get(0) is None and len(table) == 5  # met: gone
    table.place(10, "A")  # back: its old heads are not its any more
    assert table.get(3) is None and table.get(10) == "A" and len(table) == 5
    monkeypatch.setattr(departures, "GONE_MOST", 1)
    table.remove_backend("B")
    table.remove_backend("C")
    assert len(table) == 1 and table.get(10) == "A"


def test_a_full_table_drops_the_homes_of_backends_that_left_before_live_ones(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(homes, "CAPACITY", 4)
    table = PrefixHomes()
    table.place(0, "B")
    for head in range(1, 4):
        table.place(head, "A")
    table.remove_backend("A")
    table.place(9, "B")  # five held, four allowed: the three void ones go, not the oldest live one
    assert table.get(0) == "B" and table.get(9) == "B" and len(table) == 2


@settings(max_examples=500)
@given(
    st.lists(
        st.tuples(st.sampled_from(["place", "place", "get", "leave"]), st.integers(0, 3), st.sampled_from("ABC")),
        min_size=6,
    ),
    st.integers(1, 3),
)
def test_leaving_lazily_answers_as_dropping_at_once(operations, capacity):
    """Whatever is placed, met, left, come back or pushed out, the table answers as one that
    dropped a backend's homes the moment it left (least recently used first out)."""
    homes.CAPACITY, saved = capacity, homes.CAPACITY
    try:
        table, model = PrefixHomes(), {}
        for op, head, backend in operations:
            if op == "place":
                model.pop(head, None)
                model[head] = backend
                table.place(head, backend)
                while len(model) > capacity:
                    del model[next(iter(model))]
            elif op == "get":
                assert table.get(head) == model.get(head)
                if head in model:
                    model[head] = model.pop(head)  # used: the most recent
            else:
                table.remove_backend(backend)
                model = {h: b for h, b in model.items() if b != backend}
        assert all(table.get(h) == b for h, b in model.items()) and len(model) <= capacity
    finally:
        homes.CAPACITY = saved
