"""Block chain: keyed SipHash over fixed-size blocks of the CBR.

Hash i is SipHash-2-4 of the whole prefix through block i, taken from one streaming hasher
(digest at each block boundary), so it names the whole prefix, not just one block. That costs
one pass over the bytes; a Merkle chain re-hashing the previous digest per block measured
slower (a new hash object per block). The key is secret configuration, so clients cannot
craft bodies that collide with someone else's chain.
"""

from __future__ import annotations

from siphash24 import siphash24

# 60 bits keep each hash a two-digit CPython int (32 bytes instead of 40); at a million
# entries the chance of any collision is about 1e-6.
HASH_MASK = (1 << 60) - 1


class BlockHasher:
    """Turns a CBR into its chain of block hashes; the partial tail block is dropped."""

    __slots__ = ("_key", "block_size")

    def __init__(self, block_size: int, key: bytes) -> None:
        self.block_size = block_size
        self._key = key

    def chain(self, cbr: bytes) -> list[int]:
        """Hash of every full block's prefix, in order."""
        size = self.block_size
        hasher = siphash24(key=self._key)
        view = memoryview(cbr)
        out: list[int] = []
        for start in range(0, len(cbr) - size + 1, size):
            hasher.update(view[start : start + size])
            out.append(hasher.intdigest() & HASH_MASK)
        return out
