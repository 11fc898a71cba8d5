"""vLLM KV cache event messages -> core EngineEvents.

A message is three ZMQ frames: topic, an 8-byte big-endian sequence number, and a msgpack
`EventBatch` `[timestamp, events, data_parallel_rank]`. vLLM 0.32 encodes each event as a map
with a `type` key; earlier versions as a positional array whose first item is the type. Both are
accepted; a message that is not such a batch is refused with an EventError (the caller counts and
logs it), never a crash. Inside a batch, an event of a type this version does not know, one that
is malformed, and one of another tier than the GPU's are skipped one by one and counted: vLLM's
offloading connector adds its CPU tier's events to the same batch (a store with no tokens and
block size 0, removals under the GPU blocks' own hashes), and refusing the whole batch for one
lost the others and then the backend's picture.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from extproc.core.engine import AllBlocksCleared, BlockRemoved, BlockStored, EngineEvent
from extproc.vllm.metrics import MAX_BLOCK_SIZE

# Field order of the positional (array) form, after the type tag, as vLLM's msgspec structs declare it.
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name")
_STORED_EXTRA_AT = 8  # extra_keys follows lora_name
_REMOVED_FIELDS = ("block_hashes", "medium")
GPU_TIERS = (None, "GPU")  # an event's `medium`: what the engine serves a prefix from (None: not said)
# A batch larger than this is refused unread. An engine step stores at most its batched tokens
# (8,192 by default; a few hundred KB of token ids and hashes), and MessagePack can expand some
# 70x once decoded (8 MB of empty arrays took 551 MB), so the cap bounds what one message costs:
# at 4 MiB one took 53 ms to decode on the event loop, at 1 MiB about a quarter of that.
MAX_BATCH_BYTES = 1 << 20


class EventError(ValueError):
    """A message that is not a well-formed vLLM event batch."""


class _OtherTier(Exception):
    """An event of a tier other than the GPU's: skipped."""


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One decoded message."""

    sequence: int
    events: list[EngineEvent]
    unknown: int = 0  # events of a type this version does not know, skipped
    malformed: int = 0  # events that are not what their type says, skipped
    other_tier: int = 0  # events of a tier other than the GPU's (an offloading connector's), skipped


def _hash(value: Any) -> int:
    """An engine block hash as an int: vLLM sends the low 64 bits as an int, or bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, bytes) and value:
        return int.from_bytes(value, "big")
    raise EventError(f"bad block hash {value!r:.40}")


def _hashes(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise EventError("block_hashes is not a list")
    return tuple(_hash(v) for v in value)


def _extra(value: Any) -> tuple[object, ...] | None:
    """One block's extra keys (LoRA name, multimodal pairs, cache_salt), kept as sent."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise EventError("extra_keys entry is not a list")
    return tuple(value)


def _stored(fields: dict[str, Any]) -> BlockStored:
    tokens = fields.get("token_ids")
    size = fields.get("block_size")
    parent = fields.get("parent_block_hash")
    extras = fields.get("extra_keys") or ()
    if not isinstance(tokens, list) or not isinstance(size, int) or not isinstance(extras, list | tuple):
        raise EventError("BlockStored without token_ids or block_size")
    if isinstance(size, bool) or not 0 < size <= MAX_BLOCK_SIZE:
        raise EventError(f"BlockStored with a block_size no engine has: {size}")
    lora = fields.get("lora_name")
    hashes = _hashes(fields.get("block_hashes"))
    per_block = [_extra(e) for e in extras]
    if isinstance(lora, str) and lora and not per_block:  # older engines: the LoRA name alone
        per_block = [(lora,)] * len(hashes)
    parent_hash = None if parent is None else _hash(parent)
    adapter = lora if isinstance(lora, str) and lora else None
    return BlockStored(hashes, parent_hash, tuple(tokens), size, tuple(per_block), adapter)


def _event(raw: Any) -> EngineEvent | None:
    """One event, or None for a type this version does not know."""
    if isinstance(raw, dict):
        kind = raw.get("type")
        fields = raw
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        kind = raw[0]
        names = _STORED_FIELDS if kind == "BlockStored" else _REMOVED_FIELDS if kind == "BlockRemoved" else ()
        fields = dict(zip(names, raw[1:], strict=False))
        if kind == "BlockStored" and len(raw) > _STORED_EXTRA_AT:
            fields["extra_keys"] = raw[_STORED_EXTRA_AT]
    else:
        raise EventError(f"event is neither a map nor a tagged array: {type(raw).__name__}")
    if kind in ("BlockStored", "BlockRemoved") and fields.get("medium") not in GPU_TIERS:
        raise _OtherTier
    if kind == "BlockStored":
        return _stored(fields)
    if kind == "BlockRemoved":
        return BlockRemoved(_hashes(fields.get("block_hashes")))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def decode(frames: Sequence[bytes]) -> EventBatch:
    """Decode one message's frames. Raises EventError."""
    if len(frames) != 3:
        raise EventError(f"expected 3 frames, got {len(frames)}")
    _topic, sequence, payload = frames
    if len(sequence) != 8:
        raise EventError(f"sequence frame of {len(sequence)} bytes")
    if len(payload) > MAX_BATCH_BYTES:
        raise EventError(f"batch of {len(payload)} bytes")
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False, max_ext_len=0)
    except Exception as exc:  # (a map as a map's key raises TypeError: any of it is the engine's fault)
        raise EventError(f"not msgpack: {type(exc).__name__}: {exc}") from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise EventError("batch is not [timestamp, events, ...]")
    events: list[EngineEvent] = []
    unknown = malformed = other_tier = 0
    for raw in batch[1]:
        try:
            event = _event(raw)
        except _OtherTier:
            other_tier += 1
            continue
        except (TypeError, AttributeError, ValueError, OverflowError, KeyError, IndexError):
            malformed += 1
            continue
        if event is None:
            unknown += 1
        else:
            events.append(event)
    return EventBatch(int.from_bytes(sequence, "big", signed=True), events, unknown, malformed, other_tier)
