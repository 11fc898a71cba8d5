"""Trace requests -> OpenAI chat bodies whose prompts share prefixes exactly as the trace's do.

Each Mooncake hash id becomes one message whose text is a deterministic function of the id,
`BLOCK_TOKENS` tokens long for the backends' tokenizer (measured in characters per token). So two
requests sharing leading hash ids share leading messages byte for byte, and conversations grow
the way the trace's prefixes do.
"""

from __future__ import annotations

import random
from typing import Any

from bench.workload import text as words
from bench.workloads.trace import BLOCK_TOKENS, TraceRequest


class PromptBuilder:
    """Deterministic text per hash id, sized in the backends' characters per token."""

    def __init__(self, model: str, chars_per_token: float, max_output_tokens: int) -> None:
        self.model = model
        self.chars_per_token = chars_per_token
        self.max_output_tokens = max_output_tokens
        self._texts: dict[int, str] = {}

    def block_text(self, hash_id: int) -> str:
        text = self._texts.get(hash_id)
        if text is None:
            size = round(BLOCK_TOKENS * self.chars_per_token)
            text = self._texts[hash_id] = (f"[{hash_id}] " + words(random.Random(hash_id), size))[:size]
        return text

    def body(self, request: TraceRequest) -> dict[str, Any]:
        """The chat body for one trace request (ready bodies pass through with the model set)."""
        if request.body is not None:
            model = request.adapter or self.model
            return {**request.body, "model": model, "stream": True, "stream_options": {"include_usage": True}}
        messages = []
        remaining = request.input_tokens
        for position, hash_id in enumerate(request.hash_ids):
            text = self.block_text(hash_id)
            if remaining < BLOCK_TOKENS:  # the trace's last, partial block
                text = text[: max(1, round(remaining * self.chars_per_token))]
            remaining -= BLOCK_TOKENS
            role = "system" if position == 0 else ("user" if position % 2 else "assistant")
            messages.append({"role": role, "content": text})
        if messages[-1]["role"] != "user":
            messages.append({"role": "user", "content": "Continue."})
        return {
            "model": request.adapter or self.model,
            "messages": messages,
            "max_tokens": max(1, min(request.output_tokens, self.max_output_tokens)),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
