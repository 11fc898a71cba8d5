"""A simulated vLLM OpenAI server, for tests, demos and benchmarks of request routers.

It models what routing policies are judged on: vLLM's prefix cache of fixed-size token blocks
(cache hits shorten prefill), its scheduler's steps (a token budget per step, chunked prefill beside
decode, a bounded running batch, a FIFO waiting queue, preemption; `bench/simulator/sim_engine.py`),
vLLM's metric names, and with `--kv-connector` its prefill/decode hand-off (`sim_transfer.py`).
It renders and tokenizes with its own simple, deterministic rules and knows nothing of the
router's hashing, so a router earns cache hits only by really sending a prompt back to the
backend that holds its prefix.

    python -m bench.simulator.sim --port 8001 --port 8002
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import re
import signal
import socket
import sys
import time
import uuid
import zlib
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client import Counter as PromCounter
from prometheus_client.exposition import choose_encoder

from bench.simulator.sim_engine import ENGINE_FAILED, BlockPool, Engine, Request, StepCost
from bench.simulator.sim_events import EventPublisher
from bench.simulator.sim_transfer import Handoffs

MAX_MODEL_LEN = 131_072
"""The default context length (`max_model_len`): a prompt plus its max_tokens past it gets a 400, as on vLLM."""

_BYTES_PER_TOKEN = 4
DEFAULT_TOKENIZER = "bytes"  # every 4 bytes a token: the exact arithmetic tests rely on
_VOCAB = 50_000
_FIRST_TOKEN_ID = 100  # ids below are left to special tokens, as in real vocabularies
_SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)  # the timing histograms'
_SHUTDOWN_S = 1.0  # how long in-flight requests may finish when the server stops
_MAX_BODY_BYTES = 256 * 1024 * 1024  # aiohttp's 1 MiB default would refuse the multi-MB benchmark prompts
_MESSAGE_FIELDS = ("name", "tool_call_id", "tool_calls")  # besides role and content, what templates render
_FILLER = (" the", " quick", " brown", " fox", " jumps", " over", " a", " lazy", " dog", " while", " blocks", " warm")
_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError"}
_FAILED = "the engine failed while running this request"
_FAILED_EVENT = (
    b"data: "
    + orjson.dumps({"error": {"message": _FAILED, "type": _ERROR_TYPES[500], "param": None, "code": 500}})
    + b"\n\n"
)


@dataclass(frozen=True, slots=True)
class SimConfig:
    """What one simulated backend serves and how fast it works; each field is also a command-line flag."""

    model: str = field(default="sim-model", metadata={"help": "served model name"})
    block_size: int = field(default=16, metadata={"help": "tokens per KV block"})
    capacity_blocks: int = field(default=4096, metadata={"help": "KV cache capacity in blocks"})
    max_num_seqs: int = field(default=8, metadata={"help": "running batch size; more requests wait in a FIFO queue"})
    max_num_batched_tokens: int = field(
        default=2048, metadata={"help": "tokens one engine step computes at most (vLLM-CPU's default)"}
    )
    step_s: float = field(
        default=0.005,
        metadata={"help": "seconds of every engine step; each step decodes one token of every running request"},
    )
    token_s: float = field(
        default=0.00002, metadata={"help": "seconds per token a step computes (prompt chunk or output token)"}
    )
    attention_s: float = field(
        default=0.0,
        metadata={"help": "seconds per (token, earlier token of its sequence) pair a step computes: attention"},
    )
    kv_connector: bool = field(
        default=False,
        metadata={
            "help": "speak vLLM's kv_transfer_params hand-off as a server with NixlConnector does (prefill for a "
            "remote decode, decode from a remote prefill); off: kv_transfer_params are ignored, as without one"
        },
    )
    transfer_block_s: float = field(
        default=0.0005,
        metadata={
            "help": "seconds to pull one KV block from a prefill server in a kv_transfer_params hand-off (vLLM-CPU "
            "with NIXL here: 24 blocks of 128 tokens, 6 MB, in 13 ms)"
        },
    )
    lora_modules: str = field(
        default="",
        metadata={
            "help": "comma-separated LoRA adapter names served besides the model (as vLLM's --lora-modules; "
            "listed by /v1/models with the model as parent)"
        },
    )
    max_loras: int = field(
        default=1,
        metadata={"help": "adapters a running batch holds at once (vLLM's --max-loras); requests of another wait"},
    )
    lora_load_s: float = field(
        default=0.02,
        metadata={"help": "seconds a step takes longer for each adapter it swaps into a slot, evicting another"},
    )
    runtime_lora: bool = field(
        default=False,
        metadata={
            "help": "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter, as vLLM does with "
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"
        },
    )
    default_max_tokens: int = field(default=16, metadata={"help": "output tokens when a request sets no limit"})
    max_model_len: int = field(
        default=MAX_MODEL_LEN, metadata={"help": "context length: longer prompt + max_tokens get a 400 at once"}
    )
    tokenizer: str = field(
        default=DEFAULT_TOKENIZER,
        metadata={
            "help": "bytes: every 4 bytes a token (exact arithmetic for tests); words: tokens of varying length, "
            "as a real tokenizer's"
        },
    )
    kv_events: bool = field(
        default=False,
        metadata={
            "help": "publish KV cache events over ZMQ as vLLM does with --kv-events-config (GET /kv_event_sources)"
        },
    )

    def __post_init__(self) -> None:
        """Reject settings the simulation cannot honour at start-up, not on the first request."""
        if not self.model:
            raise ValueError("model must not be empty")
        for name in (
            "block_size",
            "capacity_blocks",
            "max_num_seqs",
            "max_num_batched_tokens",
            "default_max_tokens",
            "max_model_len",
            "max_loras",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.tokenizer not in TOKENIZERS:
            raise ValueError(f"tokenizer must be one of {sorted(TOKENIZERS)}")
        if self.model in self.adapters:
            raise ValueError("an adapter must not be named as the model")
        for name in ("step_s", "token_s", "attention_s", "transfer_block_s", "lora_load_s"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0")

    @property
    def adapters(self) -> tuple[str, ...]:
        """The LoRA adapters served, in the order given."""
        return tuple(name for name in (n.strip() for n in self.lora_modules.split(",")) if name)


class _ApiError(Exception):
    """An error a handler answers in OpenAI's shape; the middleware turns it into the response."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True, slots=True)
class _Prompt:
    """Token ids plus what else keys their KV blocks (media contents, cache salt), by block index."""

    tokens: list[int]
    extra_keys: dict[int, tuple[bytes, ...]]
    adapter: str | None = None  # the LoRA adapter computing it: its name keys every block, as in vLLM
    salt: str | None = None  # its cache_salt (also in extra_keys[0]), for the KV events


def tokenize(text: str) -> list[int]:
    """The simulator's tokenizer: each 4-byte group of the UTF-8 text (the last zero-padded) is one token.

    Deterministic on every platform, and cheap on multi-MB prompts: the bytes become 32-bit words in
    one step, leaving one modulo per token.
    """
    data = text.encode()
    words = array("I", data + bytes(-len(data) % _BYTES_PER_TOKEN))
    if sys.byteorder == "big":
        words.byteswap()
    return [word % _VOCAB + _FIRST_TOKEN_ID for word in words]


_PIECE = re.compile(r" ?\S{1,4}|\s")
_PIECE_IDS: dict[str, int] = {}
_PIECE_IDS_MAX = 1 << 20  # distinct pieces remembered; past it the table starts over


def tokenize_words(text: str) -> list[int]:
    """The simulator's other tokenizer: a space and up to four more characters, or one whitespace
    character, is one token. Tokens then vary in length (about 3.5 bytes on the benchmarks' text,
    as the tiny model's tokenizer does), so a router that counts bytes predicts tokens only as
    closely as it would on vLLM. Deterministic across processes (ids from CRC-32)."""
    ids = _PIECE_IDS
    if len(ids) > _PIECE_IDS_MAX:
        ids.clear()
    out = []
    for piece in _PIECE.findall(text):
        token = ids.get(piece)
        if token is None:
            token = ids[piece] = zlib.crc32(piece.encode()) % _VOCAB + _FIRST_TOKEN_ID
        out.append(token)
    return out


TOKENIZERS = {"bytes": tokenize, "words": tokenize_words}


def _canonical(value: Any) -> str:
    """Canonical JSON, so equal tools or tool calls render to equal text whatever their key order."""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()


def _render_chat(body: Mapping[str, Any]) -> tuple[str, list[tuple[int, bytes]]]:
    """Render a chat request with the simulator's fixed template.

    Returns the prompt and, per media part, the byte offset of its placeholder and its canonical
    JSON: as with vLLM's multimodal hashes, the media itself must key the KV blocks, or requests with
    different images would share cache entries.
    """
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _ApiError(400, "messages must be a non-empty list")
    pieces: list[str] = []
    media: list[tuple[int, bytes]] = []  # (index in pieces, key)
    if body.get("tools"):
        pieces.append(f"<|tools|>{_canonical(body['tools'])}\n")
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _ApiError(400, "each message must be an object with a string role")
        pieces.append(f"<|{message['role']}|>\n")
        content = message.get("content")
        if isinstance(content, str):
            pieces.append(content)
        elif isinstance(content, list):
            for part in content:
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise _ApiError(400, "each content part must be an object with a string type")
                if part["type"] == "text":
                    if not isinstance(part.get("text"), str):
                        raise _ApiError(400, "a text part needs a string text")
                    pieces.append(part["text"])
                else:
                    media.append((len(pieces), orjson.dumps(part, option=orjson.OPT_SORT_KEYS)))
                    pieces.append(f"<|{part['type'].removeprefix('input_').removesuffix('_url')}|>")
        elif content is not None:
            raise _ApiError(400, "message content must be a string, a list of parts or null")
        pieces.extend(f"<|{key}|>{_canonical(message[key])}" for key in _MESSAGE_FIELDS if message.get(key) is not None)
        pieces.append("<|end|>\n")
    if body.get("add_generation_prompt", True):
        pieces.append("<|assistant|>\n")
    text = "".join(pieces)
    if not media:
        return text, []
    offsets = list(itertools.accumulate((len(piece.encode()) for piece in pieces), initial=0))
    return text, [(offsets[index], key) for index, key in media]


def _block_hashes(prompt: _Prompt, block_size: int) -> list[int]:
    """Chained hashes of the prompt's full blocks: each covers its whole prefix, so one lookup per
    block suffices. Only integers are hashed (the extra keys and the adapter as their CRC-32), so
    every process computes the same ones: a string's or None's hash differs between processes."""
    tokens = prompt.tokens
    adapter = zlib.crc32(prompt.adapter.encode()) + 1 if prompt.adapter else 0
    extras = {index: zlib.crc32(b"\0".join(keys)) + 1 for index, keys in prompt.extra_keys.items()}
    parent = 0
    hashes: list[int] = []
    for index, start in enumerate(range(0, len(tokens) - block_size + 1, block_size)):
        block = tuple(tokens[start : start + block_size])
        parent = hash((parent, block, extras.get(index, 0), adapter))
        hashes.append(parent)
    return hashes


def prompt_tokens(body: Mapping[str, Any], tokenizer: str = DEFAULT_TOKENIZER) -> list[int]:
    """A text-only chat prompt's token ids, as this simulator renders and tokenizes it."""
    text, _ = _render_chat(body)
    return TOKENIZERS[tokenizer](text)


def prompt_blocks(
    body: Mapping[str, Any], block_size: int, tokenizer: str = DEFAULT_TOKENIZER
) -> tuple[int, list[int]]:
    """A text-only chat prompt's length in tokens and the block hashes this simulator caches it by,
    for offline analyses (the benchmark's oracle) that must count exactly as the backends do."""
    prompt = _Prompt(prompt_tokens(body, tokenizer), {})
    return len(prompt.tokens), _block_hashes(prompt, block_size)


def block_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of a text-only prompt's full blocks, as this simulator caches them."""
    return _block_hashes(_Prompt(list(tokens), {}), block_size)


@dataclass(frozen=True, slots=True)
class _Reply:
    """The OpenAI response shapes of one chat or completions request."""

    chat: bool
    model: str
    id: str
    created: int

    @classmethod
    def new(cls, chat: bool, model: str) -> _Reply:
        return cls(chat, model, f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time()))

    def _head(self, stream: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if stream else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def full(
        self, text: str, finish_reason: str, usage: dict[str, Any], transfer: dict[str, Any] | None = None
    ) -> bytes:
        """The whole answer; `transfer`: a prefill's kv_transfer_params for its remote decode."""
        choice = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
        choices = [{"index": 0, **choice, "logprobs": None, "finish_reason": finish_reason}]
        return orjson.dumps({**self._head(False), "choices": choices, "usage": usage, "kv_transfer_params": transfer})

    def chunk(self, text: str, finish_reason: str | None, *, role: bool = False) -> bytes:
        """One SSE event; `role` marks a chat stream's first event, which names the speaker as vLLM's does."""
        if self.chat:
            choice: dict[str, Any] = {"delta": {"role": "assistant", "content": text} if role else {"content": text}}
        else:
            choice = {"text": text}
        choices = [{"index": 0, **choice, "logprobs": None, "finish_reason": finish_reason}]
        return _sse({**self._head(True), "choices": choices})

    def usage_chunk(self, usage: dict[str, Any]) -> bytes:
        return _sse({**self._head(True), "choices": [], "usage": usage})


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _filler(start: int, end: int) -> str:
    """Output tokens start..end-1: deterministic words, one token each."""
    return "".join(_FILLER[i % len(_FILLER)] for i in range(start, end))


def _json(payload: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(payload), status=status, content_type="application/json")


@web.middleware
async def _openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Answer errors in OpenAI's JSON shape, which clients and routers parse in production."""
    try:
        return await handler(request)
    except _ApiError as error:
        body = {"message": error.message, "type": _ERROR_TYPES[error.status], "param": None, "code": error.status}
        return _json({"error": body}, error.status)


class SimBackend:
    """One simulated vLLM server: state + aiohttp app."""

    def __init__(self, config: SimConfig, name: str, host: str = "127.0.0.1") -> None:
        self.config = config
        self.name = name
        self._pool = BlockPool(config.capacity_blocks)
        self._tokenize_text = TOKENIZERS[config.tokenizer]
        self._events = EventPublisher(host) if config.kv_events else None
        self._handoffs = Handoffs(name, config.transfer_block_s)
        self.adapters = {name: f"/adapters/{name}" for name in config.adapters}  # served now: name -> path
        self._started = int(time.time())
        self._registry = registry = CollectorRegistry()  # per backend: backends in one process keep separate metrics
        model = {"model_name": config.model}
        by_model = ["model_name"]
        self._queries = PromCounter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", by_model, registry=registry
        ).labels(**model)
        self._hits = PromCounter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", by_model, registry=registry
        ).labels(**model)
        success = PromCounter(
            "vllm:request_success", "Finished requests.", [*by_model, "finished_reason"], registry=registry
        )
        self._prompt_tokens = Histogram(
            "vllm:request_prompt_tokens",
            "Prompt tokens of finished requests.",
            by_model,
            buckets=(1, 64, 1024, 16384, 262144),
            registry=registry,
        ).labels(**model)
        # every reason vLLM 0.32 counts (vllm/v1/engine FinishReason), a client that left as "abort"
        reasons = ("stop", "length", "abort", "error", "repetition")
        self._success = {reason: success.labels(finished_reason=reason, **model) for reason in reasons}
        by_source = PromCounter(
            "vllm:prompt_tokens_by_source",
            "Prompt tokens of scheduled requests by where their KV came from.",
            [*by_model, "source"],
            registry=registry,
        )
        self._sources = {
            source: by_source.labels(source=source, **model)
            for source in ("local_compute", "local_cache_hit", "external_kv_transfer")
        }
        preemptions = PromCounter(
            "vllm:num_preemptions", "Running requests put back to wait for KV blocks.", by_model, registry=registry
        ).labels(**model)
        timing = {
            "vllm:request_queue_time_seconds": "Seconds from arrival to first scheduling.",
            "vllm:request_prefill_time_seconds": "Seconds from first scheduling to the first token.",
            "vllm:time_to_first_token_seconds": "Seconds from arrival to the first token.",
        }
        self._timing = {
            name: Histogram(name, documentation, by_model, buckets=_SECONDS_BUCKETS, registry=registry).labels(**model)
            for name, documentation in timing.items()
        }
        self._step_tokens = Histogram(
            "vllm:iteration_tokens_total",
            "Tokens computed per engine step.",
            by_model,
            buckets=(1, 8, 64, 512, 2048, 16384),
            registry=registry,
        ).labels(**model)
        # The simulator's own count of adapter swaps (vLLM logs them but exports no metric)
        lora_loads = PromCounter(
            "sim_lora_loads",
            "Adapters swapped into a slot (each evicting one once the slots are full).",
            registry=registry,
        )
        self._engine = Engine(
            self._pool,
            config.block_size,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            StepCost(config.step_s, config.token_s, config.attention_s),
            self._events,
            on_admit=self._admitted,
            on_preempt=preemptions.inc,
            on_step=self._stepped,
            max_loras=config.max_loras,
            lora_load_s=config.lora_load_s,
            on_lora_load=lora_loads.inc,
        )
        # As vLLM's: one series per (running, waiting) adapter set, set to the time it last held
        self._lora_info = (
            Gauge(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                registry=registry,
            )
            if config.adapters or config.runtime_lora
            else None
        )
        gauges = {
            "vllm:num_requests_running": ("Requests in the running batch.", lambda: len(self._engine.running)),
            "vllm:num_requests_waiting": ("Requests waiting to be scheduled.", lambda: len(self._engine.waiting)),
            "vllm:kv_cache_usage_perc": ("Fraction of KV blocks held by running prompts.", self._kv_usage),
        }
        for name, (documentation, read) in gauges.items():
            Gauge(name, documentation, by_model, registry=registry).labels(**model).set_function(read)
        info = Gauge(
            "vllm:cache_config_info", "KV cache configuration.", ["block_size", "num_gpu_blocks"], registry=registry
        )
        info.labels(block_size=str(config.block_size), num_gpu_blocks=str(config.capacity_blocks)).set(1)
        # As prometheus_client's process collector reports it for vLLM: a new value means a restart.
        started = Gauge("process_start_time_seconds", "Start time of the process.", registry=registry)
        started.set(time.time())

    def app(self) -> web.Application:
        """A new aiohttp app serving this backend's state.

        Run it with `handler_cancellation=True`, as serve() and aiohttp's TestServer do: only then does
        aiohttp cancel the handler of a client that left, and the cancellation is what takes its
        request out of the engine.
        """
        app = web.Application(client_max_size=_MAX_BODY_BYTES, middlewares=[_openai_errors])
        app.on_response_prepare.append(self._tag)
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions/render", self._render)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/reset_prefix_cache", self._reset)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/metrics/", self._metrics)
        app.router.add_get("/kv_transfer/{request_id}", self._kv_transfer)
        if self.config.runtime_lora:
            app.router.add_post("/v1/load_lora_adapter", self._load_adapter)
            app.router.add_post("/v1/unload_lora_adapter", self._unload_adapter)
        app.on_cleanup.append(self._stop_engine)
        if self._events is not None:
            app.router.add_get("/kv_event_sources", self._event_sources)
            app.on_cleanup.append(self._close_events)
        return app

    async def _event_sources(self, request: web.Request) -> web.Response:
        assert self._events is not None
        return _json(self._events.sources())

    async def _close_events(self, app: web.Application) -> None:
        if self._events is not None:
            self._events.close()

    async def _stop_engine(self, app: web.Application) -> None:
        await self._engine.close()
        await self._handoffs.close()

    async def _load_adapter(self, request: web.Request) -> web.Response:
        """vLLM's runtime load: 400 for the base model's name or a name already served (unless
        `load_inplace`), else it is served from now on."""
        body = await self._json_object(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise _ApiError(400, "Both 'lora_name' and 'lora_path' must be provided.")
        if name == self.config.model:
            raise _ApiError(400, f"The lora adapter '{name}' conflicts with a served base model.")
        if name in self.adapters and body.get("load_inplace") is not True:
            raise _ApiError(400, f"The lora adapter '{name}' has already been loaded.")
        self.adapters[name] = path
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def _unload_adapter(self, request: web.Request) -> web.Response:
        """vLLM's runtime unload: 404 for a name not served."""
        name = (await self._json_object(request)).get("lora_name")
        if not isinstance(name, str) or name not in self.adapters:
            raise _ApiError(404, f"The lora adapter '{name}' cannot be found.")
        del self.adapters[name]
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def _kv_transfer(self, request: web.Request) -> web.Response:
        """A decode server pulls the blocks of a prefill kept for it (sim_transfer.py)."""
        blocks = self._handoffs.take(request.match_info["request_id"])
        return _json({"blocks": blocks}) if blocks is not None else _json({"error": "no such transfer"}, 404)

    def _admitted(self, request: Request) -> None:
        self._queries.inc(len(request.tokens))
        self._hits.inc(request.cached)
        self._sources["local_cache_hit"].inc(request.cached)
        self._sources["external_kv_transfer"].inc(request.transferred)
        self._sources["local_compute"].inc(len(request.tokens) - request.cached - request.transferred)
        self._timing["vllm:request_queue_time_seconds"].observe(request.scheduled_at - request.queued_at)

    def _stepped(self, tokens: int, firsts: Sequence[Request]) -> None:
        self._step_tokens.observe(tokens)
        if self._lora_info is not None:
            engine = self._engine
            running = ",".join(dict.fromkeys(r.adapter for r in engine.running if r.adapter))
            waiting = ",".join(dict.fromkeys(r.adapter for r in engine.waiting if r.adapter))
            labels = {"max_lora": str(self.config.max_loras), "waiting_lora_adapters": waiting}
            self._lora_info.labels(running_lora_adapters=running, **labels).set(time.time())
        for request in firsts:
            self._timing["vllm:request_prefill_time_seconds"].observe(request.first_token_at - request.scheduled_at)
            self._timing["vllm:time_to_first_token_seconds"].observe(request.first_token_at - request.queued_at)

    def reset_prefix_cache(self) -> None:
        self._pool.clear()
        if self._events is not None:
            self._events.cleared()

    def _kv_usage(self) -> float:
        return min(1.0, self._pool.pinned / self.config.capacity_blocks)

    async def _tag(self, request: web.Request, response: web.StreamResponse) -> None:
        """Name the serving backend on every response, errors and streams included, so tests can tell;
        and the trace context the request came with (vLLM's own spans would be its children) and the
        engine priority it was given (vLLM's scheduler would read it)."""
        response.headers["x-sim-backend"] = self.name
        if "traceparent" in request.headers:
            response.headers["x-sim-traceparent"] = request.headers["traceparent"]
        if "x-vllm-priority" in request.headers:
            response.headers["x-sim-priority"] = request.headers["x-vllm-priority"]

    async def _body(self, request: web.Request) -> dict[str, Any]:
        """The JSON object body, checked to name this backend's model (or none, meaning the served one)."""
        if request.content_type != "application/json":  # vLLM validates the media type before the body
            raise _ApiError(400, "Unsupported Media Type: Only 'application/json' is allowed")
        body = await self._json_object(request)
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise _ApiError(400, "model must be a string")
        if model is not None and model != self.config.model and model not in self.adapters:
            raise _ApiError(404, f"The model `{model}` does not exist.")
        return body

    @staticmethod
    async def _json_object(request: web.Request) -> dict[str, Any]:
        """The body as a JSON object, else a 400 as vLLM answers."""
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as error:
            raise _ApiError(400, f"invalid JSON body: {error}") from None
        except web.RequestPayloadError as error:  # e.g. labelled gzip but not: vLLM answers 400, not 500
            raise _ApiError(400, f"the body could not be read: {error}") from None
        if not isinstance(body, dict):
            raise _ApiError(400, "the body must be a JSON object")
        return body

    def _prompt(self, tokens: list[int], media: Sequence[tuple[int, bytes]], body: Mapping[str, Any]) -> _Prompt:
        """Attach the extra block keys: media to the block holding its placeholder (found at 4 bytes a
        token, which the words tokenizer only approximates), vLLM's cache_salt to block 0."""
        block_bytes = self.config.block_size * _BYTES_PER_TOKEN
        extra_keys: dict[int, tuple[bytes, ...]] = {}
        salt = body.get("cache_salt")
        if salt is not None:
            if not isinstance(salt, str):
                raise _ApiError(400, "cache_salt must be a string")
            extra_keys[0] = (b"cache_salt=" + salt.encode(),)
        for offset, key in media:
            block = offset // block_bytes
            extra_keys[block] = (*extra_keys.get(block, ()), key)
        adapter = body.get("model") if body.get("model") in self.adapters else None
        return _Prompt(tokens, extra_keys, adapter, salt)

    def _completion_tokens(self, body: Mapping[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return self._tokenize_text(prompt)
        if isinstance(prompt, list) and all(type(token) is int and token >= 0 for token in prompt):
            return prompt
        raise _ApiError(400, "prompt must be a string or a list of token ids (batches are not simulated)")

    def _output_length(self, body: Mapping[str, Any]) -> tuple[int, str]:
        """Output tokens and finish reason: a client's limit is always reached, the default stands in for EOS."""
        limit = body.get("max_completion_tokens")
        if limit is None:
            limit = body.get("max_tokens")
        if limit is None:
            return self.config.default_max_tokens, "stop"
        if type(limit) is not int or not 1 <= limit <= self.config.max_model_len:
            raise _ApiError(400, f"max_tokens must be an integer from 1 to {self.config.max_model_len}")
        return limit, "length"

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        text, media = _render_chat(body)
        return await self._generate(request, body, self._prompt(self._tokenize_text(text), media, body), chat=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        return await self._generate(request, body, self._prompt(self._completion_tokens(body), (), body), chat=False)

    async def _generate(
        self, request: web.Request, body: Mapping[str, Any], prompt: _Prompt, *, chat: bool
    ) -> web.StreamResponse:
        """Queue, prefill and decode one request, answering as one JSON object or as an SSE stream."""
        if not prompt.tokens:
            raise _ApiError(400, "the prompt is empty")
        length, finish_reason = self._output_length(body)
        context = self.config.max_model_len
        if len(prompt.tokens) + (length if finish_reason == "length" else 1) > context:
            # vLLM refuses at once what cannot fit its context, before any queueing or prefill.
            asked = len(prompt.tokens) + length
            raise _ApiError(
                400,
                f"This model's maximum context length is {context} tokens. However, you requested {asked} "
                f"tokens ({len(prompt.tokens)} in the messages, {length} in the completion).",
            )
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise _ApiError(400, "stream must be a boolean")
        if body.get("n", 1) != 1:
            raise _ApiError(400, "the simulator generates one choice per request (n=1)")
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        size = self.config.block_size
        if math.ceil((len(prompt.tokens) + length - 1) / size) > self._pool.capacity:  # the last token needs no KV
            raise _ApiError(400, f"the request needs more than the {self._pool.capacity} KV blocks there are")
        reply = _Reply.new(chat, prompt.adapter or self.config.model)
        out: asyncio.Queue[int] = asyncio.Queue()
        job = Request(
            prompt.tokens, _block_hashes(prompt, size), length, out.put_nowait, adapter=prompt.adapter, salt=prompt.salt
        )
        transfer = body.get("kv_transfer_params") if self.config.kv_connector else None
        transfer = transfer if isinstance(transfer, dict) else {}
        remote = transfer.get("remote_prefill_cached_tokens")  # as vLLM 0.32's decode reports: the prefill's hits
        reported = remote if type(remote) is int and remote >= 0 and transfer.get("do_remote_prefill") else None
        if transfer.get("do_remote_prefill") is True:  # decode: the prompt's blocks come from the prefill server
            job.external = await self._handoffs.pull(transfer, job.hashes)
        if not stream:
            self._engine.submit(job)
            try:
                while (token := await out.get()) < length - 1:
                    if token == ENGINE_FAILED:
                        raise _ApiError(500, _FAILED)
            except asyncio.CancelledError:  # the client left
                self._success["abort"].inc()
                raise
            finally:
                self._engine.finish(job)
            self._finished(len(prompt.tokens), finish_reason)
            handed = self._handoffs.keep(job.hashes, job.cached) if transfer.get("do_remote_decode") is True else None
            usage = _usage(len(prompt.tokens), length, job.cached if reported is None else reported)
            return web.Response(
                body=reply.full(_filler(0, length), finish_reason, usage, handed), content_type="application/json"
            )
        # Headers go out at once, as from vLLM's streaming response, however long the request then waits.
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        self._engine.submit(job)
        try:
            completed = await self._stream(response, reply, out, length, finish_reason, chat)
            if completed and include_usage:
                usage = _usage(len(prompt.tokens), length, job.cached if reported is None else reported)
                await response.write(reply.usage_chunk(usage))
            await response.write(b"data: [DONE]\n\n")
        except ConnectionResetError:
            self._success["abort"].inc()
            return response  # the client left; finishing the job already freed its blocks
        except asyncio.CancelledError:  # the client left between tokens
            self._success["abort"].inc()
            raise
        finally:
            self._engine.finish(job)
        if completed:
            self._finished(len(prompt.tokens), finish_reason)
        return response

    def _finished(self, prompt_tokens: int, finish_reason: str) -> None:
        self._success[finish_reason].inc()
        self._prompt_tokens.observe(prompt_tokens)

    @staticmethod
    async def _stream(
        response: web.StreamResponse,
        reply: _Reply,
        out: asyncio.Queue[int],
        length: int,
        finish_reason: str,
        chat: bool,
    ) -> bool:
        """Send the output tokens as the engine's steps make them: one event per wake-up, with
        every token made since (a chat stream first names the speaker, as vLLM's does). False if
        the engine failed instead: an error event was sent."""
        sent = 0
        while sent < length:
            last = await out.get()
            while not out.empty():
                last = out.get_nowait()
            if last == ENGINE_FAILED:  # as vLLM's stream reports an error: an error event, then [DONE]
                await response.write(_FAILED_EVENT)
                return False
            if chat and not sent:
                await response.write(reply.chunk("", None, role=True))
            await response.write(reply.chunk(_filler(sent, last + 1), finish_reason if last + 1 == length else None))
            sent = last + 1
        return True

    async def _render(self, request: web.Request) -> web.Response:
        text, _ = _render_chat(await self._body(request))
        return _json({"prompt": text, "prompt_token_ids": self._tokenize_text(text)})

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        tokens = self._tokenize_text(_render_chat(body)[0]) if "messages" in body else self._completion_tokens(body)
        return _json({"tokens": tokens, "count": len(tokens), "max_model_len": self.config.max_model_len})

    async def _reset(self, request: web.Request) -> web.Response:
        """As vLLM 0.32: `{"success": false}`, and nothing reset, while any request holds blocks."""
        if self._pool.pinned:
            return _json({"success": False})
        self.reset_prefix_cache()
        return _json({"success": True})

    async def _models(self, request: web.Request) -> web.Response:
        model = self.config.model
        card = {
            "object": "model",
            "created": self._started,
            "owned_by": "vllm",
            "max_model_len": self.config.max_model_len,
        }
        cards = [{**card, "id": model, "root": model, "parent": None}]
        cards += [{**card, "id": name, "root": path, "parent": model} for name, path in self.adapters.items()]
        return _json({"object": "list", "data": cards})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def _metrics(self, request: web.Request) -> web.Response:
        """As vLLM serves it: /metrics whole, /metrics/ (prometheus_client's own app) only the
        families named by `name[]` when there are any."""
        encode, content_type = choose_encoder(request.headers.get("Accept", ""))
        names = request.query.getall("name[]", []) if request.path == "/metrics/" else []
        registry = self._registry.restricted_registry(names) if names else self._registry
        return web.Response(body=encode(registry), headers={"Content-Type": content_type})


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def serve(ports: list[int], config: SimConfig, host: str = "127.0.0.1") -> list[web.AppRunner]:
    """Start one SimBackend per port in the running event loop; the caller cleans the runners up.

    Each backend is named after its address, `host:port`. Port 0 picks a free port: the socket is
    bound before the backend is named, so the name holds the real port (see `runner.addresses`).
    """
    runners: list[web.AppRunner] = []
    sockets: list[socket.socket] = []
    try:
        for port in ports:
            sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
            sockets.append(sock)
            backend = SimBackend(config, _address(host, sock.getsockname()[1]), host)
            runner = web.AppRunner(
                backend.app(), handler_cancellation=True, access_log=None, shutdown_timeout=_SHUTDOWN_S
            )
            await runner.setup()
            runners.append(runner)
            await web.SockSite(runner, sock).start()
    except BaseException:
        for runner in runners:
            await runner.cleanup()
        for sock in sockets:
            sock.close()
        raise
    return runners


async def _serve_until_signalled(ports: list[int], config: SimConfig, host: str) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    runners = await serve(ports, config, host)
    try:
        for stop_signal in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(stop_signal, stop.set)
        for runner in runners:
            for address in runner.addresses:
                print(f"{config.model} on http://{_address(host, address[1])}", flush=True)
        await stop.wait()
    finally:
        for stop_signal in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(stop_signal)
        for runner in runners:
            await runner.cleanup()


def main(ports: list[int], config: SimConfig, host: str = "127.0.0.1") -> None:
    """Serve until SIGINT or SIGTERM, printing one `<model> on http://<address>` line per backend."""
    asyncio.run(_serve_until_signalled(ports, config, host))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add --port (repeatable), --host and one flag per SimConfig field, so any CLI can host the simulator."""
    parser.add_argument(
        "--port", type=int, action="append", required=True, help="listen port, one backend each; 0 picks a free one"
    )
    parser.add_argument("--host", default="127.0.0.1", help="listen address (default: %(default)s)")
    for config_field in fields(SimConfig):
        flag, kind = f"--{config_field.name.replace('_', '-')}", type(config_field.default)
        help_text = f"{config_field.metadata['help']} (default: %(default)s)"
        if kind is bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=config_field.default, help=help_text
            )
        else:
            parser.add_argument(flag, type=kind, default=config_field.default, help=help_text)


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(**{config_field.name: getattr(args, config_field.name) for config_field in fields(SimConfig)})


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m bench.simulator.sim", description=__doc__.splitlines()[0])
    add_arguments(_parser)
    _args = _parser.parse_args()
    try:
        _config = config_from_args(_args)
    except ValueError as _error:
        _parser.error(str(_error))
    main(_args.port, _config, _args.host)
