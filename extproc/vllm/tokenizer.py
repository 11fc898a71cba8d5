"""Precise mode's tokenizer: the served model's own tokenizer and chat template, loaded from a
directory (nothing is downloaded), rendering and tokenizing a request as vLLM does.

The cost is tokenization (about 1 us per token), so repeated work is made free: the rendered
prompt is cut at the tokenizer's special tokens, which it always splits out before anything else
runs, and each piece between them (in a chat: one message's text) is tokenized once and kept in
a bounded cache keyed by its digest. A conversation's next turn then tokenizes only its new
message. Whether pieces really tokenize independently is checked for the loaded tokenizer at load
time; where they do not, every prompt is tokenized whole.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson
from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

CACHE_TOKENS = 4_000_000  # tokens of message pieces kept, each piece counted PIECE_TOKENS more
# A cached piece's own entry (its key, its array, the LRU's links) is about 200 bytes, 50 tokens' worth:
# counted against the bound, so that short pieces cannot make it hold 54 bytes a token (205 MiB).
PIECE_TOKENS = 50
# A rendered prompt longer than this many times its request's JSON (plus RENDER_SLACK) is not
# tokenized: a template can grow a body quadratically (tools as JSON indented by depth: 9.8 KB
# rendered to 5.2 million characters, 1.7 s of tokenizing on the event loop for a body too small
# to be read off it). Chat templates add a bounded text per message and tool.
RENDER_GROWTH = 16
RENDER_SLACK = 64 * 1024
_CHECK_TEXTS = (
    "Hello, world! The quick brown fox.",
    "  leading spaces and\nnew lines\n\n",
    "def f(x):\n    return x * 2  # code",
    "ünïcödé and emoji 🙂, numbers 12345.",
)


class TokenizerError(Exception):
    """The directory does not hold a usable tokenizer and chat template."""


def _special_text(value: object) -> str | None:
    if isinstance(value, str):
        return value
    content = value.get("content") if isinstance(value, Mapping) else None
    return content if isinstance(content, str) else None


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    """The engine's template filter: Python's json (not orjson), so the text is byte for byte the same."""
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _chat_template(directory: Path, config: Mapping[str, Any]) -> str:
    standalone = directory / "chat_template.jinja"
    if standalone.exists():
        return standalone.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the engine uses "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    if not isinstance(template, str) or not template:
        raise TokenizerError(f"no chat_template in {directory}")
    return template


def _message(raw: Any) -> dict[str, Any] | None:
    """A chat message as the engine hands it to the template, or None if kvroute can't say how
    the engine would (multimodal content)."""
    if not isinstance(raw, Mapping) or not isinstance(raw.get("role"), str):
        return None
    message = dict(raw)
    content = message.get("content")
    if isinstance(content, list):  # text parts are joined with new lines; anything else is multimodal
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                return None
            texts.append(part["text"])
        message["content"] = "\n".join(texts)
    calls = message.get("tool_calls")
    if isinstance(calls, list):  # the engine parses JSON arguments into objects for templates
        parsed = []
        for call in calls:
            function = call.get("function") if isinstance(call, Mapping) else None
            if isinstance(function, Mapping) and isinstance(function.get("arguments"), str):
                with contextlib.suppress(orjson.JSONDecodeError):  # not JSON: the template gets the text
                    call = {**call, "function": {**function, "arguments": orjson.loads(function["arguments"])}}
            parsed.append(call)
        message["tool_calls"] = parsed
    return message


class ChatTokenizer:
    """PromptTokenizer for one model directory (tokenizer.json, tokenizer_config.json)."""

    def __init__(self, directory: str | Path, cache_tokens: int = CACHE_TOKENS) -> None:
        directory = Path(directory)
        try:
            self._tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
            config = orjson.loads((directory / "tokenizer_config.json").read_bytes())
            environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
            environment.filters["tojson"] = _tojson
            environment.globals["raise_exception"] = _raise
            environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = environment.from_string(_chat_template(directory, config))
        except Exception as exc:  # tokenizers raises plain Exception; files, JSON and Jinja their own
            raise TokenizerError(f"cannot load a tokenizer from {directory}: {type(exc).__name__}: {exc}") from None
        names = ("bos_token", "eos_token", "unk_token", "pad_token")
        self._specials = {name: text for name in names if (text := _special_text(config.get(name))) is not None}
        added = self._tokenizer.get_added_tokens_decoder()
        self._added = {token.content: token_id for token_id, token in added.items()}
        splittable = all(not (t.normalized or t.lstrip or t.rstrip or t.single_word) for t in added.values())
        pattern = "|".join(re.escape(text) for text in sorted(self._added, key=len, reverse=True))
        self._splitter = re.compile(f"({pattern})") if pattern and splittable else None
        self._post_processed = self._tokenizer.post_processor is not None
        self._cache: OrderedDict[bytes, array[int]] = OrderedDict()
        self._cached_tokens = 0
        self._cache_limit = cache_tokens
        self._lock = threading.Lock()
        self.pieces_tokenized = 0
        self.pieces_reused = 0
        self.segmented = self._splitter is not None and self._pieces_agree()

    def _pieces_agree(self) -> bool:
        """Whether piece-wise tokenization equals whole tokenization for this tokenizer."""
        markers = list(self._added)[:3]
        for text in _CHECK_TEXTS:
            joined = text.join(markers) + text if markers else text
            if self._encode_pieces(joined).tolist() != self._tokenizer.encode(joined, add_special_tokens=False).ids:
                return False
        return True

    @property
    def cached_tokens(self) -> int:
        return self._cached_tokens

    def render(self, body: Mapping[str, Any]) -> str | None:
        """The chat prompt text the engine builds from a chat body, or None if it can't be built."""
        raw = body.get("messages")
        if not isinstance(raw, list):
            return None
        messages = [_message(m) for m in raw]
        if any(m is None for m in messages):
            return None
        extra = body.get("chat_template_kwargs")
        variables: dict[str, Any] = {**self._specials, **(extra if isinstance(extra, Mapping) else {})}
        variables.update(
            messages=messages,
            tools=body.get("tools"),
            documents=body.get("documents"),
            add_generation_prompt=body.get("add_generation_prompt", True) is not False,
            continue_final_message=bool(body.get("continue_final_message", False)),
        )
        try:
            return self._template.render(**variables)
        except (TemplateError, TypeError, ValueError, RecursionError):
            return None

    def tokens(self, body: Mapping[str, Any]) -> Sequence[int] | None:
        """The token ids vLLM prefills for this body, or None when kvroute cannot know them."""
        if "messages" in body:
            text = self.render(body)
            special = body.get("add_special_tokens", False) is True
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and all(type(t) is int and t >= 0 for t in prompt):
                return list(prompt)  # already token ids
            text = prompt if isinstance(prompt, str) else None
            special = body.get("add_special_tokens", True) is not False
        if text is None or not self._plausible(body, text):
            return None
        if special and self._post_processed:  # the post-processor adds tokens around the whole prompt
            return self._encode(text, True)
        if not self.segmented:
            return self._encode(text, False)
        return self._encode_pieces(text)

    @staticmethod
    def _plausible(body: Mapping[str, Any], text: str) -> bool:
        """The rendered prompt is no more than a template's growth of its request."""
        if len(text) <= RENDER_SLACK:
            return True
        try:
            size = len(orjson.dumps(body))
        except (orjson.JSONEncodeError, TypeError):
            return False
        return len(text) <= RENDER_GROWTH * size + RENDER_SLACK

    def _encode(self, text: str, special: bool) -> list[int]:
        """Token ids, by `encode_batch`: unlike `encode` it lets go of the GIL while it works, so a
        long prompt tokenized in a worker thread no longer stops the event loop (0.29 s against
        0.02 s of stall for the same text)."""
        ids: list[int] = self._tokenizer.encode_batch([text], add_special_tokens=special)[0].ids
        return ids

    def _encode_pieces(self, text: str) -> array[int]:
        assert self._splitter is not None
        out = array("I")
        for index, piece in enumerate(self._splitter.split(text)):
            if index % 2:  # a special token
                out.append(self._added[piece])
            elif piece:
                out.extend(self._piece(piece))
        return out

    def _piece(self, piece: str) -> Sequence[int]:
        key = hashlib.blake2b(piece.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        with self._lock:
            ids = self._cache.get(key)
            if ids is not None:
                self._cache.move_to_end(key)
                self.pieces_reused += 1
                return ids
        ids = array("I", self._encode(piece, False))
        with self._lock:
            self.pieces_tokenized += 1
            if len(ids) + PIECE_TOKENS <= self._cache_limit and key not in self._cache:
                self._cache[key] = ids
                self._cached_tokens += len(ids) + PIECE_TOKENS
                while self._cached_tokens > self._cache_limit:
                    _, dropped = self._cache.popitem(last=False)
                    self._cached_tokens -= len(dropped) + PIECE_TOKENS
        return ids
