"""The distinct blocks of the prompts in flight on a backend, against counting every block."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from extproc.core.footprint import InFlightBlocks, common_prefix


def chain_of(tokens: tuple[int, ...]) -> list[int]:
    """Block hashes that name their whole prefix, as chain.py's do."""
    return [hash(tokens[: i + 1]) for i in range(len(tokens))]


# Prompts over a small alphabet, so that many share heads of every length and equal ones occur.
_tokens = st.lists(st.integers(0, 2), max_size=8)
_steps = st.lists(st.tuples(st.sampled_from(["add", "remove", "query"]), _tokens), max_size=40)


@given(_steps)
def test_the_count_is_the_distinct_blocks_of_the_chains_in_flight_whatever_the_order(steps):
    prompts = InFlightBlocks()
    held: list[list[int]] = []
    for step, tokens in steps:
        chain = chain_of(tuple(tokens))
        if step == "add":
            prompts.add(chain)
            held.append(chain)
        elif step == "remove" and held:
            gone = held.pop(len(tokens) % len(held))
            prompts.remove(gone)
        blocks = {block for one in held for block in one}
        assert prompts.blocks == len(blocks)
        longest = 0
        while longest < len(chain) and chain[longest] in blocks:
            longest += 1
        assert prompts.shared(chain) == longest


def test_equal_chains_are_taken_out_one_at_a_time_and_a_chain_not_held_changes_nothing():
    """A thousand clients sending the same prompt: each removal is one bisection, not a search
    among the equal chains."""
    prompts = InFlightBlocks()
    same = [chain_of((1, 2, 3)) for _ in range(1000)]
    for chain in same:
        prompts.add(chain)
    assert prompts.blocks == 3 and len(prompts) == 1000
    prompts.remove(chain_of((1, 2, 4)))  # not held
    for chain in same[:-1]:
        prompts.remove(chain)
    assert prompts.blocks == 3 and len(prompts) == 1
    prompts.remove(same[-1])
    prompts.remove(same[-1])  # nothing equal left
    assert prompts.blocks == 0 and len(prompts) == 0


def test_the_common_prefix_of_two_chains():
    assert common_prefix(chain_of((1, 2, 3)), chain_of((1, 2, 4, 5))) == 2
    assert common_prefix(chain_of((1,)), chain_of((2,))) == 0
    assert common_prefix([], chain_of((1,))) == 0
