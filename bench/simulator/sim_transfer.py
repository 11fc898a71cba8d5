"""vLLM's prefill/decode hand-off (`kv_transfer_params`, as its NixlConnector runs it), simulated.

A prefill server asked for a remote decode (`do_remote_decode`) computes the prompt and answers
with parameters naming itself and the request, keeping the prompt's block hashes for one pull. A
decode server given `do_remote_prefill` parameters pulls them from the server they name
(`GET /kv_transfer/{request id}`, standing in for NIXL's side channel and read), waits a transfer
time per block, and starts the request with the leading blocks that match its own prompt as
transferred rather than computed. A pull that fails (no such server or request: what a client's
forged parameters get) computes the prompt itself, as vLLM with `kv_load_failure_policy: recompute`
does. Only loopback addresses are pulled from: the simulator talks to nothing else.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp

log = logging.getLogger(__name__)

KEPT_S = 120.0  # a prefill's blocks wait this long for their pull (vLLM: VLLM_NIXL_ABORT_REQUEST_TIMEOUT)
KEPT_MAX = 4096  # prefills awaiting a pull, per server
PULL_TIMEOUT_S = 5.0  # vLLM's NIXL handshake limit


class Handoffs:
    """One simulated server's side of hand-offs: what it prefilled for others, and its pulls."""

    def __init__(self, address: str, transfer_block_s: float) -> None:
        self._host, _, port = address.rpartition(":")
        self._port = int(port)
        self._address = address
        self._transfer_block_s = transfer_block_s
        self._kept: OrderedDict[str, tuple[list[int], float]] = OrderedDict()
        self._session: aiohttp.ClientSession | None = None

    def keep(self, hashes: Sequence[int], cached_tokens: int) -> dict[str, Any]:
        """A prefill for a remote decode is done: keep its blocks and say where they are, and how
        many of its prompt tokens this server found cached (vLLM 0.32's decode reports those)."""
        request_id = uuid.uuid4().hex
        self._kept[request_id] = (list(hashes), time.monotonic() + KEPT_S)
        while len(self._kept) > KEPT_MAX:
            self._kept.popitem(last=False)
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self._address,
            "remote_block_ids": [list(range(len(hashes)))],
            "remote_host": self._host.strip("[]"),
            "remote_port": self._port,
            "remote_request_id": request_id,
            "tp_size": 1,
            "remote_prefill_cached_tokens": cached_tokens,
        }

    def take(self, request_id: str) -> list[int] | None:
        """A decode server's pull: the kept blocks, once, if not expired."""
        kept = self._kept.pop(request_id, None)
        if kept is None or kept[1] < time.monotonic():
            return None
        return kept[0]

    async def pull(self, parameters: Mapping[str, Any], hashes: Sequence[int]) -> int:
        """The leading blocks of `hashes` a decode gets from the prefill `parameters` name, after
        their transfer time; 0 when the pull fails (the prompt is then computed here)."""
        host, port, request_id = (parameters.get(k) for k in ("remote_host", "remote_port", "remote_request_id"))
        if not (isinstance(host, str) and isinstance(port, int) and isinstance(request_id, str) and _loopback(host)):
            log.warning("kv_transfer_params name no loopback prefill server: computing the prompt")
            return 0
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=PULL_TIMEOUT_S))
        url = f"http://{f'[{host}]' if ':' in host else host}:{port}/kv_transfer/{request_id}"
        try:
            async with self._session.get(url) as response:
                kept = (await response.json()).get("blocks") if response.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError) as error:
            log.warning("pulling KV blocks from %s:%s failed (%s): computing the prompt", host, port, error)
            return 0
        if not isinstance(kept, list):
            log.warning("%s:%s holds no blocks for %s: computing the prompt", host, port, request_id)
            return 0
        blocks = 0
        for mine, theirs in zip(hashes, kept, strict=False):
            if mine != theirs:
                break
            blocks += 1
        await asyncio.sleep(blocks * self._transfer_block_s)
        return blocks

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
