"""How many bytes of canonical prompt (CBR) the engines count as one token, learned online.

The approximate index counts in CBR blocks, the engines in tokens: a KV cache of N tokens holds
about N x bytes_per_token / block_size blocks, and a prefix of k blocks is about
k x block_size / bytes_per_token cached tokens, which is what kvroute predicts for a request.
4 bytes a token is right for English with large BPE vocabularies; a smaller vocabulary, code or
other languages differ (the tiny test model's is about 3.4). The ratio is learned from the CBR
bytes kvroute sends each backend against the prompt tokens the engine reports
(`vllm:request_prompt_tokens_sum`, counted when requests finish: windows between samples do not
line up exactly with what was sent, but their sums do); traffic kvroute did not send only adds
tokens, so it errs low. A window spans several requests and the sums start from a prior at the
default ratio: the engine may count requests whose end kvroute has not seen yet, so a first
window of a few requests must not set the ratio alone (what that did: docs/benchmarks.md,
"Bytes per token: a prior"). With several replicas, each also counts
the bytes its siblings sent (`add`, from their published totals `sent`): the engine's counter
sees every replica's requests.
"""

from __future__ import annotations

from extproc.core.departures import RecentlyLeft

DEFAULT_BYTES_PER_TOKEN = 4.0
LOWEST, HIGHEST = 1.0, 16.0  # beyond these an observation is a measurement error, not a tokenizer
WEIGHT = 0.1  # decay of the sums per window: about the last ten windows count
MIN_TOKENS = 16_384  # an observation over fewer tokens is noise
PRIOR_TOKENS = 32_768  # the default ratio counts as this many tokens seen until windows outweigh it


class BytesPerToken:
    """A running estimate for the fleet (one model): the ratio of exponentially decayed sums of
    the CBR bytes of requests that ended on each backend and the prompt tokens its engine counted
    for finished requests, both taken when requests end so the two sums line up."""

    __slots__ = ("_bytes", "_left", "_pending_bytes", "_tokens", "_total_tokens", "sent", "value")

    def __init__(self, value: float = DEFAULT_BYTES_PER_TOKEN) -> None:
        self.value = value
        self._pending_bytes: dict[str, int] = {}  # CBR bytes of requests ended since the last window
        self._tokens: dict[str, float] = {}  # the engine's prompt-token counter at the last window
        self._bytes = PRIOR_TOKENS * value  # decayed sums over windows, from the prior
        self._total_tokens = float(PRIOR_TOKENS)
        self.sent: dict[str, int] = {}  # CBR bytes of this replica's requests that ended, per backend, ever
        # backends that left: their requests still streaming then end later, and must not bring
        # their entries back (one more for every backend a rollout replaced)
        self._left = RecentlyLeft()

    def ended(self, backend: str, cbr_bytes: int) -> None:
        """A request of this many CBR bytes that this replica sent to the backend ended."""
        if backend in self._left:
            return
        self.sent[backend] = self.sent.get(backend, 0) + cbr_bytes
        self.add(backend, cbr_bytes)

    def add(self, backend: str, cbr_bytes: int) -> None:
        """CBR bytes of requests that ended on the backend, this replica's or a sibling's."""
        if backend in self._tokens:
            self._pending_bytes[backend] = self._pending_bytes.get(backend, 0) + cbr_bytes

    def engine_tokens(self, backend: str, prompt_tokens: float) -> None:
        """The engine's prompt-token counter, from one of its samples."""
        self._left.back(backend)  # (in the pool again: its engine is sampled)
        before = self._tokens.get(backend)
        if before is None or prompt_tokens < before:  # first sample, or a restarted engine
            self._tokens[backend] = prompt_tokens
            self._pending_bytes[backend] = 0
            return
        tokens = prompt_tokens - before
        if tokens < MIN_TOKENS:
            return  # wait for more, keep accumulating
        self._tokens[backend] = prompt_tokens
        self._bytes = self._bytes * (1 - WEIGHT) + self._pending_bytes.pop(backend, 0)
        self._pending_bytes[backend] = 0
        self._total_tokens = self._total_tokens * (1 - WEIGHT) + tokens
        self.value = min(HIGHEST, max(LOWEST, self._bytes / self._total_tokens))

    def forget(self, backend: str) -> None:
        self._pending_bytes.pop(backend, None)
        self._tokens.pop(backend, None)
        self.sent.pop(backend, None)
        self._left.left(backend)
