"""The prefill/decode hand-off's bodies (extproc/core/handoff.py): what each leg sends, and that
only a prefill server's own parameters, in vLLM's shape, reach a decode server."""

from __future__ import annotations

import orjson
from hypothesis import given
from hypothesis import strategies as st

from extproc.core import handoff

BODY = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
    "stream_options": {"include_usage": True},
    "max_completion_tokens": 64,
    "temperature": 0,
}
# what vLLM 0.32's NixlConnector returns from a prefill (pull_scheduler.request_finished)
PREFILLED = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[1, 2, 3]],
    "remote_engine_id": "be4aabf0",
    "remote_request_id": "cmpl-1-0",
    "remote_host": "10.0.0.1",
    "remote_port": 5600,
    "tp_size": 1,
    "dcp_size": 1,
    "pp_size": 1,
    "remote_num_tokens": 300,
    "remote_blocks_expiry_time": 1796160000.5,
    "transfer_mode": "pull",
}


def test_the_prefill_leg_asks_for_one_unstreamed_token_and_a_remote_decode():
    leg = orjson.loads(
        handoff.prefill_body({**BODY, "kv_transfer_params": {"remote_host": "6.6.6.6"}, "min_tokens": 5})
    )
    assert leg["kv_transfer_params"] == handoff.ASK_REMOTE_DECODE
    assert leg["max_tokens"] == 1 and leg["max_completion_tokens"] == 1
    assert "min_tokens" not in leg  # (vLLM refuses min_tokens above max_tokens)
    assert "stream" not in leg and "stream_options" not in leg
    assert leg["messages"] == BODY["messages"] and leg["temperature"] == 0


def test_the_decode_leg_is_the_clients_request_with_the_prefill_servers_parameters():
    parameters = handoff.decode_parameters({"kv_transfer_params": PREFILLED}, "10.0.0.1")
    assert parameters == PREFILLED
    leg = orjson.loads(handoff.decode_body({**BODY, "kv_transfer_params": {"x": 1}}, parameters))
    assert leg == {**BODY, "kv_transfer_params": PREFILLED}


def test_a_clients_own_parameters_are_stripped():
    body = {**BODY, "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "6.6.6.6"}}
    assert handoff.carries_parameters(body) and not handoff.carries_parameters(BODY)
    assert orjson.loads(handoff.strip(body)) == BODY


def test_only_a_prefill_servers_own_parameters_in_vllms_shape_pass():
    def passes(**change: object) -> bool:
        return handoff.decode_parameters({"kv_transfer_params": {**PREFILLED, **change}}, "10.0.0.1") is not None

    assert passes()
    assert not passes(remote_host="10.0.0.2")  # another host than the server that prefilled
    assert not passes(do_remote_prefill=False)
    assert not passes(remote_port=0) and not passes(remote_port="5600") and not passes(remote_port=True)
    assert not passes(remote_engine_id="") and not passes(remote_engine_id=7)
    assert not passes(remote_block_ids=[]) and not passes(remote_block_ids=[[1, -1]])
    assert not passes(remote_block_ids=[1, 2]) and not passes(remote_block_ids=[[True]])
    assert not passes(transfer_mode={"nested": 1}) and not passes(transfer_mode="x" * 257)
    assert not passes(**{f"extra{i}": i for i in range(handoff.MAX_FIELDS)})
    assert handoff.decode_parameters({}, "10.0.0.1") is None
    assert handoff.decode_parameters([], "10.0.0.1") is None
    v6 = {**PREFILLED, "remote_host": "[fd00::1]"}
    assert handoff.decode_parameters({"kv_transfer_params": v6}, "fd00::1") is not None


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(), lambda c: st.lists(c) | st.dictionaries(st.text(), c)
    )
)
def test_any_response_gives_parameters_naming_the_prefill_server_or_none(response):
    for shape in (response, {"kv_transfer_params": response}):
        out = handoff.decode_parameters(shape, "10.0.0.1")
        assert out is None or (out["remote_host"].strip("[]") == "10.0.0.1" and out["do_remote_prefill"] is True)
