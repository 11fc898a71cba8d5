"""The engine's count of a request's cached tokens, read from its response body chunk by chunk."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.core.usage import CachedTokens

USAGE = {"prompt_tokens": 4096, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 3968}}
JSON_BODY = orjson.dumps({"choices": [{"message": {"content": '"cached_tokens": 7'}}], "usage": USAGE})
SSE_BODY = (
    b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n'
    b'data: {"choices":[],"usage":' + orjson.dumps(USAGE) + b"}\n\ndata: [DONE]\n\n"
)


def read(body: bytes, cuts: list[int]) -> list[int]:
    scanner, found, start = CachedTokens(), [], 0
    for end in [*sorted(cuts), len(body)]:
        value = scanner.feed(body[start:end])
        if value is not None:
            found.append(value)
        start = end
    return found


@given(st.sampled_from([JSON_BODY, SSE_BODY]), st.lists(st.integers(0, len(SSE_BODY)), max_size=12))
def test_the_count_is_found_once_however_the_body_is_cut(body: bytes, cuts: list[int]):
    assert read(body, [c for c in cuts if c <= len(body)]) == [3968]


@pytest.mark.parametrize("step", [1, 2, 5, 17])
def test_a_count_split_across_every_seam_is_found(step: int):
    body = b'{"usage":{"prompt_tokens_details":{"cached_tokens": 123456789}}}'
    assert read(body, list(range(step, len(body), step))) == [123456789]


def test_generated_text_naming_the_key_is_not_the_count_and_a_body_without_it_gives_none():
    text_only = orjson.dumps({"choices": [{"message": {"content": '{"cached_tokens": 5}'}}], "usage": {}})
    assert read(text_only, []) == []
    assert read(b'{"usage":{"prompt_tokens_details":{"cached_tokens":null}}}', []) == []
    assert read(b'{"usage":{"prompt_tokens_details":{"cached_tokens":1234567890123}}}', []) == []  # past 12 digits
