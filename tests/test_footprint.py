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


def test_a_chain_is_taken_out_by_identity_and_only_once():
    prompts = InFlightBlocks()
    first, twin = chain_of((1, 2, 3)), chain_of((1, 2, 3))
    prompts.add(first)
    prompts.add(twin)
    assert prompts.blocks == 3 and len(prompts) == 2
    prompts.remove(first)
    prompts.remove(first)  # a second release finds nothing of it
    assert prompts.blocks == 3 and len(prompts) == 1
    prompts.remove(twin)
    assert prompts.blocks == 0 and len(prompts) == 0


def test_the_common_prefix_of_two_chains():
    assert common_prefix(chain_of((1, 2, 3)), chain_of((1, 2, 4, 5))) == 2
    assert common_prefix(chain_of((1,)), chain_of((2,))) == 0
    assert common_prefix([], chain_of((1,))) == 0
