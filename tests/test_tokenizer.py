"""Precise mode's tokenizer: the model's own tokenizer and chat template, with a piece cache that
never changes the result."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.harness.tiny_model import tokenizer_files
from bench.workload import text
from extproc.core.backends import Backend
from extproc.core.engine import BlockStored
from extproc.core.router import Router
from extproc.core.settings import Settings
from extproc.vllm.index_mode import IndexModeSwitch
from extproc.vllm.tokenizer import ChatTokenizer, TokenizerError

A = "10.0.0.1:8000"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tokenizer")
    tokenizer_files(directory)
    return directory


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> ChatTokenizer:
    return ChatTokenizer(model_dir)


def whole(tokenizer: ChatTokenizer, body: dict) -> list[int]:
    rendered = tokenizer.render(body)
    assert rendered is not None
    return tokenizer._tokenizer.encode(rendered, add_special_tokens=False).ids


def test_the_tiny_models_template_renders_like_the_engine(tokenizer: ChatTokenizer):
    body = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}
    assert tokenizer.render(body) == "<|system|>\nbe brief<|end|>\n<|user|>\nhi<|end|>\n<|assistant|>\n"
    assert tokenizer.render({**body, "add_generation_prompt": False}).endswith("hi<|end|>\n")
    parts = {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    assert tokenizer.render({"messages": [parts]}) == "<|user|>\na\nb<|end|>\n<|assistant|>\n"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(max_size=200), min_size=1, max_size=6))
def test_piece_tokenization_equals_whole_prompt_tokenization(tokenizer: ChatTokenizer, contents: list[str]):
    assert tokenizer.segmented
    messages = [{"role": ("user", "assistant")[i % 2], "content": c} for i, c in enumerate(contents)]
    body = {"messages": messages}
    assert list(tokenizer.tokens(body) or []) == whole(tokenizer, body)


def test_a_follow_up_turn_tokenizes_only_its_new_message(tokenizer: ChatTokenizer):
    rng = random.Random(3)
    messages = [{"role": "system", "content": text(rng, 5000)}, {"role": "user", "content": text(rng, 800)}]
    first = list(tokenizer.tokens({"messages": messages}) or [])
    before = tokenizer.pieces_tokenized
    messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": text(rng, 300)}]
    second = list(tokenizer.tokens({"messages": messages}) or [])
    assert tokenizer.pieces_tokenized - before == 2  # the two new messages' texts
    assert second[: len(first) - 2] == first[:-2]  # the old turn (minus the generation prompt) is a prefix
    assert second == whole(tokenizer, {"messages": messages})


def test_what_cannot_be_tokenized_exactly_is_refused(tokenizer: ChatTokenizer):
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}
    assert tokenizer.tokens({"messages": [image]}) is None
    assert tokenizer.tokens({"messages": "not a list"}) is None
    assert tokenizer.tokens({"messages": [{"content": "no role"}]}) is None
    assert tokenizer.tokens({"prompt": [1, 2, 3]}) == [1, 2, 3]  # token ids pass through
    assert tokenizer.tokens({"prompt": 12}) is None


def test_the_piece_cache_is_bounded(model_dir: Path):
    small = ChatTokenizer(model_dir, cache_tokens=500)
    rng = random.Random(4)
    for _ in range(20):
        small.tokens({"messages": [{"role": "user", "content": text(rng, 600)}]})
    assert 0 < small.cached_tokens <= 500


def test_short_pieces_are_bounded_by_what_their_entries_take_and_a_runaway_render_is_not_tokenized(
    model_dir: Path,
):
    """Thousands of one-word messages: each cached piece counts its entry's own size against the
    bound (counted by tokens alone, short pieces made it hold 54 bytes a token). And a prompt a
    template grew far past its request (tools rendered as JSON indented by depth) is left
    untokenized instead of costing seconds; the same tokens come out of the GIL-free encoder."""
    from extproc.vllm import tokenizer as module

    small = ChatTokenizer(model_dir, cache_tokens=10_000)
    for i in range(2_000):
        small.tokens({"messages": [{"role": "user", "content": f"w{i}"}]})
    pieces = len(small._cache)
    assert small.cached_tokens <= 10_000 and pieces <= 10_000 // module.PIECE_TOKENS
    body = {"messages": [{"role": "user", "content": "x"}]}
    runaway = "y " * (module.RENDER_SLACK + 10_000)
    assert not ChatTokenizer._plausible(body, runaway) and ChatTokenizer._plausible(body, "y " * 100)
    text = "hello there, " * 50
    assert small._encode(text, False) == small._tokenizer.encode(text, add_special_tokens=False).ids


def test_a_missing_tokenizer_keeps_routing_approximate_and_says_why(tmp_path: Path, model_dir: Path):
    router = Router(Settings())
    mode = IndexModeSwitch(router)
    with pytest.raises(TokenizerError):
        ChatTokenizer(tmp_path)
    mode.apply(Settings(index_mode="precise", tokenizer_path=str(tmp_path)))
    assert not router.precise and mode.status.startswith("approximate (precise requested: cannot load")
    mode.apply(Settings(index_mode="precise"))
    assert not router.precise and "needs tokenizerPath" in mode.status
    mode.apply(Settings(index_mode="precise", tokenizer_path=str(model_dir)))
    assert router.precise and mode.status == "precise"
    mode.apply(Settings())
    assert not router.precise and mode.status == "approximate"


def test_precise_routing_finds_the_blocks_an_engine_reported(tokenizer: ChatTokenizer):
    router = Router(Settings())
    router.use_precise(tokenizer)
    rng = random.Random(5)
    body = {"model": "m", "messages": [{"role": "user", "content": text(rng, 3000)}]}
    tokens = list(tokenizer.tokens(body) or [])
    size = 16
    full = len(tokens) // size
    router.engine_events(A, [BlockStored(tuple(range(1, full + 1)), None, tuple(tokens[: full * size]), size, ())])
    decision = router.query(router.parse(body, {}), [Backend(A), Backend("10.0.0.2:8000")], 0)
    assert decision.backend == A and decision.matched_blocks == full == decision.total_blocks
    salted = router.parse({**body, "cache_salt": "other-tenant"}, {})
    assert router.query(salted, [Backend(A)], 0).matched_blocks == 0


def test_a_policys_change_to_precise_reads_the_tokenizer_off_the_loop(model_dir: Path, monkeypatch):
    """While routing, the tokenizer is read in a worker thread (a large vocabulary's file held every
    stream for as long on the loop), and a change that comes meanwhile supersedes it."""
    import threading

    from extproc.vllm import index_mode

    threads = []
    load = index_mode._load

    def spied(path: str):
        threads.append(threading.current_thread() is threading.main_thread())
        return load(path)

    monkeypatch.setattr(index_mode, "_load", spied)
    precise = Settings(index_mode="precise", tokenizer_path=str(model_dir))

    async def main() -> None:
        router = Router(Settings())
        mode = IndexModeSwitch(router)
        assert await mode.follow(precise) is None
        assert router.precise and mode.status == "precise" and threads == [False]
        mode._approximate()
        first = asyncio.ensure_future(mode.follow(precise))
        await asyncio.sleep(0)  # its load under way
        assert await mode.follow(Settings()) is None and await first is None
        assert not router.precise and mode.status == "approximate"  # the later change holds
        missing = await mode.follow(Settings(index_mode="precise", tokenizer_path=str(model_dir / "none")))
        assert missing is not None and missing.startswith("routing approximate") and not router.precise

    asyncio.run(main())
