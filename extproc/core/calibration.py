"""How many bytes of canonical prompt (CBR) the engines count as one token, learned online.

The approximate index counts in CBR blocks, the engines in tokens: a KV cache of N tokens holds
about N x bytes_per_token / block_size blocks, and a prefix of k blocks is about
k x block_size / bytes_per_token cached tokens. 4 bytes a token is right for English with large
BPE vocabularies; a smaller vocabulary, code or other languages differ (the tiny test model's is
about 3.4), and a wrong ratio sizes each backend's picture wrongly: too large, and kvroute keeps
trusting prefixes the engine has already evicted. The ratio is learned from the CBR bytes kvroute
sends each backend against the prompt tokens the engine reports (`vllm:prefix_cache_queries_total`).
Traffic kvroute did not send only adds tokens, so it errs towards a smaller picture, the safe side.
"""

from __future__ import annotations

DEFAULT_BYTES_PER_TOKEN = 4.0
LOWEST, HIGHEST = 1.0, 16.0  # beyond these an observation is a measurement error, not a tokenizer
WEIGHT = 0.2  # of each new observation in the running estimate
MIN_TOKENS = 4096  # an observation over fewer tokens is noise


class BytesPerToken:
    """A running estimate, per fleet (one model), fed per backend between two engine samples."""

    __slots__ = ("_applied", "_pending_bytes", "_tokens", "value")

    def __init__(self, value: float = DEFAULT_BYTES_PER_TOKEN) -> None:
        self.value = value
        self._applied = value  # the value sizes were last derived from
        self._pending_bytes: dict[str, int] = {}  # CBR bytes sent since the backend's last counted sample
        self._tokens: dict[str, float] = {}  # the engine's prompt-token counter at that sample

    def sent(self, backend: str, cbr_bytes: int) -> None:
        """kvroute routed a prompt of this many CBR bytes to the backend."""
        if backend in self._tokens:
            self._pending_bytes[backend] = self._pending_bytes.get(backend, 0) + cbr_bytes

    def engine_tokens(self, backend: str, prompt_tokens: float) -> bool:
        """The engine's prompt-token counter; True if the estimate moved more than 5% away from the
        value sizes were last derived from (which it then becomes)."""
        before = self._tokens.get(backend)
        if before is None or prompt_tokens < before:  # first sample, or a restarted engine
            self._tokens[backend] = prompt_tokens
            self._pending_bytes[backend] = 0
            return False
        tokens = prompt_tokens - before
        if tokens < MIN_TOKENS:
            return False  # wait for more, keep accumulating
        sent = self._pending_bytes.get(backend, 0)
        self._tokens[backend] = prompt_tokens
        self._pending_bytes[backend] = 0
        if sent <= 0:
            return False
        observed = min(HIGHEST, max(LOWEST, sent / tokens))
        self.value += WEIGHT * (observed - self.value)
        if abs(self.value - self._applied) <= 0.05 * self._applied:
            return False
        self._applied = self.value
        return True

    def forget(self, backend: str) -> None:
        self._pending_bytes.pop(backend, None)
        self._tokens.pop(backend, None)
