"""The ext_proc's per-message logic on real protobuf messages and a real router (no Envoy)."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from google.protobuf.struct_pb2 import Struct
from prometheus_client import CollectorRegistry

from extproc.core.backends import Backend, Role
from extproc.core.decision import Label
from extproc.core.objectives import ENGINE_PRIORITY_HEADER
from extproc.core.router import Router
from extproc.core.settings import Settings
from extproc.envoy import messages as msg
from extproc.envoy.headers import DESTINATION_HEADER, PENDING_HEADER
from extproc.envoy.processor import Phase, Processor, Stream
from extproc.envoy.proto import ext_proc_pb2 as pb
from extproc.runtime.metrics import Metrics
from extproc.runtime.pool import BackendPool
from extproc.runtime.prefill import PrefillLegs
from extproc.runtime.waiting_room import WaitingRoom, WaitingRoomMetrics

A, B = "10.0.0.1:8000", "10.0.0.2:8000"
BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 3000}]})


@pytest.fixture
def parts():
    router = Router(Settings(hash_key=b"k" * 16, decision_headers=True))
    pool = BackendPool([Backend(A), Backend(B)], router.remove_backend, unhealthy_after=2)
    metrics = Metrics(router, pool)
    return router, pool, metrics, Processor(router, pool, metrics, clock=lambda: 100.0, fallback=True)


def request_headers(path: str = "/v1/chat/completions", method: str = "POST", eos: bool = False, **extra: str):
    headers = {":path": path, ":method": method, **extra}
    values = [pb.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]
    return pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=pb.HeaderMap(headers=values), end_of_stream=eos))


def response_headers(status: str, details: str, upstream: str) -> pb.ProcessingRequest:
    attributes = Struct()
    attributes.update({"response.code_details": details, "upstream.address": upstream})
    message = pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(
            headers=pb.HeaderMap(headers=[pb.HeaderValue(key=":status", raw_value=status.encode())])
        )
    )
    message.attributes["envoy.filters.http.ext_proc"].CopyFrom(attributes)
    return message


def body(data: bytes = BODY) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=True))


class Ending:
    """grpc's context: done callbacks run once the stream has ended."""

    def __init__(self) -> None:
        self.callbacks: list = []

    def add_done_callback(self, callback) -> None:
        self.callbacks.append(callback)


def broken(*_args: object, **_kwargs: object) -> object:
    """Stands in for any internal step, failing."""
    raise RuntimeError("boom")


def set_headers(mutation: pb.HeaderMutation) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


def test_routes_learns_and_releases(parts):
    router, _, _, processor = parts
    stream = Stream()
    unmarked = processor.handle(request_headers(), stream).request_headers.response
    # nothing could hold it (no flow control here): not marked pending, so a kvroute that dies
    # before the body's reply lets it go on unrouted
    assert not unmarked.header_mutation.set_headers and list(unmarked.header_mutation.remove_headers) == [
        DESTINATION_HEADER,
        ENGINE_PRIORITY_HEADER,  # a client's own never reaches an engine
    ]
    decided = processor.handle(body(), stream).request_body.response
    routed = decided.header_mutation
    assert list(routed.remove_headers) == [PENDING_HEADER] and decided.clear_route_cache
    assert set_headers(routed)[ENGINE_PRIORITY_HEADER] == "0"  # no objective: the default priority
    target = set_headers(routed)[DESTINATION_HEADER]
    first, second = target.split(",")
    assert {first, second} == {A, B}
    assert router.loads.snapshot()[first] == (5, 1)
    reply = processor.handle(response_headers("200", "via_upstream", first), stream)
    added = set_headers(reply.response_headers.response.header_mutation)
    assert added == {
        "x-kvroute-decision": "least_loaded",
        "x-kvroute-backend": first,
        "x-kvroute-prefix": "0/5",
        "x-kvroute-cached-tokens": "0",
    }
    assert router.loads.snapshot()[first] == (0, 1)
    assert router.index.entries_by_backend() == {first: 5}
    stream.close()
    stream.close()
    assert router.loads.snapshot()[first] == (0, 0)


def test_learns_where_the_response_really_came_from(parts):
    router, _, _, processor = parts
    stream = Stream()
    processor.handle(request_headers(), stream)
    _first, second = set_headers(processor.handle(body(), stream).request_body.response.header_mutation)[
        DESTINATION_HEADER
    ].split(",")
    reply = processor.handle(response_headers("200", "via_upstream", second), stream)
    assert set_headers(reply.response_headers.response.header_mutation)["x-kvroute-backend"] == second
    assert router.index.entries_by_backend() == {second: 5}
    assert router.stats.rerouted == 1


def test_the_destination_is_also_envoy_lb_metadata_and_a_gateway_reports_what_served(parts):
    # The endpoint-picker protocol: gateways read the destination from the header or from
    # `envoy.lb` dynamic metadata, and report the endpoint that served in that namespace.
    router, _, _, processor = parts
    stream = Stream()
    processor.handle(request_headers(), stream)
    reply = processor.handle(body(), stream)
    target = set_headers(reply.request_body.response.header_mutation)[DESTINATION_HEADER]
    lb = reply.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert lb[DESTINATION_HEADER].string_value == target
    served = target.split(",")[1]
    message = response_headers("200", "via_upstream", "")  # no upstream.address attribute from this gateway
    message.metadata_context.filter_metadata["envoy.lb"].update({"x-gateway-destination-endpoint-served": served})
    reply = processor.handle(message, stream)
    assert set_headers(reply.response_headers.response.header_mutation)["x-kvroute-backend"] == served
    assert router.index.entries_by_backend() == {served: 5}


def with_subset(message: pb.ProcessingRequest, subset: list[str] | str) -> pb.ProcessingRequest:
    message.metadata_context.filter_metadata["envoy.lb.subset_hint"].update(
        {"x-gateway-destination-endpoint-subset": subset}
    )
    return message


@pytest.mark.parametrize("subset", [[B, "10.9.9.9:8000"], f"{B}, 10.9.9.9:8000"])
def test_a_gateway_subset_hint_narrows_the_choice(parts, subset):
    _, _, _, processor = parts
    for _ in range(4):  # least loaded would alternate between A and B without the hint
        stream = Stream()
        processor.handle(with_subset(request_headers(), subset), stream)
        reply = processor.handle(body(), stream)
        assert set_headers(reply.request_body.response.header_mutation)[DESTINATION_HEADER] == B  # no second choice
        assert reply.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DESTINATION_HEADER].string_value == B


def test_a_subset_hint_is_read_as_the_pool_spells_addresses_and_no_further_than_its_bound():
    """An IPv6 backend hinted in another spelling is the same backend (it was refused: 503); a
    hint of millions of entries is split no further than MAX_SUBSET."""
    v6 = "[fd00::1]:8000"
    for spelling in ("[FD00::1]:8000", "[fd00:0:0::1]:8000", " [fd00::1]:8000 "):
        assert msg.subset(with_subset(request_headers(), spelling)) == {v6}
    assert msg.subset(with_subset(request_headers(), "not an address, 10.0.0.1:x")) == frozenset()
    huge = ",".join(f"10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}:8000" for i in range(msg.MAX_SUBSET + 50_000))
    hinted = msg.subset(with_subset(request_headers(), huge))
    assert hinted is not None and len(hinted) == msg.MAX_SUBSET


def test_a_subset_with_no_known_backend_is_answered_503(parts):
    router, _, metrics, processor = parts
    stream = Stream()
    processor.handle(with_subset(request_headers(), ["10.9.9.9:8000"]), stream)
    reply = processor.handle(body(), stream)
    assert reply.immediate_response.status.code == 503
    assert router.loads.snapshot() == {}  # nothing reserved
    assert metrics.errors.labels("no_subset_candidate")._value.get() == 1
    assert processor.handle(body(), stream) == pb.ProcessingResponse(request_body=pb.BodyResponse())  # decided once


def test_no_backend_means_no_destination_metadata(parts):
    _, pool, _, processor = parts
    pool.replace([])
    stream = Stream()
    processor.handle(request_headers(), stream)
    reply = processor.handle(body(), stream)
    assert not reply.HasField("dynamic_metadata")
    mutation = reply.request_body.response.header_mutation
    assert list(mutation.remove_headers) == [DESTINATION_HEADER, PENDING_HEADER]
    assert set_headers(mutation) == {ENGINE_PRIORITY_HEADER: "0"}  # wherever Envoy sends it, its priority


@pytest.mark.parametrize(
    ("status", "details", "upstream"),
    [
        ("500", "via_upstream", A),
        ("200", "ext_proc_error", A),
        ("200", "via_upstream", "203.0.113.9:80"),
        ("503", "upstream_reset_before_response_started{remote_connection_failure}", A),
    ],
)
def test_only_upstream_successes_from_known_backends_teach(parts, status, details, upstream):
    router, _, _, processor = parts
    stream = Stream()
    processor.handle(request_headers(), stream)
    processor.handle(body(), stream)
    processor.handle(response_headers(status, details, upstream), stream)
    assert router.state().index_entries == 0
    assert all(reserved == 0 for reserved, _ in router.loads.snapshot().values())


def test_a_refused_connection_only_makes_the_backend_suspect(parts):
    _, pool, _, processor = parts
    stream = Stream()
    processor.handle(request_headers(), stream)
    processor.handle(body(), stream)
    processor.handle(response_headers("503", "upstream_reset_before_response_started{connection_failure}", A), stream)
    assert pool.healthy_count() == 2  # one report wipes nothing
    assert pool._suspects == {A}  # the pool probes it at once (tests/test_pool.py)
    assert [b.healthy for b in pool.backends] == [False, True]  # and routes around it until then


def test_non_llm_paths_pass_through_to_a_known_backend_never_the_clients_choice(parts):
    """Not read, not learned from, not counted as decisions; but given the least loaded backend
    as destination (header and metadata), which also replaces a client's own header: gateways
    whose ORIGINAL_DST cluster connects only where the picker says need one."""
    router, _, metrics, processor = parts
    targets = set()
    for headers in (request_headers("/v1/models", "GET"), request_headers("/metrics", "POST")) * 2:
        reply = processor.handle(headers, Stream())
        assert reply.mode_override.request_body_mode == pb.ProcessingMode.NONE
        assert reply.mode_override.response_header_mode == pb.ProcessingMode.SKIP
        target = set_headers(reply.request_headers.response.header_mutation)[DESTINATION_HEADER]
        assert reply.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DESTINATION_HEADER].string_value == target
        targets.add(target)
    assert targets == {A, B}  # ties rotate
    spoofed = processor.handle(request_headers("/v1/models", "GET", **{DESTINATION_HEADER: "10.6.6.6:80"}), Stream())
    assert set_headers(spoofed.request_headers.response.header_mutation)[DESTINATION_HEADER] in (A, B)
    assert metrics.errors.labels("client_destination_header")._value.get() == 1
    assert sum(router.stats.decisions.values()) == 0
    assert all(load == (0, 0) for load in router.loads.snapshot().values())  # nothing reserved


def test_an_llm_path_spelled_otherwise_is_read_as_the_engine_would_read_it(parts):
    """A gateway that does not normalize paths (kvroute's own Envoy does) still gets the request
    read and routed, not passed through past flow control and the transfer parameters' check."""
    router, _, _, processor = parts
    spelled = ("/v1/chat/%63ompletions", "//v1/completions", "/v1/x/../chat/completions", "/v1/chat%2Fcompletions")
    for path in spelled:
        stream = Stream()
        processor.handle(request_headers(path), stream)
        reply = processor.handle(body(), stream)
        assert DESTINATION_HEADER in set_headers(reply.request_body.response.header_mutation), path
    assert sum(router.stats.decisions.values()) == len(spelled)
    for path, read in (("/v1/models", False), ("/v1/chat/completionsx", False), ("/v1/chat/%2e%2e/completions", True)):
        stream = Stream()
        processor.handle(request_headers(path), stream)
        assert (stream.phase is Phase.BODY) is read, path


def test_every_path_vllm_generates_on_is_asked_about(parts):
    """vLLM serves generation on more paths than the two OpenAI ones: `/invocations` (SageMaker's,
    always served, chat or completions bodies) is routed by its prompt; `/v1/responses` and the
    others are read (least loaded, counted), and refused where an engine acts on transfer
    parameters. Round robin past kvroute, they escaped flow control, load and that rule."""
    router, _, _, processor = parts
    stream = Stream()
    processor.handle(request_headers("/invocations"), stream)
    reply = processor.handle(body(), stream)
    assert DESTINATION_HEADER in set_headers(reply.request_body.response.header_mutation)
    assert router.stats.decisions[Label.LEAST_LOADED] + router.stats.decisions[Label.PREFIX_MATCH] >= 1
    responses = orjson.dumps({"model": "m", "input": "hi", "kv_transfer_params": {"remote_host": "10.9.9.9"}})
    for path in ("/v1/responses", "/v1/messages", "/inference/v1/generate"):
        stream = Stream()
        processor.handle(request_headers(path), stream)
        assert stream.phase is Phase.BODY, path
    split = Router(Settings(hash_key=b"k" * 16))
    pool = BackendPool([Backend(A, role=Role.PREFILL), Backend(B)], split.remove_backend, 2)
    refusing = Processor(split, pool, Metrics(split, pool), clock=lambda: 100.0)
    stream = Stream()
    refusing.handle(request_headers("/v1/responses"), stream)
    assert refusing.handle(body(responses), stream).immediate_response.status.code == 400


def test_a_request_that_may_be_held_is_marked_pending_until_decided(parts):
    router, pool, metrics, _ = parts
    full = Settings(hash_key=b"k" * 16, max_backend_requests=1)
    room = WaitingRoom(lambda: full, lambda _b: False, WaitingRoomMetrics(CollectorRegistry()), lambda: 100.0)
    processor = Processor(router, pool, metrics, clock=lambda: 100.0, waiting_room=room)
    marked = processor.handle(request_headers(), Stream()).request_headers.response
    # Envoy answers a request still marked 503 should the ext_proc die while holding it
    assert set_headers(marked.header_mutation) == {PENDING_HEADER: "1"} and marked.clear_route_cache


def test_requests_held_for_a_model_every_backend_serves_wait_for_the_pools_own_backends(parts):
    """Their candidates are the pool's tuple itself, so a turn of flow control weighs its room
    once for all of them (WaitingRoom.pump), not once per flow."""
    router, pool, metrics, _ = parts
    asked: list[object] = []

    def room(candidates: object) -> bool:
        asked.append(candidates)
        return False

    waiting = WaitingRoom(lambda: router.settings, room, WaitingRoomMetrics(CollectorRegistry()), lambda: 100.0)
    processor = Processor(router, pool, metrics, clock=lambda: 100.0, waiting_room=waiting)

    async def held() -> None:
        streams = [Stream() for _ in range(2)]
        for stream in streams:
            processor.handle(request_headers(**{"x-gateway-inference-fairness-id": f"f{id(stream)}"}), stream)
        tasks = [asyncio.create_task(processor.decide_body(stream, BODY)) for stream in streams]
        await asyncio.sleep(0.01)
        assert len(waiting) == 2
        waiting.drain()
        await asyncio.gather(*tasks)

    asyncio.run(held())
    assert asked and all(candidates is pool.backends for candidates in asked)


def test_a_request_for_a_model_no_backend_serves_is_not_held_while_the_fleet_is_saturated():
    """No room will ever come for it: it is decided at once (no candidates), not held until its
    TTL and answered 429, which would invite retries and take a place in the queue meanwhile."""
    router = Router(Settings(hash_key=b"k" * 16))
    pool = BackendPool(
        [Backend(A, models=frozenset({"m"})), Backend(B, models=frozenset({"m"}))], router.remove_backend, 2
    )
    metrics = Metrics(router, pool)
    waiting = WaitingRoom(
        lambda: router.settings, lambda _b: False, WaitingRoomMetrics(CollectorRegistry()), lambda: 100.0
    )
    processor = Processor(router, pool, metrics, clock=lambda: 100.0, waiting_room=waiting, fallback=True)
    other = orjson.dumps({**orjson.loads(BODY), "model": "no-such-model"})

    async def decided() -> pb.ProcessingResponse:
        stream = Stream()
        processor.handle(request_headers(), stream)
        return await asyncio.wait_for(processor.decide_body(stream, other), 1.0)

    reply = asyncio.run(decided())
    assert len(waiting) == 0 and not reply.HasField("immediate_response")


def buffered(processor: Processor, payload: bytes) -> list[pb.ProcessingResponse]:
    """The replies to a buffered request's headers and body, as one stream."""

    async def replies() -> list[pb.ProcessingResponse]:
        async def messages():
            yield request_headers()
            yield body(payload)

        return [r async for r in processor._replies(messages(), Stream())]

    return asyncio.run(replies())


def test_a_failing_hand_off_serves_the_request_whole_without_the_clients_transfer_parameters():
    """Buffered mode: an error while running the prefill leg must not end the stream (Envoy would
    send the request on unrouted, with whatever kv_transfer_params the client put in it)."""
    router = Router(Settings(hash_key=b"k" * 16, pd_threshold_tokens=16))
    pool = BackendPool([Backend(A, role=Role.PREFILL), Backend(B)], router.remove_backend, unhealthy_after=2)
    metrics = Metrics(router, pool)
    legs = PrefillLegs()
    legs.run = broken  # type: ignore[method-assign]
    processor = Processor(router, pool, metrics, clock=lambda: 100.0, prefill_legs=legs)
    forged = orjson.dumps({**orjson.loads(BODY), "kv_transfer_params": {"remote_host": "10.9.9.9"}})

    decided = buffered(processor, forged)[-1].request_body.response
    assert set_headers(decided.header_mutation)[DESTINATION_HEADER] == B  # decoded where decided
    sent = orjson.loads(decided.body_mutation.body)
    assert "kv_transfer_params" not in sent and sent["messages"] == orjson.loads(BODY)["messages"]
    assert metrics.errors.labels("internal")._value.get() == 1
    # B computes the whole prompt after all: its prefill counts there again (released for the leg)
    assert router.loads.get(B).reserved_blocks > 0


def test_client_transfer_parameters_are_stripped_where_kvroute_names_no_backend():
    """A model no backend lists (an engine may serve one its pods do not name): kvroute names no
    backend and Envoy picks one, a decode server perhaps; the client's kv_transfer_params went on
    with the body (they name an address that server would pull blocks from)."""
    router = Router(Settings(hash_key=b"k" * 16))
    pool = BackendPool(
        [Backend(A, frozenset({"m"}), role=Role.PREFILL), Backend(B, frozenset({"m"}), role=Role.DECODE)],
        router.remove_backend,
        unhealthy_after=2,
    )
    processor = Processor(router, pool, Metrics(router, pool), clock=lambda: 100.0)
    forged = orjson.dumps({**orjson.loads(BODY), "model": "other", "kv_transfer_params": {"remote_host": "10.9.9.9"}})

    decided = buffered(processor, forged)[-1].request_body.response
    assert DESTINATION_HEADER not in set_headers(decided.header_mutation)
    sent = orjson.loads(decided.body_mutation.body)
    assert "kv_transfer_params" not in sent and sent["model"] == "other"


def test_client_transfer_parameters_in_a_body_that_cannot_be_written_back_are_refused():
    """orjson reads 1,024 levels of nesting and writes about 254: such a body parses (so it is no
    "body kvroute cannot read") but cannot be rewritten without the client's kv_transfer_params.
    It is answered 400 in buffered mode (before, the error ended the stream and Envoy sent the body
    on unrouted) and in full duplex (before, the body went back as it came)."""
    nested = b"[" * 300 + b"]" * 300
    forged = BODY[:-1] + b',"metadata":' + nested + b',"kv_transfer_params":{"remote_host":"10.9.9.9"}}'
    router = Router(Settings(hash_key=b"k" * 16))
    pool = BackendPool([Backend(A), Backend(B)], router.remove_backend, 2)
    metrics = Metrics(router, pool)
    processor = Processor(router, pool, metrics, clock=lambda: 100.0)

    async def buffered() -> list[pb.ProcessingResponse]:
        async def messages():
            yield request_headers()
            yield body(forged)

        return [r async for r in processor._replies(messages(), streams[0])]

    streams = [Stream(), Stream()]
    replies = asyncio.run(buffered())
    assert replies[-1].immediate_response.status.code == 400
    assert metrics.errors.labels("client_transfer_params")._value.get() == 1

    async def duplex() -> list[pb.ProcessingResponse]:
        async def messages():
            config = pb.ProcessingRequest(request_headers=request_headers().request_headers)
            config.protocol_config.request_body_mode = pb.ProcessingMode.FULL_DUPLEX_STREAMED
            yield config
            yield pb.ProcessingRequest(request_body=pb.HttpBody(body=forged, end_of_stream=True))

        return [r async for r in processor._replies(messages(), streams[1])]

    replies = asyncio.run(duplex())
    assert [r.immediate_response.status.code for r in replies if r.HasField("immediate_response")] == [400]
    assert not any(r.request_body.response.body_mutation.streamed_response.body for r in replies)
    for stream in streams:  # the streams end (Envoy closes them after the 400): their load is released
        processor.closed(stream)
    assert all(not any(load) for load in router.loads.snapshot().values())


def test_in_a_split_fleet_a_body_kvroute_cannot_read_is_refused_not_passed_on():
    """JSON that orjson refuses and the engine's server (Python's json) takes: NaN, a number past
    a double, a lone surrogate. Passed on unread, its transfer parameters would reach the decode
    server unstripped; an aggregated fleet still routes it least loaded."""
    forged = b'{"model": "m", "prompt": "p", "temperature": NaN, "kv_transfer_params": {"remote_host": "10.9.9.9"}}'
    for raw in (forged, forged.replace(b"NaN", b"1e400"), forged.replace(b'"p"', b'"\\ud800"')):
        cases = [
            ((Role.PREFILL, Role.BOTH), False, True),
            ((Role.DECODE, Role.DECODE), False, True),  # its prefill servers gone: decoders still pull
            ((Role.BOTH, Role.BOTH), True, True),  # pd_flexible: every server runs a connector
            ((Role.BOTH, Role.BOTH), False, False),
        ]
        for roles, flexible, refused in cases:
            router = Router(Settings(hash_key=b"k" * 16, pd_flexible=flexible))
            pool = BackendPool([Backend(A, role=roles[0]), Backend(B, role=roles[1])], router.remove_backend, 2)
            metrics = Metrics(router, pool)
            processor = Processor(router, pool, metrics, clock=lambda: 100.0)
            stream = Stream()
            processor.handle(request_headers("/v1/completions"), stream)
            reply = processor.handle(body(raw), stream)
            assert (reply.immediate_response.status.code == 400) is refused, (raw, roles)
            assert metrics.errors.labels("unread_in_split_fleet")._value.get() == int(refused)
            assert all(load == (0, 0) for load in router.loads.snapshot().values()) or not refused


@pytest.mark.parametrize("raw", [b"{not json", b"[]", b'{"messages": 5}', b"\xff\xfe"])
def test_bad_bodies_route_fail_open_and_are_counted(parts, raw):
    router, _, metrics, processor = parts
    stream = Stream()
    processor.handle(request_headers(), stream)
    routed = set_headers(processor.handle(body(raw), stream).request_body.response.header_mutation)
    assert set(routed[DESTINATION_HEADER].split(",")) == {A, B}
    assert stream.exchange.decision.label == "fallback"
    assert metrics.errors.labels("invalid_request")._value.get() == 1
    stream.close()
    assert all(load == (0, 0) for load in router.loads.snapshot().values())


def test_post_without_body_is_routed_from_its_headers(parts):
    _, _, metrics, processor = parts
    stream = Stream()
    reply = processor.handle(request_headers(eos=True), stream)
    assert set(set_headers(reply.request_headers.response.header_mutation)[DESTINATION_HEADER].split(",")) == {A, B}
    assert metrics.errors.labels("empty_body")._value.get() == 1
    assert metrics.errors.labels("invalid_request")._value.get() == 0  # counted once, as empty_body
    assert stream.exchange.decision.label == "fallback"


def test_no_healthy_backend_leaves_routing_to_envoy(parts):
    _, pool, _, processor = parts
    for _ in range(2):
        pool.mark(A, False)
        pool.mark(B, False)
    stream = Stream()
    processor.handle(request_headers(), stream)
    stream.headers["x-gateway-inference-objective"] = "critical"  # (not defined here: the default priority)
    mutation = processor.handle(body(), stream).request_body.response.header_mutation
    assert set_headers(mutation) == {ENGINE_PRIORITY_HEADER: "0"}  # Envoy picks the backend; kvroute the priority
    assert list(mutation.remove_headers) == [DESTINATION_HEADER, PENDING_HEADER]
    assert stream.exchange.decision.label == "no_candidates"


def test_other_messages_get_their_matching_empty_reply(parts):
    processor = parts[3]
    for kind, reply_kind in (("response_body", "response_body"), ("request_trailers", "request_trailers")):
        message = pb.ProcessingRequest(**{kind: pb.HttpBody() if kind == "response_body" else pb.HttpTrailers()})
        assert processor.handle(message, Stream()).WhichOneof("response") == reply_kind


def test_a_failure_on_response_headers_answers_with_a_response_headers_reply(parts):
    _, pool, metrics, processor = parts
    stream = Stream()
    processor.handle(request_headers(), stream)
    processor.handle(body(), stream)

    pool.canonical = broken  # an internal failure while reading the response start
    reply = processor.handle(response_headers("200", "via_upstream", A), stream)
    assert reply.WhichOneof("response") == "response_headers"
    assert metrics.errors.labels("internal")._value.get() == 1


def test_decisions_are_counted_by_the_core_once_per_request(parts):
    router, _, _, processor = parts
    for _ in range(3):
        stream = Stream()
        processor.handle(request_headers(), stream)
        processor.handle(body(), stream)
        stream.close()
    assert sum(router.stats.decisions.values()) == 3


def test_one_stream_decides_once_and_learns_once(parts):
    router, _, metrics, processor = parts
    stream = Stream()
    processor.handle(request_headers(), stream)
    first = set_headers(processor.handle(body(), stream).request_body.response.header_mutation)[DESTINATION_HEADER]
    chosen = first.split(",")[0]
    # A forged second round on the same stream: headers with end of stream, another body, two responses.
    assert not processor.handle(request_headers(eos=True), stream).request_headers.response.header_mutation.set_headers
    assert not processor.handle(body(b'{"model": "m", "messages": []}'), stream).request_body.response.HasField(
        "header_mutation"
    )
    processor.handle(response_headers("200", "via_upstream", chosen), stream)
    processor.handle(response_headers("200", "via_upstream", chosen), stream)
    assert sum(router.stats.decisions.values()) == 1 and router.stats.learned == 1
    assert router.loads.snapshot()[chosen] == (0, 1)
    stream.close()
    assert all(load == (0, 0) for load in router.loads.snapshot().values())
    assert metrics.errors.labels("repeated_message")._value.get() == 1


@pytest.mark.parametrize(("headers_on", "status"), [(False, "200"), (True, "400"), (True, "503")])
def test_decision_headers_are_opt_in_and_never_on_errors(headers_on, status):
    router = Router(Settings(hash_key=b"k" * 16, decision_headers=headers_on))
    pool = BackendPool([Backend(A), Backend(B)], router.remove_backend, unhealthy_after=2)
    processor = Processor(router, pool, Metrics(router, pool), clock=lambda: 100.0)
    stream = Stream()
    processor.handle(request_headers(), stream)
    chosen = set_headers(processor.handle(body(), stream).request_body.response.header_mutation)[DESTINATION_HEADER]
    reply = processor.handle(response_headers(status, "via_upstream", chosen.split(",")[0]), stream)
    assert not reply.response_headers.response.HasField("header_mutation")


def test_a_stream_past_its_age_limit_is_closed_and_releases_its_load():
    router = Router(Settings(hash_key=b"k" * 16))
    pool = BackendPool([Backend(A), Backend(B)], router.remove_backend, unhealthy_after=2)
    metrics = Metrics(router, pool)
    processor = Processor(router, pool, metrics, max_stream_age_s=0.2)

    class Context:
        def add_done_callback(self, callback: object) -> None:
            pass

    async def forever():
        yield request_headers()
        yield body()
        await asyncio.Event().wait()  # Envoy never closes this stream

    async def scenario() -> int:
        replies = 0
        async for _ in processor.Process(forever(), Context()):
            replies += 1
        return replies

    assert asyncio.run(scenario()) == 2
    assert all(load == (0, 0) for load in router.loads.snapshot().values())
    assert metrics.errors.labels("stream_age_limit")._value.get() == 1


def duplex(message: pb.ProcessingRequest) -> pb.ProcessingRequest:
    mode = pb.ProcessingMode.FULL_DUPLEX_STREAMED
    message.protocol_config.CopyFrom(pb.ProtocolConfiguration(request_body_mode=mode, response_body_mode=mode))
    return message


def run_stream(processor: Processor, messages: list[pb.ProcessingRequest]) -> list[list[pb.ProcessingResponse]]:
    """Replies to each message of one full-duplex stream, in order."""
    stream = Stream()
    stream.request_duplex = stream.response_duplex = True

    async def replies() -> list[list[pb.ProcessingResponse]]:
        return [await processor._duplex(m, stream) for m in messages]

    try:
        return asyncio.run(replies())
    finally:
        stream.close()


def test_full_duplex_holds_the_headers_reply_until_the_body_ends_then_hands_it_back(parts):
    _, _, _, processor = parts
    big = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "y" * 150_000}]})
    parts_of_body = [big[:70_000], big[70_000:]]
    messages = [
        duplex(request_headers()),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=parts_of_body[0], end_of_stream=False)),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=parts_of_body[1], end_of_stream=True)),
    ]
    held, first, last = run_stream(processor, messages)
    assert held == [] and first == []  # nothing until the body's end
    headers, *chunks = last
    assert headers.request_headers.response.clear_route_cache
    target = set_headers(headers.request_headers.response.header_mutation)[DESTINATION_HEADER]
    assert headers.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DESTINATION_HEADER].string_value == target
    streamed = [c.request_body.response.body_mutation.streamed_response for c in chunks]
    assert b"".join(s.body for s in streamed) == big  # the whole body, unchanged
    assert all(len(s.body) <= 62_000 for s in streamed) and [s.end_of_stream for s in streamed][-1]
    assert not any(s.end_of_stream for s in streamed[:-1])


def test_full_duplex_passes_other_paths_and_response_chunks_through(parts):
    _, _, _, processor = parts
    messages = [
        duplex(request_headers("/v1/models", "GET")),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=b"abc", end_of_stream=True)),
        pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: x\n\n", end_of_stream=False)),
    ]
    headers, body_reply, response_reply = run_stream(processor, messages)
    assert len(headers) == 1 and not headers[0].HasField("mode_override")
    assert body_reply[0].request_body.response.body_mutation.streamed_response.body == b"abc"
    streamed = response_reply[0].response_body.response.body_mutation.streamed_response
    assert (streamed.body, streamed.end_of_stream) == (b"data: x\n\n", False)


def test_full_duplex_subset_without_candidates_answers_503_at_the_body_end(parts):
    router, _, _, processor = parts
    messages = [duplex(with_subset(request_headers(), ["10.9.9.9:8000"])), body()]
    held, last = run_stream(processor, messages)
    assert held == [] and len(last) == 1 and last[0].immediate_response.status.code == 503
    assert router.loads.snapshot() == {}


def test_without_fallback_the_destination_is_one_address(parts):
    router, pool, metrics, _ = parts
    processor = Processor(router, pool, metrics, clock=lambda: 100.0, fallback=False)
    stream = Stream()
    processor.handle(request_headers(), stream)
    reply = processor.handle(body(), stream)
    target = set_headers(reply.request_body.response.header_mutation)[DESTINATION_HEADER]
    assert target in (A, B)  # no ",second" an ORIGINAL_DST cluster would take as part of the address
    assert reply.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DESTINATION_HEADER].string_value == target


def test_full_duplex_failure_at_the_trailers_hands_back_body_and_answers_the_trailers(parts):
    """A request body that ends with trailers, and routing fails when they arrive: Envoy gets the
    held headers reply, the body, and a trailers reply (without which it would wait)."""
    _, _, metrics, processor = parts

    processor._routing_reply = broken  # any internal failure while deciding
    chunk = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    messages = [
        duplex(request_headers()),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=chunk, end_of_stream=False)),
        pb.ProcessingRequest(request_trailers=pb.HttpTrailers()),
    ]
    _, _, replies = run_stream(processor, messages)
    kinds = [r.WhichOneof("response") for r in replies]
    assert kinds == ["request_headers", "request_body", "request_trailers"]
    assert replies[1].request_body.response.body_mutation.streamed_response.body == chunk
    assert metrics.errors.labels("internal")._value.get() == 1


def test_full_duplex_failure_at_the_body_end_hands_back_the_whole_body_once(parts):
    """...and the headers Envoy gets back never keep a destination the client sent: a gateway
    routes on that header, so a bare continue would send the request where the client said."""
    _, _, _, processor = parts

    processor._routing_reply = broken
    whole = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "z" * 1000}]})
    spoofed = {DESTINATION_HEADER: "169.254.169.254:80"}
    messages = [
        duplex(request_headers(**spoofed)),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=whole[:500], end_of_stream=False)),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=whole[500:], end_of_stream=True)),
    ]
    _, _, replies = run_stream(processor, messages)
    assert replies[0].WhichOneof("response") == "request_headers"
    assert DESTINATION_HEADER in replies[0].request_headers.response.header_mutation.remove_headers
    streamed = [r.request_body.response.body_mutation.streamed_response for r in replies[1:]]
    assert b"".join(s.body for s in streamed) == whole and streamed[-1].end_of_stream
    # buffered: a failure on the headers themselves
    processor._on_request_headers = broken  # type: ignore[method-assign]
    reply = processor.handle(request_headers(**spoofed), Stream()).request_headers.response
    assert DESTINATION_HEADER in reply.header_mutation.remove_headers


@pytest.mark.parametrize("ending", ["last_body_chunk", "trailers", "headers_only"])
def test_full_duplex_ends_the_stream_itself_once_the_response_has_ended(parts, ending):
    """Nothing comes after the response's end, so the processor ends the stream rather than wait
    for Envoy's reset (grpcio keeps memory for every reset stream); the load is released then."""
    router, _, _, processor = parts
    finished = pb.ProcessingRequest(response_headers=response_headers("200", "via_upstream", A).response_headers)
    finished.response_headers.end_of_stream = ending == "headers_only"
    tail = {
        "last_body_chunk": [pb.ProcessingRequest(response_body=pb.HttpBody(body=b"x", end_of_stream=True))],
        "trailers": [
            pb.ProcessingRequest(response_body=pb.HttpBody(body=b"x", end_of_stream=False)),
            pb.ProcessingRequest(response_trailers=pb.HttpTrailers()),
        ],
        "headers_only": [],
    }[ending]

    async def messages():
        yield duplex(request_headers())
        yield body()
        yield finished
        for message in tail:
            yield message
        await asyncio.Event().wait()  # Envoy would reset the stream, later

    context = Ending()

    async def scenario() -> list[str]:
        replies = []
        async for reply in processor.Process(messages(), context):
            replies.append(reply.WhichOneof("response"))
        for callback in context.callbacks:
            callback(context)
        return replies

    replies = asyncio.run(asyncio.wait_for(scenario(), timeout=10))
    assert replies[-1] == {"last_body_chunk": "response_body", "trailers": "response_trailers"}.get(
        ending, "response_headers"
    )
    assert all(load == (0, 0) for load in router.loads.snapshot().values())


def test_a_message_naming_no_phase_is_skipped_and_counted_in_either_body_mode():
    """Envoy sends none such, but one (a bare ProcessingRequest) ended the stream: its reply was
    looked up by a kind it did not have. It is skipped, counted, and the request goes on."""
    router = Router(Settings(hash_key=b"k" * 16))
    pool = BackendPool([Backend(A), Backend(B)], router.remove_backend, 2)
    metrics = Metrics(router, pool)
    processor = Processor(router, pool, metrics, clock=lambda: 100.0)

    async def replies(duplex: bool) -> list[str]:
        first = request_headers()
        if duplex:
            first.protocol_config.request_body_mode = msg.DUPLEX

        async def messages():
            yield first
            yield pb.ProcessingRequest()
            yield pb.ProcessingRequest(request_body=pb.HttpBody(body=BODY, end_of_stream=True))
            yield pb.ProcessingRequest()

        return [str(r.WhichOneof("response")) async for r in processor._replies(messages(), Stream())]

    assert asyncio.run(replies(False)) == ["request_headers", "request_body"]
    assert asyncio.run(replies(True))[:2] == ["request_headers", "request_body"]
    assert metrics.errors.labels("malformed_message")._value.get() == 4
