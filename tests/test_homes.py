"""Prefix homes: where each prompt head was first placed, kept after caches forget it; bounded."""

from __future__ import annotations

import pytest

from extproc.core import homes
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
    assert len(table) == 1 and table.get(3) == "B"
