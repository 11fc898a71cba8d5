"""How many bytes of canonical prompt (CBR) the engines count as one token, learned online.

The approximate index counts in CBR blocks, the engines in tokens: a prefix of k blocks is about
k x block_size / bytes_per_token cached tokens, which is what kvroute predicts for a request.
4 bytes a token is right for English with large BPE vocabularies; a smaller vocabulary, code or
other languages differ (the tiny test model's is about 3.4). The ratio is learned from the CBR
bytes kvroute sends each backend against the prompt tokens the engine reports
(`vllm:prefix_cache_queries_total`); traffic kvroute did not send only adds tokens, so it errs
low. (Each backend's picture is still sized at 4 bytes a token: see Router._blocks.)
"""

from __future__ import annotations

DEFAULT_BYTES_PER_TOKEN = 4.0
LOWEST, HIGHEST = 1.0, 16.0  # beyond these an observation is a measurement error, not a tokenizer
WEIGHT = 0.2  # of each new observation in the running estimate
MIN_TOKENS = 4096  # an observation over fewer tokens is noise


class BytesPerToken:
    """A running estimate, per fleet (one model), fed per backend between two engine samples."""

    __slots__ = ("_pending_bytes", "_tokens", "value")

    def __init__(self, value: float = DEFAULT_BYTES_PER_TOKEN) -> None:
        self.value = value
        self._pending_bytes: dict[str, int] = {}  # CBR bytes sent since the backend's last counted sample
        self._tokens: dict[str, float] = {}  # the engine's prompt-token counter at that sample

    def sent(self, backend: str, cbr_bytes: int) -> None:
        """kvroute routed a prompt of this many CBR bytes to the backend."""
        if backend in self._tokens:
            self._pending_bytes[backend] = self._pending_bytes.get(backend, 0) + cbr_bytes

    def engine_tokens(self, backend: str, prompt_tokens: float) -> None:
        """The engine's prompt-token counter, from one of its samples."""
        before = self._tokens.get(backend)
        if before is None or prompt_tokens < before:  # first sample, or a restarted engine
            self._tokens[backend] = prompt_tokens
            self._pending_bytes[backend] = 0
            return
        tokens = prompt_tokens - before
        if tokens < MIN_TOKENS:
            return  # wait for more, keep accumulating
        sent = self._pending_bytes.get(backend, 0)
        self._tokens[backend] = prompt_tokens
        self._pending_bytes[backend] = 0
        if sent > 0:
            observed = min(HIGHEST, max(LOWEST, sent / tokens))
            self.value += WEIGHT * (observed - self.value)

    def forget(self, backend: str) -> None:
        self._pending_bytes.pop(backend, None)
        self._tokens.pop(backend, None)
