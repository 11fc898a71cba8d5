"""What vLLM engines report about themselves, in the core's terms: KV cache events and samples of
their own metrics. Adapters (extproc/vllm/) decode the wire formats into these; the router acts on
them (a restart or a cleared cache drops what kvroute believed the backend held)."""

from __future__ import annotations

from dataclasses import dataclass

# The largest count a float holds exactly: an engine's (or a replica's) counter past it, or below 0,
# is no count (summed, 1.8e308 twice was infinity, and JSON has no integer for it).
MAX_COUNTER = float(1 << 53)


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks the engine computed and cached, in order, each extending the one before."""

    block_hashes: tuple[int, ...]  # the engine's own hashes (low 64 bits)
    parent_hash: int | None  # the engine hash of the block before the first one; None at a prompt's start
    token_ids: tuple[int, ...]  # len(block_hashes) * block_size tokens
    block_size: int
    extra_keys: tuple[tuple[object, ...] | None, ...]  # per block: LoRA name, multimodal, cache_salt (as sent)
    lora_name: str | None = None  # the LoRA adapter that computed them (its blocks never serve the base model)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks the engine evicted."""

    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine emptied its prefix cache (`/reset_prefix_cache`, a weight update). A restart
    sends none: it shows as the event stream's sequence starting over."""


EngineEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EngineSample:
    """One scrape of a backend's /metrics: its load as the engine sees it (all clients, not only
    kvroute's), its KV cache geometry and when its process started (a change means a restart)."""

    running: int
    waiting: int
    kv_usage: float  # 0..1 of KV blocks held by running requests
    start_time: float | None  # process_start_time_seconds
    cache_tokens: int | None  # num_gpu_blocks * block_size from vllm:cache_config_info
    block_size: int | None
    prompt_tokens: float | None = None  # vllm:request_prompt_tokens_sum: prompt tokens of finished requests
    cache_queries: float | None = None  # vllm:prefix_cache_queries_total: prompt tokens looked up
    cache_hits: float | None = None  # vllm:prefix_cache_hits_total: of those, found cached
    ttft_sum: float | None = None  # vllm:time_to_first_token_seconds_sum: the engine's own first-token times
    ttft_count: float | None = None  # vllm:time_to_first_token_seconds_count
    # vllm:lora_requests_info, its latest series: the adapters of running and waiting requests, and
    # max_lora (None: the engine serves no adapters)
    lora_running: tuple[str, ...] = ()
    lora_slots: int | None = None
