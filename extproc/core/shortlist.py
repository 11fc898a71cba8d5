"""Which candidates a decision weighs in a large fleet.

Every candidate costs a decision its load read, its cost record, its index walk, its turnover rate
and its share of the sort (`kvroute-dev bench core --backends`): linear in the fleet. Above
`shortlist_above` candidates, only these are weighed, with the full cost and rules: the backends
holding the prompt's first block (only they can hold any of its prefix, since block hashes chain
from the first; the index keeps them by first block), the session's and the prompt head's home
backend, and a window of `SHORTLIST_WINDOW` consecutive candidates whose start moves one further
at every decision ("the power of d choices", d = 16). On an idle fleet new prompts so go round the
whole fleet, as the full scan's rotation of ties sends them; under load the window's best stands
in for the fleet's. What that leaves out: a backend holding none of the prompt, outside the
window, that the full cost would have picked; what that does to hit rates is measured in
docs/benchmarks.md. At or below `shortlist_above` every candidate is weighed, as before, and so is
every candidate of a request naming a LoRA adapter (which backends have it loaded matters beyond
these).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

SHORTLIST_WINDOW = 16  # consecutive candidates weighed beside the prefix's holders


def shortlist(
    candidates: Sequence[str], kept: Collection[str], turn: int, positions: Mapping[str, int] | None = None
) -> list[str]:
    """The candidates worth weighing, in the pool's order: those in `kept` (the session's, the
    home, the holders of the prompt's first block) and the window starting at `turn`. With each
    candidate's `positions` (pipeline.py keeps them), without a pass over the rest."""
    count = len(candidates)
    start = turn % count
    window = set(candidates[start : start + SHORTLIST_WINDOW])
    if start + SHORTLIST_WINDOW > count:
        window.update(candidates[: start + SHORTLIST_WINDOW - count])
    if positions is None:
        return [c for c in candidates if c in window or c in kept]
    window.update(c for c in kept if c in positions)
    return sorted(window, key=positions.__getitem__)
