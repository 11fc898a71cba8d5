"""Routing settings: every knob with its name, default and a one-line reason."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any


def _doc(text: str) -> dict[str, str]:
    return {"doc": text}


@dataclass(frozen=True, slots=True)
class Settings:
    """All routing settings. Validated on construction so a bad config fails at start-up."""

    block_size: int = field(
        default=512,
        metadata=_doc("Bytes of canonical prompt per block (multiple of 8); ~128 tokens, vLLM's CPU KV block."),
    )
    hash_key: bytes = field(
        default_factory=lambda: os.urandom(16),
        metadata=_doc(
            "16-byte SipHash key; set it explicitly so replicas agree, keep it secret so hashes can't be forged."
        ),
    )
    location_ttl_s: float = field(
        default=600.0, metadata=_doc("Seconds a learned (block, backend) location is trusted without being seen again.")
    )
    capacity_blocks: int = field(
        default=8192,
        metadata=_doc(
            "Blocks remembered per backend (LRU); set to the backend's KV capacity in tokens / tokens per block."
        ),
    )
    session_ttl_s: float = field(default=3600.0, metadata=_doc("Seconds a session binding lives after its last use."))
    session_capacity: int = field(default=100_000, metadata=_doc("Session bindings kept (LRU beyond this)."))
    active_request_cost: float = field(
        default=4.0, metadata=_doc("Load of one in-flight request, in blocks of prefill it is worth.")
    )
    balance_abs_gate: float = field(
        default=32.0,
        metadata=_doc("A session's backend is overloaded only if its load exceeds the least loaded by this much..."),
    )
    balance_rel_gate: float = field(
        default=1.5, metadata=_doc("...and is more than this multiple of the least loaded backend's load.")
    )
    prefix_stick_ratio: float = field(
        default=0.5,
        metadata=_doc("A request stays on a backend holding this share of its prompt unless past the balance gates."),
    )
    eviction_cost_weight: float = field(
        default=3.0,
        metadata=_doc(
            "Extra cost per novel block times the backend's recent cache turnover: new prompts evict least there."
        ),
    )
    churn_half_life_s: float = field(
        default=60.0, metadata=_doc("Half-life of the recent-turnover count behind eviction_cost_weight.")
    )
    session_headers: tuple[str, ...] = field(
        default=("x-session-id",),
        metadata=_doc("Request headers naming a conversation, tried in order before the body's session ids."),
    )
    capacity_auto: bool = field(
        default=True,
        metadata=_doc("Size each backend's capacity from its vllm:cache_config_info (capacity_blocks until known)."),
    )
    new_session_load_weight: float = field(
        default=2.0,
        metadata=_doc(
            "Load multiplier when placing a bootstrap request: it decides where a whole conversation will live."
        ),
    )

    def __post_init__(self) -> None:
        if self.block_size < 8 or self.block_size % 8:
            raise ValueError(f"block_size must be a positive multiple of 8, got {self.block_size}")
        if len(self.hash_key) != 16:
            raise ValueError("hash_key must be exactly 16 bytes")
        positive = (
            "location_ttl_s",
            "capacity_blocks",
            "session_ttl_s",
            "session_capacity",
            "balance_rel_gate",
            "churn_half_life_s",
            "prefix_stick_ratio",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not all(isinstance(h, str) and h for h in self.session_headers):
            raise ValueError("session_headers must be non-empty header names")
        for name in ("active_request_cost", "balance_abs_gate", "new_session_load_weight", "eviction_cost_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")

    @classmethod
    def docs(cls) -> dict[str, str]:
        """Setting name -> one-line description, for the README and `--help`."""
        return {f.name: f.metadata["doc"] for f in fields(cls)}

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> Settings:
        """Build from a config mapping; `hash_key` may be hex text. Unknown names are an error."""
        known = {f.name for f in fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"unknown settings: {sorted(unknown)}")
        values = dict(values)
        key = values.get("hash_key")
        if isinstance(key, str):
            values["hash_key"] = bytes.fromhex(key)
        if "session_headers" in values:
            values["session_headers"] = tuple(str(h).lower() for h in values["session_headers"])
        return cls(**values)
