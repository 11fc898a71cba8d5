"""Body -> PromptRequest: the one place a request body is parsed for routing."""

from __future__ import annotations

import gc
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from extproc.core import cbr
from extproc.core.errors import InvalidRequest
from extproc.core.sessions import derive_session_key
from extproc.core.settings import SESSION_HEADERS

_EMPTY: Mapping[str, str] = {}
# Arrays and objects a client's JSON may hold. A prompt has a handful; each decodes into some 100
# bytes, and the collector walks the new ones again and again as they are made: 27 MiB of nested
# empty arrays decoded into 1.1 GiB, and 8.6 MiB took 4.4 s of the loop (0.4 s without the collector).
MAX_JSON_CONTAINERS = 1 << 20
_DECODING = threading.Lock()  # one decode at a time switches the collector off and on (worker threads too)
_BRACKETS = b"[{"


def load_json(raw: bytes | str) -> Any:
    """A client's JSON, decoded at a bounded cost, or InvalidRequest. A body of more than
    MAX_JSON_CONTAINERS arrays and objects is refused before it is decoded, by counting its
    brackets (those inside strings too: an overestimate); only one of more than twice that many
    bytes can hold that many. The collector waits until the decode is done."""
    if not isinstance(raw, bytes | str):
        raise InvalidRequest(f"body must be bytes or text, not {type(raw).__name__}")
    if len(raw) > 2 * MAX_JSON_CONTAINERS:
        data = raw.encode() if isinstance(raw, str) else raw
        if len(data) - len(data.translate(None, _BRACKETS)) > MAX_JSON_CONTAINERS:
            raise InvalidRequest(f"body holds more than {MAX_JSON_CONTAINERS} arrays and objects")
    with _DECODING:
        collecting = gc.isenabled()
        gc.disable()
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise InvalidRequest(f"body is not valid JSON: {exc}") from None
        finally:
            if collecting:
                gc.enable()


class PromptTokenizer(Protocol):
    """Turns a request body into the token ids the engine will see (precise mode). An adapter
    implements it with the model's own tokenizer and chat template."""

    def tokens(self, body: Mapping[str, Any]) -> Sequence[int] | None:
        """The prompt's token ids, or None for a body it cannot tokenize exactly as the engine does."""
        ...


@dataclass(slots=True)
class PromptRequest:
    """What routing needs from one request; `chain` is filled in once by the router."""

    model: str
    cbr: bytes
    followup: bool
    session_key: str | None
    chain: list[int] | None = None
    truncated: bool = False  # the encoding budget cut the prompt short (cbr.MAX_RECORDS, MAX_BYTES)
    tokens: Sequence[int] | None = None  # precise mode: the prompt as the engine tokenizes it
    cache_salt: str | None = None  # vLLM keys the first block by it: prompts with another salt never share
    cbr_bytes: int = 0  # the CBR's length, kept when the router drops the CBR itself
    stream: bool = False  # the response is streamed: it starts before the prefill is done
    output_tokens: int | None = None  # the most it may generate (max_completion_tokens, max_tokens)
    # Its TTFT objective and whether it may be refused (a priority below 0), from its headers as
    # flow control classifies them (objectives.py); set by the adapter that knows the objectives.
    ttft_objective_s: float | None = None
    sheddable: bool = False
    transfer_params: bool = False  # the client set kv_transfer_params: the adapter strips them (handoff.py)
    keys: int = 0  # which of the router's keyings its chain was hashed in (Router.begin)


def _output_limit(body: Mapping[str, Any]) -> int | None:
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None


def parse_request(
    body: bytes | str | Mapping[str, Any],
    headers: Mapping[str, str] = _EMPTY,
    session_headers: tuple[str, ...] = SESSION_HEADERS,
    tenant_header: str = "",
    tokenizer: PromptTokenizer | None = None,
) -> PromptRequest:
    """Parse a raw or decoded chat/completions body.

    Raises InvalidRequest, and nothing else, for any body that cannot be routed by prefix.
    """
    parsed: Any = body if isinstance(body, Mapping) else load_json(body)
    if not isinstance(parsed, Mapping):
        raise InvalidRequest("body must be a JSON object")
    model = parsed.get("model", "")
    if not isinstance(model, str):
        raise InvalidRequest("'model' must be a string")
    encoded, followup, truncated = cbr.encode(parsed)
    session = derive_session_key(headers, parsed, session_headers, tenant_header)
    salt = parsed.get("cache_salt")
    request = PromptRequest(model, encoded, followup, session, truncated=truncated)
    request.cache_salt = salt if isinstance(salt, str) and salt else None
    request.stream = parsed.get("stream") is True
    request.output_tokens = _output_limit(parsed)
    request.transfer_params = "kv_transfer_params" in parsed
    if tokenizer is not None:
        request.tokens = tokenizer.tokens(parsed)
    return request
