"""Cache pressure: how much of their last prompt conversations find evicted when they come back.

Balancing load by moving a conversation pays when the caches can hold what is moved. When they
cannot (many live conversations, little KV cache), a backend evicts a conversation's context
before its next turn, every move copies a context (and the shared system prompt above it) into a
second cache, and each copy evicts someone else's context sooner: load balancing then multiplies
the work it means to spread. The share of a returning conversation's last prompt that kvroute's
picture no longer shows on its backend measures this directly, whatever the workload appends per
turn; the balance gates that let a conversation or a prompt head leave its backend widen with it,
by (1 - lost)^-POWER: nothing lost, the configured gates; a quarter lost, about four times as wide.
The widening has to hold while it works (once gates widen, less is lost), hence a steep power: a
gentler one settles where the gates stay narrow enough to keep copying contexts
(docs/benchmarks.md, "Cache pressure").
"""

from __future__ import annotations

WEIGHT = 0.05  # of each returning conversation in the running mean: about the last 20 count
POWER = 5.0  # 5 % lost: 1.3 times the gates; 25 %: 4.2; 42 %: 15
MAX_GATE_FACTOR = 16.0  # the gates never widen past this: a backend far busier than the rest still sheds
# A head's home keeps it among equal holders only while returning conversations lose less than
# this share: where caches hold what they need, a second copy only wastes room; where they are
# starved, the copy spreads the head's new conversations over two caches, which pays more
# (docs/benchmarks.md, "The home among several holders").
HOME_TIES_MAX_LOST = 0.2


class CachePressure:
    """Running mean of the share of a returning conversation's previous prompt found evicted."""

    __slots__ = ("lost",)

    def __init__(self) -> None:
        self.lost = 0.0

    def returned(self, previous_blocks: int, matched_blocks: int) -> None:
        """A conversation came back to the backend that held `previous_blocks` of its last prompt,
        which the picture now shows `matched_blocks` of."""
        if previous_blocks <= 0:
            return
        lost = max(0.0, 1.0 - matched_blocks / previous_blocks)
        self.lost += WEIGHT * (lost - self.lost)

    def home_ties(self) -> bool:
        """Whether a head's home still wins among backends holding as much of the prompt."""
        return self.lost < HOME_TIES_MAX_LOST

    def gate_factor(self) -> float:
        """How much wider than configured the balance gates are now."""
        return min(MAX_GATE_FACTOR, (1.0 - self.lost) ** -POWER) if self.lost < 1.0 else MAX_GATE_FACTOR
