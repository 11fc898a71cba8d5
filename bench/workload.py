"""Deterministic synthetic chat bodies for benchmarks and tests."""

from __future__ import annotations

import random
from typing import Any

_WORDS = [
    "cache",
    "prefix",
    "token",
    "block",
    "router",
    "backend",
    "session",
    "prompt",
    "model",
    "tensor",
    "kernel",
    "latency",
    "batch",
    "queue",
    "decode",
    "prefill",
    "attention",
    "layer",
    "vector",
    "index",
    "memory",
    "request",
    "stream",
    "gateway",
    "envoy",
    "cluster",
    "replica",
    "the",
    "a",
    "of",
    "to",
    "and",
    "in",
    "is",
    "it",
    "that",
    "for",
    "on",
    "with",
    "as",
    "was",
    "at",
    "by",
    "this",
    "be",
    "from",
    "or",
    "have",
    "an",
    "they",
    "which",
    "one",
]


def text(rng: random.Random, size: int) -> str:
    """About `size` bytes of word salad."""
    words: list[str] = []
    length = 0
    while length < size:
        word = rng.choice(_WORDS)
        words.append(word)
        length += len(word) + 1
    return " ".join(words)


def conversation(size: int, seed: int = 0, turn_bytes: int = 2000) -> dict[str, Any]:
    """A chat body of about `size` bytes: system prompt, tools, then alternating turns."""
    rng = random.Random(seed)
    body: dict[str, Any] = {
        "model": "bench-model",
        "temperature": 0.7,
        "max_tokens": 128,
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": f"tool_{i}",
                    "description": text(rng, 200),
                    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
                },
            }
            for i in range(3)
        ],
        "messages": [{"role": "system", "content": text(rng, min(size // 4, 4000))}],
    }
    role = "user"
    current = len(str(body))
    while current < size:
        chunk = text(rng, min(turn_bytes, size - current + 10))
        body["messages"].append({"role": role, "content": chunk})
        current += len(chunk) + 40
        role = "assistant" if role == "user" else "user"
    return body
