"""The distinct blocks the prompts of requests in flight on one backend take in its KV cache.

An engine pins a block once however many running requests share it (a system prompt and tools
that many conversations start with), so the footprint of the prompts in flight is the number of
distinct blocks among their chains, not the sum of their lengths. A chain's hash i names the
whole prefix through block i (chain.py), so the chains are the paths of a trie and, kept in
lexicographic order, their distinct blocks are the sum of their lengths less the common prefix of
each adjacent pair. Adding or removing a chain then costs a bisection among the chains in flight
(list comparisons, in C) and a few common-prefix bisections, not a step per block: a 2 MB prompt
has 3,853 blocks of 512 bytes.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right

Chain = list[int]  # a request's block hashes (chain.py)


def common_prefix(first: Chain, second: Chain) -> int:
    """Blocks the two chains share from the start. Hashes name their whole prefix, so equal blocks
    at a position mean equal blocks before it: the first difference is found by bisection."""
    low, high = 0, min(len(first), len(second))
    while low < high:
        middle = (low + high) // 2
        if first[middle] == second[middle]:
            low = middle + 1
        else:
            high = middle
    return low


class InFlightBlocks:
    """The chains of one backend's requests in flight, in lexicographic order, and how many
    distinct blocks they hold together."""

    __slots__ = ("_chains", "blocks")

    def __init__(self) -> None:
        self._chains: list[Chain] = []
        self.blocks = 0

    def __len__(self) -> int:
        return len(self._chains)

    def add(self, chain: Chain) -> None:
        if not chain:
            return
        chains = self._chains
        at = bisect_right(chains, chain)
        self.blocks += self._novel(chain, at)
        chains.insert(at, chain)

    def remove(self, chain: Chain) -> None:
        """Take out one chain equal to this one (equal chains are interchangeable: the chains form
        a multiset; a reservation removes its own once). A chain not held changes nothing."""
        if not chain:
            return
        chains = self._chains
        at = bisect_left(chains, chain)
        if at == len(chains) or chains[at] != chain:
            return
        del chains[at]
        self.blocks -= self._novel(chain, at)

    def shared(self, chain: Chain) -> int:
        """Leading blocks of `chain` a chain in flight already holds."""
        chains = self._chains
        at = bisect_right(chains, chain)
        before = common_prefix(chains[at - 1], chain) if at else 0
        after = common_prefix(chain, chains[at]) if at < len(chains) else 0
        return max(before, after)

    def _novel(self, chain: Chain, at: int) -> int:
        """Blocks `chain` adds to the others, placed between chains[at - 1] and chains[at]."""
        chains = self._chains
        previous = chains[at - 1] if at else None
        following = chains[at] if at < len(chains) else None
        novel = len(chain)
        if previous is not None:
            novel -= common_prefix(previous, chain)
        if following is not None:
            novel -= common_prefix(chain, following)
        if previous is not None and following is not None:
            novel += common_prefix(previous, following)
        return novel
