"""extproc/envoy/messages.py: the ext_proc protocol's readers and builders, alone."""

from __future__ import annotations

import pytest
from google.protobuf import struct_pb2

from extproc.envoy import messages as msg
from extproc.envoy.headers import DESTINATION_HEADER, LB_NAMESPACE, SUBSET_KEY, SUBSET_NAMESPACE
from extproc.envoy.processor import Phase, Stream
from extproc.envoy.proto import ext_proc_pb2 as pb


def hinted(value: struct_pb2.Value) -> pb.ProcessingRequest:
    message = pb.ProcessingRequest()
    message.metadata_context.filter_metadata[SUBSET_NAMESPACE].fields[SUBSET_KEY].CopyFrom(value)
    return message


def test_a_subset_hint_is_a_list_or_a_comma_separated_string_and_is_bounded():
    listed = struct_pb2.Value(list_value=struct_pb2.ListValue(values=[struct_pb2.Value(string_value="10.0.0.1:80")]))
    assert msg.subset(hinted(listed)) == {"10.0.0.1:80"}
    assert msg.subset(hinted(struct_pb2.Value(string_value=" 10.0.0.1:80, 10.0.0.2:80 ,"))) == {
        "10.0.0.1:80",
        "10.0.0.2:80",
    }
    many = ",".join(f"10.0.{i // 256}.{i % 256}:80" for i in range(msg.MAX_SUBSET + 10))
    assert len(msg.subset(hinted(struct_pb2.Value(string_value=many))) or ()) == msg.MAX_SUBSET
    assert msg.subset(pb.ProcessingRequest()) is None


def test_the_destination_goes_in_the_header_and_the_lb_metadata():
    reply = pb.ProcessingResponse()
    reply.request_body.response.header_mutation.CopyFrom(msg.destination("10.0.0.1:80"))
    msg.with_destination(reply, "10.0.0.1:80")
    (set_header,) = reply.request_body.response.header_mutation.set_headers
    assert (set_header.header.key, set_header.header.raw_value) == (DESTINATION_HEADER, b"10.0.0.1:80")
    lb = reply.dynamic_metadata.fields[LB_NAMESPACE].struct_value
    assert lb.fields[DESTINATION_HEADER].string_value == "10.0.0.1:80"


def test_a_held_body_goes_back_in_chunks_the_last_ending_the_stream():
    body = b"x" * (2 * msg.CHUNK_BYTES + 1)
    pieces = msg.chunks("request_body", body, end_of_stream=True)
    streamed = [p.request_body.response.body_mutation.streamed_response for p in pieces]
    assert b"".join(s.body for s in streamed) == body and [s.end_of_stream for s in streamed] == [False, False, True]
    assert len(msg.chunks("request_body", b"", end_of_stream=False)) == 1  # an empty body is still answered


def test_what_ends_a_response():
    assert msg.response_ended(pb.ProcessingRequest(response_headers=pb.HttpHeaders(end_of_stream=True)))
    assert not msg.response_ended(pb.ProcessingRequest(response_body=pb.HttpBody(end_of_stream=False)))
    assert msg.response_ended(pb.ProcessingRequest(response_trailers=pb.HttpTrailers()))


def test_a_stream_moves_only_in_the_protocols_order():
    stream = Stream()
    stream.advance(Phase.BODY)
    stream.advance(Phase.HOLDING)
    with pytest.raises(RuntimeError, match="from holding to body"):
        stream.advance(Phase.BODY)
    stream.advance(Phase.DECIDED)
    with pytest.raises(RuntimeError, match="from decided to holding"):
        stream.advance(Phase.HOLDING)
