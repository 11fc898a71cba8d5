"""vLLM's prefill/decode hand-off (its `kv_transfer_params` protocol), as request bodies.

A disaggregated request runs in two legs. The prefill leg asks the prefill server to compute the
prompt and keep its KV blocks for a remote decode (`do_remote_decode`), generating one token; its
response names where the blocks are (`remote_engine_id`, `remote_block_ids`, `remote_host`,
`remote_port`, `remote_request_id`). The decode leg is the client's own request with those
parameters added: its server pulls the blocks over NIXL instead of recomputing them.

Whoever sets `kv_transfer_params` decides which address a decode server pulls from, so a client's
own are never passed on (`strip`), and a prefill response's are passed on only in the shape vLLM
gives them and only naming the prefill server they came from (`decode_parameters`). Pure: bodies
in, bodies out; the adapter does the I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

FIELD = "kv_transfer_params"
ASK_REMOTE_DECODE: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
_OUTPUT_LIMITS = ("max_tokens", "max_completion_tokens")
_STREAMING = ("stream", "stream_options")
MAX_BLOCK_IDS = 1 << 20  # a decode server is never asked to pull more blocks than this
MAX_FIELDS = 32  # of a prefill response's parameters
MAX_TEXT = 256  # characters of a text parameter


def carries_parameters(body: Mapping[str, Any]) -> bool:
    """The body sets `kv_transfer_params` itself."""
    return FIELD in body


def strip(body: Mapping[str, Any]) -> bytes:
    """The body without the client's `kv_transfer_params`."""
    return orjson.dumps({k: v for k, v in body.items() if k != FIELD})


def prefill_body(body: Mapping[str, Any]) -> bytes:
    """The prefill leg: the same prompt, one token, not streamed, blocks kept for a remote decode."""
    out = {k: v for k, v in body.items() if k != FIELD and k not in _STREAMING and k not in _OUTPUT_LIMITS}
    out.pop("min_tokens", None)  # (vLLM refuses a min_tokens above max_tokens: the leg would fail)
    for name in _OUTPUT_LIMITS:
        if name in body or name == "max_tokens":
            out[name] = 1
    out[FIELD] = ASK_REMOTE_DECODE
    return orjson.dumps(out)


def decode_body(body: Mapping[str, Any], parameters: Mapping[str, Any]) -> bytes:
    """The decode leg: the client's request with the prefill's parameters (`decode_parameters`)."""
    out = {k: v for k, v in body.items() if k != FIELD}
    out[FIELD] = dict(parameters)
    return orjson.dumps(out)


def decode_parameters(response: Any, prefill_host: str) -> dict[str, Any] | None:
    """From a prefill leg's response body (parsed), the parameters its decode leg carries; None
    when they are missing, not in vLLM's shape, or name another host than the prefill server's
    (`prefill_host`: its IP, without brackets). vLLM adds fields as it grows (sizes, expiry, a
    transfer mode): scalars pass on as given, at most `MAX_FIELDS`, short; the block ids only as a
    bounded list per KV cache group."""
    if not isinstance(response, Mapping):
        return None
    given = response.get(FIELD)
    if not isinstance(given, Mapping) or given.get("do_remote_prefill") is not True or len(given) > MAX_FIELDS:
        return None
    engine, host, port = given.get("remote_engine_id"), given.get("remote_host"), given.get("remote_port")
    if not (isinstance(engine, str) and engine and isinstance(host, str) and host.strip("[]") == prefill_host):
        return None
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        return None
    blocks = given.get("remote_block_ids")
    if not isinstance(blocks, list) or not _block_ids(blocks):
        return None
    out: dict[str, Any] = {}
    for key, value in given.items():
        if key == "remote_block_ids":
            out[key] = blocks
        elif not isinstance(key, str) or not _scalar(value):
            return None
        else:
            out[key] = value
    out["do_remote_decode"] = False
    return out


def _scalar(value: Any) -> bool:
    if isinstance(value, str):
        return len(value) <= MAX_TEXT
    return value is None or isinstance(value, (bool, int, float))


def _block_ids(groups: list[Any]) -> bool:
    """A list per KV cache group of non-negative block ids (vLLM's shape), bounded."""
    count = 0
    for group in groups:
        if not isinstance(group, list):
            return False
        for block in group:
            if isinstance(block, bool) or not isinstance(block, int) or block < 0:
                return False
        count += len(group)
    return 0 < count <= MAX_BLOCK_IDS
