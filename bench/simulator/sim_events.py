"""KV cache events from a simulated backend, published as vLLM publishes them.

vLLM started with `--kv-events-config` binds a ZMQ PUB socket and sends, once per engine step
that queued any (after the step, vllm/v1/core/sched/scheduler.py `update_from_output`), three
frames: the topic, an 8-byte big-endian sequence number and a msgpack `[timestamp, events,
data_parallel_rank]` (rank 0 without data parallelism), each event a map with a `type`
(`BlockStored`, `BlockRemoved`, `AllBlocksCleared`); `GET /kv_event_sources` says where. The
simulator does the same so a router that follows engine events (kvroute's prefill progress)
behaves on it as on vLLM.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

import msgpack
import zmq

TOPIC = b"kv"
_HASH_MASK = (1 << 64) - 1  # vLLM sends a block hash's low 64 bits


class EventPublisher:
    """One backend's PUB socket on `host`, on a free port."""

    def __init__(self, host: str) -> None:
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self.port = self._socket.bind_to_random_port(f"tcp://{host}")
        self._sequence = 0
        self._clear_pending = False
        self._batch: list[dict[str, Any]] = []  # the step's events, until it ends

    def sources(self) -> dict[str, Any]:
        """The `/kv_event_sources` answer: one publisher, bound on every address like vLLM's `tcp://*`."""
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{self.port}"}
        return {"0": {**config, "topic": TOPIC.decode()}}

    def stored(
        self,
        hashes: Sequence[int],
        parent: int | None,
        tokens: Sequence[int],
        block_size: int,
        first: int = 0,
        adapter: str | None = None,
        salt: str | None = None,
    ) -> None:
        """Blocks the engine computed and cached, in order (`tokens`: theirs, block_size each; `first`:
        the first one's index in the prompt), with the keys vLLM publishes beside their tokens: per
        block the LoRA name, and the cache_salt on block 0 (vllm/v1/core/kv_cache_utils.py
        `to_event_extra_keys`). Media keys are not published: the simulator's are not vLLM's
        multimodal hashes. `lora_id` stays None: vLLM's is a number it assigns at load."""
        if hashes:
            event = {"type": "BlockStored", "block_hashes": [h & _HASH_MASK for h in hashes]}
            event.update(parent_block_hash=None if parent is None else parent & _HASH_MASK, token_ids=list(tokens))
            event.update(block_size=block_size, lora_id=None, medium="GPU", lora_name=adapter)
            extra = [
                [*([adapter] if adapter else []), *([salt] if salt and i == 0 else [])] or None
                for i in range(first, first + len(hashes))
            ]
            event.update(extra_keys=extra if any(extra) else None)
            self._batch.append(event)

    def removed(self, hashes: Sequence[int]) -> None:
        """Blocks the engine evicted."""
        if hashes:
            self._batch.append(
                {"type": "BlockRemoved", "block_hashes": [h & _HASH_MASK for h in hashes], "medium": "GPU"}
            )

    def cleared(self) -> None:
        """The cache was reset: vLLM queues the event and publishes it with its next step (`step`),
        so an idle engine reports it only once the next request is scheduled."""
        self._clear_pending = True

    def step(self) -> None:
        """The engine schedules a step: what it queued since the last one comes first in its batch."""
        if self._clear_pending:
            self._clear_pending = False
            self._batch.append({"type": "AllBlocksCleared"})

    def publish(self) -> None:
        """The step ran: its events go out as one batch (none: nothing is sent). A PUB socket never
        blocks (a slow subscriber loses messages, as on vLLM)."""
        if not self._batch:
            return
        frames = [TOPIC, self._sequence.to_bytes(8, "big"), msgpack.packb([time.time(), self._batch, 0])]
        self._batch = []
        self._sequence += 1
        with contextlib.suppress(zmq.Again):
            self._socket.send_multipart(frames, flags=zmq.NOBLOCK)

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()
