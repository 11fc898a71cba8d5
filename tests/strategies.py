"""Hypothesis strategies for OpenAI-style request bodies."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

texts = st.text(max_size=300)
roles = st.sampled_from(["system", "user", "assistant", "tool"])

parts = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, texts),
    st.builds(
        lambda u: {"type": "image_url", "image_url": {"url": u}},
        st.sampled_from(["https://x/a.png", "data:image/png;base64,AAAA", "data:image/png;base64,BBBB"]),
    ),
)


@st.composite
def messages(draw: st.DrawFn) -> dict[str, Any]:
    message: dict[str, Any] = {"role": draw(roles)}
    message["content"] = draw(st.one_of(texts, st.lists(parts, max_size=3), st.none()))
    if draw(st.booleans()):
        message["name"] = draw(st.text(max_size=10))
    if message["role"] == "assistant" and draw(st.booleans()):
        message["tool_calls"] = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": draw(texts)}}]
    if message["role"] == "tool":
        message["tool_call_id"] = draw(st.text(max_size=8))
    return message


tools = st.lists(
    st.builds(
        lambda name, desc: {"type": "function", "function": {"name": name, "description": desc}},
        st.text(min_size=1, max_size=12),
        texts,
    ),
    max_size=3,
)

shaping = st.fixed_dictionaries(
    {"model": st.text(max_size=20)},
    optional={
        "tools": tools,
        "tool_choice": st.sampled_from(["auto", "none", "required"]),
        "chat_template_kwargs": st.dictionaries(st.text(max_size=8), st.booleans(), max_size=2),
        "response_format": st.just({"type": "json_object"}),
        "x_extension": st.integers(-(2**63), 2**63 - 1),
    },
)
generation = st.fixed_dictionaries(
    {},
    optional={
        "temperature": st.floats(0, 2),
        "max_tokens": st.integers(1, 4096),
        "stream": st.booleans(),
        "seed": st.integers(0, 2**63 - 1),
        "stop": st.lists(st.text(max_size=4), max_size=2),
        "user": st.text(max_size=8),
        "session_id": st.text(max_size=8),
    },
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=30,
)
