"""What the sibling replicas served each flow, counted once as it grows.

A sibling tells its flows' cost served since it started, every 0.1 s. Summing the latest of each
would make a flow's fleet-wide share drop whenever a sibling goes unheard (it restarted, the link
blinked) and come back whole when it is heard again: the flows it had served much fell far behind
the others and took every turn of their band until they had caught up, then the others did. So
each sibling's count is taken by what it adds: a sibling unheard keeps what it served; heard
again with the same totals it adds nothing; a flow it forgot and serves anew (its total back to
0) adds what it serves from there. Bounded: siblings unheard for KEPT_S are folded into one
account (their last totals kept for the FOLDED_KEPT latest, so one heard again after all, the link
down that long, adds only what it served since), and an account past twice MAX_FLOWS flows of a
band keeps its MAX_FLOWS largest.
"""

from __future__ import annotations

from collections.abc import Mapping

from extproc.core.settings import MAX_QUEUE_FLOWS

KEPT_S = 600.0  # a sibling unheard this long has its account folded into the departed siblings'
MAX_FLOWS = MAX_QUEUE_FLOWS  # flows of a band the departed siblings' account keeps
FOLDED_KEPT = 64  # folded siblings whose last totals are kept (a replica's name is new each start)

ByBand = dict[int, dict[str, float]]


class SiblingsServed:
    """Per sibling, the last totals it told and what they added; their sum by band and flow."""

    __slots__ = ("_departed", "_folded_last", "_siblings")

    def __init__(self) -> None:
        # replica -> (when heard, its last totals, what it added) by band and flow
        self._siblings: dict[str, tuple[float, ByBand, ByBand]] = {}
        self._departed: ByBand = {}
        self._folded_last: dict[str, ByBand] = {}  # a folded sibling's last totals, oldest first

    def heard(self, replica: str, totals: Mapping[int, Mapping[str, float]], now: float) -> None:
        """A sibling's totals by band and flow (what it served since it started)."""
        _, last, added = self._siblings.get(replica) or (now, self._folded_last.pop(replica, {}), {})
        for band, flows in totals.items():
            before, into = last.get(band, {}), added.setdefault(band, {})
            for flow, total in flows.items():
                previous = before.get(flow, 0.0)
                into[flow] = into.get(flow, 0.0) + (total - previous if total >= previous else total)
            _keep_largest(added, band)
        self._siblings[replica] = (now, {band: dict(flows) for band, flows in totals.items()}, added)

    def totals(self, now: float) -> ByBand:
        """What every sibling served each flow, by band (the departed ones' too)."""
        for replica in [r for r, (heard, _, _) in self._siblings.items() if now - heard > KEPT_S]:
            _, last, added = self._siblings.pop(replica)
            self._fold(added)
            self._folded_last[replica] = last
            if len(self._folded_last) > FOLDED_KEPT:
                del self._folded_last[next(iter(self._folded_last))]
        out: ByBand = {band: dict(flows) for band, flows in self._departed.items()}
        for _, _, added in self._siblings.values():
            _add(out, added)
        return out

    def _fold(self, added: ByBand) -> None:
        _add(self._departed, added)
        for band in added:
            _keep_largest(self._departed, band)


def _add(account: ByBand, added: ByBand) -> None:
    """`added` summed into `account`, band by band and flow by flow."""
    for band, flows in added.items():
        into = account.setdefault(band, {})
        for flow, value in flows.items():
            into[flow] = into.get(flow, 0.0) + value


def _keep_largest(accounts: ByBand, band: int) -> None:
    """A band's account past twice MAX_FLOWS flows (flows forgotten and new ones, over hours) keeps
    its MAX_FLOWS largest: those left out count as served nothing, a few more turns each."""
    flows = accounts[band]
    if len(flows) > 2 * MAX_FLOWS:
        accounts[band] = dict(sorted(flows.items(), key=lambda item: item[1], reverse=True)[:MAX_FLOWS])
