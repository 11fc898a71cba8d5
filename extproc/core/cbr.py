"""Canonical byte representation (CBR) of everything that shapes a prompt.

The bytes follow the order in which a backend renders the prompt: first the fields that shape
the prompt but are not messages, then each message in order. Each item is a tagged,
terminated record, so the encoding is unambiguous, a conversation's continuation encodes to a
byte extension of it, and two prompts sharing the start of a text share those bytes too.
The prompt-shaping header starts with a digest of itself: change the model or any tool and
even block 0 differs, so nothing is shared across them. Fields kvroute does not know enter the
header as a digest only, so a huge junk field cannot fill the index with blocks.

Encoding is bounded: past MAX_RECORDS records or MAX_BYTES bytes it stops, and the request is
routed on what was read (the leading blocks are what prefix routing needs).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Mapping
from typing import Any

import orjson

from extproc.core.errors import InvalidRequest

# Fields that only steer generation (or identify the caller); they never change the prompt.
GENERATION_ONLY: frozenset[str] = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "max_tokens",
        "max_completion_tokens",
        "n",
        "best_of",
        "stream",
        "stream_options",
        "seed",
        "stop",
        "stop_token_ids",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "length_penalty",
        "logprobs",
        "top_logprobs",
        "prompt_logprobs",
        "logit_bias",
        "allowed_token_ids",
        "bad_words",
        "ignore_eos",
        "min_tokens",
        "include_stop_str_in_output",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "use_beam_search",
        "echo",
        "user",
        "user_id",
        "session_id",
        "session_params",
        "request_id",
        "priority",
        "metadata",
        "store",
        "service_tier",
        "parallel_tool_calls",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "guided_decoding_backend",
        "guided_whitespace_pattern",
        "structured_outputs",
        "return_tokens_as_token_ids",
        "return_token_ids",
        "kv_transfer_params",
        "vllm_xargs",
        "logits_processors",
        "prediction",
    }
)
# Prompt-shaping fields in the order a chat template consumes them; any other field follows
# in sorted key order.
ORDERED_HEADER: tuple[str, ...] = (
    "model",
    "tools",
    "functions",
    "tool_choice",
    "chat_template",
    "chat_template_kwargs",
    "response_format",
)
_PROMPT_KEYS = frozenset({"messages", "prompt"})
MAX_RECORDS = 65_536  # messages and content parts: a body of millions of tiny parts stops here
MAX_BYTES = 8 * 1024 * 1024  # of canonical bytes: 16,384 blocks of 512
# A header's own fields past this many stop the encoding as the budget does: each is digested, and
# a million of them cost 1.8 s and 164 MiB before the budget was looked at.
MAX_FIELDS = 1024
_SKIP_IN_HEADER = GENERATION_ONLY | _PROMPT_KEYS | frozenset(ORDERED_HEADER)
_MESSAGE_KNOWN = frozenset({"role", "name", "content", "tool_calls", "tool_call_id"})
_ASSISTANT_ROLES = frozenset({"assistant", "tool", "function"})


class _Full(Exception):
    """The budget is spent: stop encoding."""


class _Out:
    """The records so far, counted against the budget (a list of its own, not a list subclass:
    joining a subclass copies it first)."""

    __slots__ = ("records", "size")

    def __init__(self) -> None:
        self.records: list[bytes] = []
        self.size = 0

    def append(self, record: bytes) -> None:
        if len(self.records) >= MAX_RECORDS or self.size + len(record) > MAX_BYTES:
            raise _Full
        self.size += len(record)
        self.records.append(record)

    def add(self, tag: bytes, payload: bytes) -> None:
        """Append `payload`'s record (`record`, written out: this runs for every text)."""
        self.append(tag + payload.replace(b"\0", b"\0\1") + b"\0\0")

    @staticmethod
    def record(tag: bytes, payload: bytes) -> bytes:
        """tag, payload with NUL escaped, NUL NUL. Unlike a length prefix, this keeps two texts
        that share a beginning sharing bytes (and blocks) up to where they differ."""
        return tag + payload.replace(b"\0", b"\0\1") + b"\0\0"


def _utf8(text: str, where: str) -> bytes:
    try:
        return text.encode()
    except UnicodeEncodeError as exc:
        raise InvalidRequest(f"{where}: text is not valid UTF-8 ({exc.reason})") from None


def _canonical_json(value: Any, where: str) -> bytes:
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except orjson.JSONEncodeError as exc:
        raise InvalidRequest(f"{where}: cannot be encoded ({exc})") from None


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _header(body: Mapping[str, Any], kind: bytes) -> bytes:
    parts = [kind]
    for key in ORDERED_HEADER:
        if key in body:
            parts.append(_Out.record(b"h", key.encode() + b"=" + _canonical_json(body[key], key)))
    if len(body) > MAX_FIELDS:
        raise _Full
    extensions = [k for k in body if k not in _SKIP_IN_HEADER]
    if not all(isinstance(k, str) for k in extensions):
        raise InvalidRequest("field names must be strings")
    for key in sorted(extensions):
        value = _digest(_canonical_json(body[key], key))
        parts.append(_Out.record(b"h", _digest(_utf8(key, "field name")) + b"=" + value))
    header = b"".join(parts)
    return _digest(header) + header


def _media(part: Mapping[str, Any], where: str) -> bytes:
    """A media part by URL, or by a digest of inline data (it can be megabytes)."""
    ptype = str(part["type"])
    inner = part.get(ptype)
    url = inner.get("url") if isinstance(inner, Mapping) else inner
    if isinstance(url, str):
        raw = _utf8(url, where)
        return ptype.encode() + b":" + (_digest(raw) if url.startswith("data:") else raw)
    return ptype.encode() + b":" + _digest(_canonical_json(inner, where))


def _content(content: Any, out: _Out) -> None:
    """A message's content; its text is encoded here, the caller reports UnicodeEncodeError. Its
    errors name the field within the message, as `_message_records`' do."""
    if content is None:
        return
    if isinstance(content, str):
        out.add(b"t", content.encode())
        return
    if not isinstance(content, list):
        raise InvalidRequest(": content must be a string, a list of parts or null")
    for i, part in enumerate(content):
        if isinstance(part, str):
            out.add(b"t", part.encode())
            continue
        if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
            raise InvalidRequest(f".content[{i}]: a content part must be an object with a string 'type'")
        ptype = part["type"]
        if ptype == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidRequest(f".content[{i}]: a text part needs a string 'text'")
            out.add(b"t", text.encode())
        elif ptype in ("image_url", "input_audio", "video_url", "audio_url", "file"):
            out.add(b"i", _media(part, f".content[{i}]"))
        else:
            out.add(b"p", _canonical_json(part, f".content[{i}]"))


def _message(message: Any, index: int, out: _Out) -> bool:
    """Append one message's records; True if it is an assistant or tool turn. Where an error is
    (`messages[i]`) is spelled out only when there is one: this runs for every message."""
    if not isinstance(message, Mapping):
        raise InvalidRequest(f"messages[{index}]: a message must be an object")
    try:
        return _message_records(message, out)
    except InvalidRequest as exc:
        raise InvalidRequest(f"messages[{index}]{exc}") from None
    except UnicodeEncodeError as exc:
        raise InvalidRequest(f"messages[{index}]: text is not valid UTF-8 ({exc.reason})") from None


def _message_records(message: Mapping[str, Any], out: _Out) -> bool:
    """`_message`'s records; its errors name the field within the message ("" for the message)."""
    role = message.get("role")
    if not isinstance(role, str):
        raise InvalidRequest(": 'role' must be a string")
    out.add(b"r", role.encode())
    name = message.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise InvalidRequest(": 'name' must be a string")
        out.add(b"n", name.encode())
    _content(message.get("content"), out)
    if message.get("tool_calls") is not None:
        out.add(b"c", _canonical_json(message["tool_calls"], ".tool_calls"))
    call_id = message.get("tool_call_id")
    if call_id is not None:
        if not isinstance(call_id, str):
            raise InvalidRequest(": 'tool_call_id' must be a string")
        out.add(b"d", call_id.encode())
    if not _MESSAGE_KNOWN.issuperset(message):
        extra = {k: v for k, v in message.items() if k not in _MESSAGE_KNOWN}
        out.add(b"x", _canonical_json(extra, ""))
    return role in _ASSISTANT_ROLES


def _prompt(prompt: Any, out: _Out) -> None:
    """A completions prompt: text, a list of texts, token ids, or lists of token ids."""
    items = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
    for i, item in enumerate(items):
        where = f"prompt[{i}]"
        if isinstance(item, str):
            out.add(b"t", _utf8(item, where))
        elif isinstance(item, list):
            if 4 * len(item) > MAX_BYTES - out.size:  # past the budget before any of it is read
                raise _Full
            out.add(b"k", _token_ids(item, where))
        else:
            raise InvalidRequest(f"{where}: a prompt is a string, token ids, or a list of either")


def _token_ids(ids: list[Any], where: str) -> bytes:
    """Token ids, 4 bytes each, little-endian, packed by array's own loop (a Python loop over
    16 million of them took 2.9 s and 948 MiB). Anything but integers in 0..2^32-1 is refused."""
    try:
        packed = array("I", ids)
    except (TypeError, OverflowError):
        raise InvalidRequest(f"{where}: token ids are integers from 0 to 2^32-1") from None
    if packed.itemsize != 4:  # (4 on every platform kvroute runs on)
        raise InvalidRequest(f"{where}: token ids cannot be packed here")
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def encode(body: Mapping[str, Any]) -> tuple[bytes, bool, bool]:
    """The CBR of a parsed chat or completions body, whether it has an assistant/tool turn, and
    whether the budget cut it short."""
    out = _Out()
    followup = False
    try:
        if "messages" in body:
            messages = body["messages"]
            if not isinstance(messages, list):
                raise InvalidRequest("'messages' must be a list")
            out.append(_header(body, b"chat\x00"))
            for i, message in enumerate(messages):
                followup = _message(message, i, out) or followup
        elif "prompt" in body:
            out.append(_header(body, b"completion\x00"))
            _prompt(body["prompt"], out)
        else:
            raise InvalidRequest("the body has neither 'messages' nor 'prompt'")
    except _Full:
        return b"".join(out.records), followup, True
    return b"".join(out.records), followup, False
