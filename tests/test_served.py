"""What the sibling replicas served each flow (extproc/replicas/served.py): counted once as it grows,
whether a sibling goes unheard, comes back, restarts or forgets a flow."""

from __future__ import annotations

from extproc.replicas import served
from extproc.replicas.served import SiblingsServed


def test_a_sibling_unheard_keeps_what_it_served_and_back_with_the_same_totals_adds_nothing():
    """The flow a sibling served much neither falls behind the others while it is unheard (and
    takes every turn here) nor jumps ahead when it is heard again (and the others take them)."""
    siblings = SiblingsServed()
    siblings.heard("r", {0: {"f": 100_000.0}}, now=0.0)
    siblings.heard("s", {0: {"g": 100_000.0}}, now=0.0)
    assert siblings.totals(now=1.0) == {0: {"f": 100_000.0, "g": 100_000.0}}
    assert siblings.totals(now=30.0) == {0: {"f": 100_000.0, "g": 100_000.0}}  # r and s unheard a while
    siblings.heard("r", {0: {"f": 100_000.0}}, now=31.0)  # r back, as it was
    siblings.heard("r", {0: {"f": 100_300.0}}, now=31.1)  # and serving on
    assert siblings.totals(now=31.2) == {0: {"f": 100_300.0, "g": 100_000.0}}


def test_a_total_that_starts_again_from_zero_adds_what_it_serves_anew():
    """A sibling restarted under its name, or one that forgot an idle flow: its total for the flow
    is back near 0, and what it serves from there is added to what it had served."""
    siblings = SiblingsServed()
    siblings.heard("r", {0: {"f": 500.0}}, now=0.0)
    siblings.heard("r", {0: {"f": 40.0}}, now=1.0)
    siblings.heard("r", {0: {"f": 90.0}}, now=2.0)
    assert siblings.totals(now=2.0) == {0: {"f": 590.0}}


def test_siblings_gone_long_are_folded_into_one_bounded_account():
    siblings = SiblingsServed()
    for i in range(3):
        siblings.heard(f"r{i}", {0: {"f": 10.0}, 1: {f"g{i}": 1.0}}, now=0.0)
    late = served.KEPT_S + 1.0
    assert siblings.totals(now=late) == {0: {"f": 30.0}, 1: {"g0": 1.0, "g1": 1.0, "g2": 1.0}}
    assert not siblings._siblings  # folded
    many = {0: {f"flow{i}": float(i) for i in range(2 * served.MAX_FLOWS + 1)}}
    siblings.heard("big", many, now=late)
    kept = siblings._siblings["big"][2][0]
    assert len(kept) == served.MAX_FLOWS and min(kept.values()) == served.MAX_FLOWS + 1  # the largest


def test_a_sibling_heard_again_after_it_was_folded_adds_only_what_it_served_since():
    """Its link down past KEPT_S, a sibling is folded; heard again (its name is its process's),
    its totals go on from those it last told, not counted a second time."""
    siblings = SiblingsServed()
    siblings.heard("r", {0: {"f": 1_000.0}}, now=0.0)
    late = served.KEPT_S + 1.0
    assert siblings.totals(now=late) == {0: {"f": 1_000.0}} and not siblings._siblings
    siblings.heard("r", {0: {"f": 1_200.0}}, now=late)
    assert siblings.totals(now=late) == {0: {"f": 1_200.0}}
    for i in range(served.FOLDED_KEPT + 1):  # the last totals kept are bounded
        siblings.heard(f"s{i}", {0: {"g": 1.0}}, now=late)
    siblings.totals(now=2 * late + 1.0)
    assert len(siblings._folded_last) == served.FOLDED_KEPT and "r" not in siblings._folded_last
