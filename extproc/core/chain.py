"""Block chains: keyed SipHash over fixed-size blocks of the CBR (approximate mode) or of token
ids (precise mode).

CBR hash i is SipHash-2-4 of the whole prefix through block i, taken from one streaming hasher
(digest at each block boundary), so it names the whole prefix, not just one block. That costs
one pass over the bytes; a Merkle chain re-hashing the previous digest per block measured
slower (a new hash object per block). The key is secret configuration, so clients cannot
craft bodies that collide with someone else's chain. Token keys chain through the parent key
instead (TokenHasher), because engine events name each block by its parent.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import orjson
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


ROOT_KEY = 0  # the "parent" of a prompt's first block

_UINT32 = "I"


def extra_digest(values: Sequence[object] | None) -> bytes:
    """Canonical bytes of one block's extra keys (LoRA name, cache_salt), as both the request side
    and the event side see them; empty for a block that has none. Raises TypeError for values
    JSON cannot hold."""
    return orjson.dumps(list(values)) if values else b""


class TokenHasher:
    """Precise mode's keys: block i's key is keyed SipHash of (key of block i-1, block i's extra
    keys, its token ids). Computed the same way from a tokenized request and from the token ids a
    `BlockStored` event carries, so the engine's own hash never has to be reproduced."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        self._key = key

    def block(self, parent: int, tokens: Sequence[int], extra: bytes) -> int:
        """One block's key. Raises OverflowError for token ids outside 0..2**32-1."""
        return self._block(parent, extra, array(_UINT32, tokens))

    def _block(self, parent: int, extra: bytes, data: bytes | memoryview | array[int]) -> int:
        hasher = siphash24(parent.to_bytes(8, "little"), key=self._key)
        hasher.update(len(extra).to_bytes(4, "little"))
        hasher.update(extra)
        hasher.update(data)
        digest: int = hasher.intdigest()
        return digest & HASH_MASK

    def chain(
        self, tokens: Sequence[int], block_size: int, extras: Sequence[bytes] = (), parent: int = ROOT_KEY
    ) -> list[int]:
        """Keys of every full block of `tokens`; `extras[i]` is block i's extra digest (b"" past its end).
        Raises OverflowError for token ids outside 0..2**32-1."""
        packed = tokens if isinstance(tokens, array) and tokens.typecode == _UINT32 else array(_UINT32, tokens)
        view = memoryview(packed).cast("B")
        step = block_size * packed.itemsize
        out: list[int] = []
        for index, start in enumerate(range(0, len(view) - step + 1, step)):
            extra = extras[index] if index < len(extras) else b""
            parent = self._block(parent, extra, view[start : start + step])
            out.append(parent)
        return out
