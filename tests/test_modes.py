"""The index modes behind their seam (extproc/core/modes.py), through the router's lifecycle."""

from __future__ import annotations

from extproc.core.backends import Backend
from extproc.core.engine import BlockStored
from extproc.core.exchange import ResponseStart
from extproc.core.modes import ApproximateMode, PreciseMode
from extproc.core.request import PromptRequest, parse_request
from extproc.core.router import Router
from extproc.core.settings import Settings

A = "10.0.0.1:8000"
STREAMED = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x " * 4000}]}


def test_approximate_mode_holds_a_streamed_prefill_for_progress_until_another_mode_takes_over():
    router = Router(Settings(hash_key=b"test-key-16bytes"))
    assert isinstance(router.mode, ApproximateMode) and router.state().index == "approximate"
    router.engine_events(A, [BlockStored((1,), None, (0,) * 16, 16, ())])  # A's events report progress
    exchange = router.begin(parse_request(STREAMED, {}), [Backend(A)], 0.0)
    router.response_started(exchange, ResponseStart(A, known=True, status=200, from_upstream=True), 0.0)
    held = router.loads.snapshot()[A][0]
    assert held > 0  # the response started before the prefill: the engine's progress releases it
    router.use_precise(tokenizer=None)  # type: ignore[arg-type]  # no request is tokenized here
    assert isinstance(router.mode, PreciseMode) and router.state().index == "precise"
    assert router.loads.snapshot()[A] == (0, 1)  # precise mode never drains progress: released now
    assert exchange.end() and router.loads.snapshot()[A] == (0, 0)


def test_siblings_learning_applies_in_approximate_mode_only():
    router = Router(Settings(hash_key=b"test-key-16bytes"))
    router.peer_learned([11, 12], A, 0.0)
    assert router.index.entries_by_backend() == {A: 2}
    router.use_precise(tokenizer=None)  # type: ignore[arg-type]
    router.peer_learned([11, 12], A, 0.0)
    assert router.index.entries_by_backend() == {}  # every replica follows the engines' own events


def test_a_mode_of_its_own_goes_in_without_touching_the_router():
    class Recording(ApproximateMode):
        """An approximate picture that also counts what it was taught (a stand-in third mode)."""

        name = "recording"
        taught = 0

        def learn(self, request: PromptRequest, backend: str, now: float) -> tuple[int, list[int] | None]:
            Recording.taught += 1
            return super().learn(request, backend, now)

    router = Router(Settings(hash_key=b"test-key-16bytes"))
    router.use(Recording)
    exchange = router.begin(parse_request(STREAMED, {}), [Backend(A)], 0.0)
    assert router.response_started(exchange, ResponseStart(A, known=True, status=200, from_upstream=True), 0.0).learned
    assert router.state().index == "recording" and Recording.taught == 1
    router.use_approximate()  # back: another class than the approximate one
    assert type(router.mode) is ApproximateMode


def test_precise_mode_releases_the_prefill_it_holds_when_another_mode_takes_over():
    router = Router(Settings(hash_key=b"test-key-16bytes"))
    router.use_precise(tokenizer=None)  # type: ignore[arg-type]  # tokens are set by hand below
    router.index.block_size = 4  # type: ignore[attr-defined]  # as the engines' first sample says
    request = parse_request(STREAMED, {})
    request.tokens = list(range(12))
    exchange = router.begin(request, [Backend(A)], 0.0)
    assert router.loads.snapshot()[A][0] == 3  # held until the engine stores the prompt's last block
    router.use_precise(tokenizer=None)  # type: ignore[arg-type]  # (a new tokenizer path: a new picture)
    assert router.loads.snapshot()[A] == (0, 1)  # the new picture would never release it
    assert exchange.end()


def test_a_new_block_size_keeps_what_precise_mode_learned_from_the_engines_and_a_new_key_does_not():
    """The engines report only blocks they newly store: a precise picture emptied by a setting it
    does not use (kvroute's own text block size) would miss every prefix they still hold."""
    router = Router(Settings(hash_key=b"test-key-16bytes"))
    router.use_precise(tokenizer=None)  # type: ignore[arg-type]
    router.engine_events(A, [BlockStored((1, 2), None, (0,) * 32, 16, ())])
    assert router.index.entries_by_backend() == {A: 2}
    router.reconfigure(Settings(hash_key=b"test-key-16bytes", block_size=256))
    assert router.index.entries_by_backend() == {A: 2} and isinstance(router.mode, PreciseMode)
    router.reconfigure(Settings(hash_key=b"another-key-16by", block_size=256))
    assert router.index.entries_by_backend() == {}
