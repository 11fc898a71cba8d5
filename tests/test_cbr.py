"""CBR: prefix-preserving, deterministic, blind to generation-only fields, strict on bad input."""

from __future__ import annotations

import contextlib
import re

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.core.chain import BlockHasher
from extproc.core.errors import InvalidRequest
from extproc.core.request import parse_request
from tests.strategies import generation, json_values, messages, shaping

HASHER = BlockHasher(64, b"0123456789abcdef")


def cbr(body: dict) -> bytes:
    return parse_request(body).cbr


@given(shaping, st.lists(messages(), max_size=6), st.lists(messages(), max_size=6), generation, generation)
def test_continuation_is_a_byte_extension(base, history, more, gen_a, gen_b):
    a = {**base, **gen_a, "messages": history}
    b = {**base, **gen_b, "messages": history + more}
    assert cbr(b).startswith(cbr(a))


@given(shaping, st.lists(messages(), min_size=1, max_size=4), generation)
def test_generation_only_fields_do_not_change_the_prompt(base, history, gen):
    assert cbr({**base, "messages": history}) == cbr({**base, **gen, "messages": history})


@given(shaping, st.lists(messages(), min_size=1, max_size=4), st.text(max_size=20))
def test_another_model_shares_no_block(base, history, other):
    a = {**base, "messages": history}
    b = {**a, "model": base["model"] + "-x" + other}
    chain_a, chain_b = HASHER.chain(cbr(a)), HASHER.chain(cbr(b))
    assert not set(chain_a) & set(chain_b)


@given(shaping, st.lists(messages(), min_size=1, max_size=4))
def test_another_tool_shares_no_block(base, history):
    long_tools = [{"type": "function", "function": {"name": f"t{i}", "description": "d" * 300}} for i in range(5)]
    a = {**base, "tools": long_tools, "messages": history}
    changed = [*long_tools[:-1], {"type": "function", "function": {"name": "t4", "description": "e" * 300}}]
    b = {**a, "tools": changed}
    chain_a, chain_b = HASHER.chain(cbr(a)), HASHER.chain(cbr(b))
    assert len(chain_a) > 20
    assert not set(chain_a) & set(chain_b)


def test_tool_order_matters_but_key_order_does_not():
    t1 = {"type": "function", "function": {"name": "a", "description": "x"}}
    t2 = {"type": "function", "function": {"name": "b", "description": "y"}}
    t1_reordered = {"function": {"description": "x", "name": "a"}, "type": "function"}
    msgs = [{"role": "user", "content": "hi"}]
    assert cbr({"model": "m", "tools": [t1, t2], "messages": msgs}) != cbr(
        {"model": "m", "tools": [t2, t1], "messages": msgs}
    )
    assert cbr({"model": "m", "tools": [t1, t2], "messages": msgs}) == cbr(
        {"model": "m", "tools": [t1_reordered, t2], "messages": msgs}
    )


def test_text_content_string_equals_single_text_part():
    plain = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
    parts = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]}
    assert cbr(plain) == cbr(parts)


def test_message_boundaries_are_unambiguous():
    two = {"model": "m", "messages": [{"role": "user", "content": "ab"}, {"role": "user", "content": "c"}]}
    one = {"model": "m", "messages": [{"role": "user", "content": "abc"}]}
    split = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "ab"}, "c"]}]}
    assert len({cbr(two), cbr(one), cbr(split)}) == 3


def test_inline_image_is_digested_and_distinguished():
    def body(url: str) -> dict:
        return {
            "model": "m",
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}],
        }

    big = "data:image/png;base64," + "A" * 1_000_000
    assert len(cbr(body(big))) < 1000
    assert cbr(body(big)) != cbr(body(big[:-1] + "B"))
    assert b"https://img/x.png" in cbr(body("https://img/x.png"))


def test_extension_fields_shape_the_prompt_in_sorted_order():
    msgs = [{"role": "user", "content": "hi"}]
    a = cbr({"model": "m", "cache_salt": "s1", "z": 1, "a": 2, "messages": msgs})
    b = cbr({"model": "m", "a": 2, "z": 1, "cache_salt": "s1", "messages": msgs})
    c = cbr({"model": "m", "a": 2, "z": 1, "cache_salt": "s2", "messages": msgs})
    assert a == b != c


def test_chat_and_completion_never_collide():
    assert cbr({"model": "m", "prompt": "hi"}) != cbr({"model": "m", "messages": [{"role": "user", "content": "hi"}]})


@pytest.mark.parametrize(
    "prompt", ["text", ["a", "b"], [1, 2, 3], [[1, 2], [3]]], ids=["text", "texts", "tokens", "token-lists"]
)
def test_completion_prompts(prompt):
    request = parse_request({"model": "m", "prompt": prompt, "max_tokens": 3})
    assert request.cbr and not request.followup


@given(st.text(min_size=1, max_size=2000), st.text(min_size=1, max_size=200))
def test_texts_sharing_a_start_share_its_blocks(common, rest):
    """Completions (or one long message) sharing a beginning share every block before it ends."""
    a = HASHER.chain(cbr({"model": "m", "prompt": common}))
    b = HASHER.chain(cbr({"model": "m", "prompt": common + rest}))
    header = len(cbr({"model": "m", "prompt": ""})) - 2
    shared_bytes = header + len(common.encode().replace(b"\0", b"\0\1"))
    assert a[: shared_bytes // 64] == b[: shared_bytes // 64]


def test_followup_is_detected_by_assistant_or_tool_turns():
    assert not parse_request(
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}
    ).followup
    assert parse_request(
        {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}
    ).followup
    assert parse_request({"messages": [{"role": "tool", "content": "r", "tool_call_id": "1"}]}).followup


BAD_BODIES = {
    "not-json": b"{not json",
    "array": b"[1, 2]",
    "string": b'"hello"',
    "messages-not-list": b'{"model": "m", "messages": {"role": "user"}}',
    "message-not-object": b'{"messages": ["hi"]}',
    "role-not-string": b'{"messages": [{"role": 3, "content": "x"}]}',
    "content-number": b'{"messages": [{"role": "user", "content": 5}]}',
    "part-without-type": b'{"messages": [{"role": "user", "content": [{"text": "x"}]}]}',
    "model-not-string": b'{"model": 1, "messages": []}',
    "invalid-utf8": b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}',
    "lone-surrogate": b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
    "deep-nesting": b'{"messages": [], "x": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    "neither-prompt-nor-messages": b'{"model": "m"}',
    "prompt-bad-type": b'{"prompt": {"a": 1}}',
    "prompt-negative-token": b'{"prompt": [1, -2]}',
}


@pytest.mark.parametrize("raw", BAD_BODIES.values(), ids=BAD_BODIES.keys())
def test_bad_bodies_raise_invalid_request(raw):
    with pytest.raises(InvalidRequest):
        parse_request(raw)


@pytest.mark.parametrize(
    ("message", "where"),
    [
        ({"role": 3}, "messages[1]: 'role'"),
        ({"role": "user", "name": 3}, "messages[1]: 'name'"),
        ({"role": "user", "content": "\ud800"}, "messages[1]: text is not valid UTF-8"),
        ({"role": "user", "content": [{"type": "text"}]}, "messages[1].content[0]: a text part"),
        ({"role": "user", "content": ["ok", 7]}, "messages[1].content[1]: a content part"),
        ({"role": "tool", "tool_call_id": 1}, "messages[1]: 'tool_call_id'"),
        ({"role": "user", "content": "x", "ext": {1: 2}}, "messages[1]: cannot be encoded"),
    ],
)
def test_an_invalid_message_is_named_where_it_is(message, where):
    """Where an error is gets spelled out only on the error path (encoding runs per message)."""
    body = {"model": "m", "messages": [{"role": "system", "content": "fine"}, message]}
    with pytest.raises(InvalidRequest, match=re.escape(where)):
        parse_request(body)


def test_python_objects_that_json_cannot_hold_are_invalid():
    with pytest.raises(InvalidRequest):
        parse_request({"model": "m", "messages": [], "ext": {1: "non-str key"}})
    with pytest.raises(InvalidRequest):
        parse_request({"model": "m", "messages": [{"role": "user", "content": "\ud800"}]})
    deep: list = []
    for _ in range(300):
        deep = [deep]
    with pytest.raises(InvalidRequest):
        parse_request({"model": "m", "messages": [], "ext": deep})
    with pytest.raises(InvalidRequest):
        parse_request(12345)  # type: ignore[arg-type]


def test_a_body_of_more_arrays_and_objects_than_a_prompt_has_is_refused_before_it_is_decoded(monkeypatch):
    """27 MiB of nested empty arrays decoded into 1.1 GiB and held the loop for seconds; now a body
    past the bound is refused from its brackets (inside strings too: an overestimate), and the
    collector is back on after every decode."""
    import gc

    from extproc.core import request

    monkeypatch.setattr(request, "MAX_JSON_CONTAINERS", 1000)
    nested = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": [[]] * 1500}]})
    for raw in (nested, nested.decode()):
        with pytest.raises(InvalidRequest, match="more than 1000 arrays and objects"):
            parse_request(raw)
    text = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "[{" * 400 + "x" * 3000}]})
    assert parse_request(text).model == "m"  # 803 brackets in 3,859 bytes: under the bound
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        parse_request(b"{" * 900 + b"x" * 2000)
    assert gc.isenabled()


@given(json_values)
def test_any_json_value_parses_or_raises_invalid_request(value):
    for body in (
        value,
        {"messages": value},
        {"prompt": value},
        {"messages": [value]},
        {"messages": [{"role": "user", "content": value}]},
    ):
        try:
            request = parse_request(orjson.dumps(body))
        except InvalidRequest:
            continue
        assert isinstance(request.cbr, bytes)


@given(st.binary(max_size=200))
def test_any_bytes_parse_or_raise_invalid_request(raw):
    with contextlib.suppress(InvalidRequest):
        parse_request(raw)


def test_encoding_stops_at_its_budget_and_keeps_the_head():
    from extproc.core.cbr import MAX_RECORDS

    parts = [{"type": "text", "text": ""} for _ in range(MAX_RECORDS + 10)]
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "the shared head"}, {"role": "user", "content": parts}],
    }
    request = parse_request(orjson.dumps(body))
    assert request.truncated
    head = parse_request({"model": "m", "messages": [{"role": "user", "content": "the shared head"}]})
    assert request.cbr.startswith(head.cbr) and not head.truncated


def test_unknown_fields_enter_the_prompt_as_a_digest_only():
    junk = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "x_junk": "j" * (8 * 1024 * 1024)}
    other = {**junk, "x_junk": "k" * (8 * 1024 * 1024)}
    encoded, different = parse_request(junk).cbr, parse_request(other).cbr
    assert len(encoded) < 200 and encoded != different  # the field still shapes the key, in 16 bytes


def test_a_body_past_the_budget_costs_no_more_than_the_budget():
    """Token ids past MAX_BYTES, or more header fields than MAX_FIELDS, stop the encoding before
    they are read (the request routes on what fit: truncated). Before, 16 million ids were packed
    one by one (2.9 s, 948 MiB) and then thrown away for being past the budget."""
    import tracemalloc

    from extproc.core import cbr

    ids = list(range(3_000_000))  # 12 MB packed: past the 8 MiB budget
    fields = {f"k{i}": 0 for i in range(100_000)}
    for body in ({"model": "m", "prompt": ids}, {"model": "m", "prompt": "p", **fields}):
        tracemalloc.start()
        try:
            _, _, truncated = cbr.encode(body)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert truncated and peak < 2_000_000, peak
    small, _, cut = cbr.encode({"model": "m", "prompt": [1, 2, 3]})
    assert not cut and b"\x01\x00\x00\x00\x02\x00\x00\x00\x03" in small.replace(b"\x00\x01", b"\x00")
    for bad in ([1.5], [-1], [2**32], [1, "a"], [[1, None]]):
        with pytest.raises(InvalidRequest):
            cbr.encode({"model": "m", "prompt": bad})
