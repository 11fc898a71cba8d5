"""Block chain: hash i names the whole prefix through block i, under a secret key."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from siphash24 import siphash24

from extproc.core.chain import HASH_MASK, BlockHasher

KEY = b"0123456789abcdef"


@given(st.binary(max_size=2000), st.sampled_from([8, 64, 512]))
def test_each_hash_is_siphash_of_the_whole_prefix(data, size):
    chain = BlockHasher(size, KEY).chain(data)
    assert len(chain) == len(data) // size
    for i, value in enumerate(chain):
        assert value == siphash24(data[: (i + 1) * size], key=KEY).intdigest() & HASH_MASK


@given(st.binary(min_size=64, max_size=1000), st.binary(min_size=1, max_size=500))
def test_shared_prefix_shares_leading_hashes_only(common, tail):
    hasher = BlockHasher(32, KEY)
    a = hasher.chain(common + tail)
    b = hasher.chain(common + bytes(x ^ 0xFF for x in tail))
    shared = len(common) // 32
    assert a[:shared] == b[:shared]
    assert a[shared:] == [] or a[shared] != b[shared] or len(tail) < 32 - len(common) % 32


def test_same_block_at_another_position_hashes_differently():
    chain = BlockHasher(8, KEY).chain(b"abcdefgh" * 4)
    assert len(set(chain)) == 4


def test_key_changes_every_hash():
    data = b"x" * 100
    assert not set(BlockHasher(8, KEY).chain(data)) & set(BlockHasher(8, b"another-key-16by").chain(data))
