"""Several policies in one ext_proc: each request decided by the policy whose backends serve its
model, on real protobuf messages and real routers (the ext_proc and ext_authz paths, both body
modes), with each policy's own settings; and their metrics in one exposition, labelled."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from extproc.admin.app import Admin
from extproc.core.backends import Backend
from extproc.core.router import Router
from extproc.core.settings import Settings
from extproc.envoy.authz import Authz
from extproc.envoy.dispatch import PolicyDispatch
from extproc.envoy.headers import DESTINATION_HEADER, EXCHANGE_HEADER
from extproc.envoy.processor import Processor, Stream
from extproc.envoy.proto import ext_proc_pb2 as pb
from extproc.runtime.metrics import Metrics, PolicyLabelled
from extproc.runtime.pool import BackendPool
from tests.test_authz import TOKEN, check, entry
from tests.test_processor import Ending, body, broken, duplex, request_headers, response_headers, set_headers

A1, A2, B1, B2 = "10.0.1.1:8000", "10.0.1.2:8000", "10.0.2.1:8000", "10.0.2.2:8000"


def chat(model: str, text: str = "x" * 3000) -> bytes:
    return orjson.dumps({"model": model, "messages": [{"role": "user", "content": text}]})


class Policy:
    """One policy's router, pool, metrics and processor."""

    def __init__(self, backends: list[Backend], **settings: object) -> None:
        self.router = Router(Settings(hash_key=b"k" * 16, decision_headers=True, **settings))  # type: ignore[arg-type]
        self.pool = BackendPool(backends, self.router.remove_backend, unhealthy_after=2)
        self.metrics = Metrics(self.router, self.pool)
        self.processor = Processor(self.router, self.pool, self.metrics, clock=lambda: 100.0)

    def decisions(self) -> int:
        return sum(self.router.stats.decisions.values())

    def active(self) -> int:
        return sum(active for _, active in self.router.loads.snapshot().values())


@pytest.fixture
def policies() -> tuple[Policy, Policy]:
    """Policy a serves model-a on A1, A2; policy b serves model-b on B1, B2 with its own block size."""
    a = Policy([Backend(A1, frozenset({"model-a"})), Backend(A2, frozenset({"model-a"}))])
    b = Policy([Backend(B1, frozenset({"model-b"})), Backend(B2, frozenset({"model-b"}))], block_size=256)
    a.processor.routes = PolicyDispatch([a.processor, b.processor])
    return a, b


def decide(front: Processor, data: bytes) -> tuple[Stream, str]:
    """A buffered request's headers and body through the first policy's processor, as Envoy sends them."""
    stream = Stream()
    front.handle(request_headers(), stream)
    reply = asyncio.run(front.decide_body(stream, data))
    return stream, set_headers(reply.request_body.response.header_mutation).get(DESTINATION_HEADER, "")


def test_each_model_is_decided_by_its_policy_which_learns_and_releases_it(policies):
    a, b = policies
    stream, target = decide(a.processor, chat("model-b"))
    assert target.split(",")[0] in {B1, B2} and set(target.split(",")) <= {B1, B2}
    assert (a.decisions(), b.decisions(), b.active()) == (0, 1, 1)
    assert stream.exchange is not None and stream.exchange.request is not None
    own, other = (p.router.chain_of(p.router.parse(chat("model-b"), {})) for p in (b, a))
    assert stream.exchange.request.chain == own != other  # read with policy b's block size
    served = target.split(",")[0]
    a.processor.handle(response_headers("200", "via_upstream", served), stream)  # the stream stays with b
    a.processor.closed(stream)
    assert b.router.stats.learned == 1 and a.router.stats.learned == 0 and b.active() == 0
    again, target_again = decide(a.processor, chat("model-b"))  # the same prompt: b's index holds it
    assert target_again.split(",")[0] == served and again.exchange is not None
    assert again.exchange.decision.matched_blocks > 0
    a.processor.closed(again)
    _, target_a = decide(a.processor, chat("model-a"))
    assert target_a.split(",")[0] in {A1, A2} and a.decisions() == 1


def test_a_model_no_policy_lists_goes_to_a_policy_that_serves_any_else_finds_no_candidate(policies):
    a, b = policies
    stream, target = decide(a.processor, chat("unknown"))
    assert target == "" and stream.exchange is not None and stream.exchange.decision.label.value == "no_candidates"
    assert (a.decisions(), b.decisions()) == (1, 0)  # the first policy answered: Envoy's round robin, the engine's 404
    a.processor.closed(stream)
    b.pool.replace([*b.pool.backends, Backend("10.0.2.3:8000")])  # a backend that lists no model serves any
    stream, target = decide(a.processor, chat("unknown"))
    assert target.split(",")[0] == "10.0.2.3:8000" and b.decisions() == 1
    a.processor.closed(stream)


def test_an_adapter_goes_to_the_policy_whose_engines_list_it(policies):
    """vLLM serves a LoRA adapter under its own name, which no policy's declared models list."""
    a, b = policies
    b.router.adapters.listing(B2, ["sql-lora"])
    _, target = decide(a.processor, chat("sql-lora"))
    assert target.split(",")[0] == B2 and (a.decisions(), b.decisions()) == (0, 1)


def test_the_choice_follows_the_policies_backend_sets(policies):
    a, b = policies
    a.pool.replace([Backend(A1, frozenset({"model-a", "model-c"}))])
    _, target = decide(a.processor, chat("model-c"))
    assert target.split(",")[0] == A1
    b.pool.replace([Backend(B1, frozenset({"model-a"}))])  # listed by both: the first policy keeps it
    _, target = decide(a.processor, chat("model-a"))
    assert target.split(",")[0] == A1 and b.decisions() == 0


def test_an_unreadable_body_stays_with_the_first_policy_and_routes_least_loaded(policies):
    a, b = policies
    stream, target = decide(a.processor, b"{not json")
    assert target.split(",")[0] in {A1, A2} and (a.decisions(), b.decisions()) == (1, 0)
    assert a.metrics.errors.labels("invalid_request")._value.get() == 1
    a.processor.closed(stream)
    assert a.active() == 0


def test_full_duplex_bodies_are_handed_to_their_models_policy(policies):
    a, b = policies
    stream = Stream()
    stream.request_duplex = stream.response_duplex = True
    data = chat("model-b", "y" * 100_000)

    async def replies() -> list[list[pb.ProcessingResponse]]:
        messages = [
            duplex(request_headers()),
            pb.ProcessingRequest(request_body=pb.HttpBody(body=data[:60_000], end_of_stream=False)),
            pb.ProcessingRequest(request_body=pb.HttpBody(body=data[60_000:], end_of_stream=True)),
        ]
        return [await a.processor._duplex(m, stream) for m in messages]

    _, _, last = asyncio.run(replies())
    target = set_headers(last[0].request_headers.response.header_mutation)[DESTINATION_HEADER]
    assert target.split(",")[0] in {B1, B2} and b.active() == 1 and a.decisions() == 0
    a.processor.closed(stream)
    assert b.active() == 0


def test_the_whole_stream_runs_on_the_chosen_policy(policies):
    """Process(): every message after the body goes to the policy the body chose, and the
    stream's end releases its load there."""
    a, b = policies

    context = Ending()

    async def scenario() -> list[pb.ProcessingResponse]:
        async def messages():
            yield request_headers()
            yield body(chat("model-b"))
            yield response_headers("200", "via_upstream", B1)

        replies = [reply async for reply in a.processor.Process(messages(), context)]
        for callback in context.callbacks:
            callback(context)
        return replies

    replies = asyncio.run(scenario())
    assert [r.WhichOneof("response") for r in replies] == ["request_headers", "request_body", "response_headers"]
    assert b.router.stats.learned == 1 and b.active() == 0 and a.decisions() == 0


def test_metrics_of_several_policies_are_one_exposition_labelled_by_policy(policies):
    a, b = policies
    decide(a.processor, chat("model-a"))
    decide(a.processor, chat("model-b"))
    decide(a.processor, chat("model-b"))
    registry = CollectorRegistry()
    registry.register(PolicyLabelled([("llm/a", a.metrics.registry), ("llm/b", b.metrics.registry)]))
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    decided = {"llm/a": 0.0, "llm/b": 0.0}
    for sample in families["kvroute_decisions"].samples:
        decided[sample.labels["policy"]] += sample.value if sample.name.endswith("_total") else 0
    assert decided == {"llm/a": 1, "llm/b": 2}
    healthy = {(s.labels["policy"], s.labels["backend"]) for s in families["kvroute_backend_healthy"].samples}
    assert healthy == {("llm/a", A1), ("llm/a", A2), ("llm/b", B1), ("llm/b", B2)}
    histogram = [s for s in families["kvroute_decision_seconds"].samples if s.name.endswith("_count")]
    assert {s.labels["policy"]: s.value for s in histogram} == {"llm/a": 1, "llm/b": 2}
    text = generate_latest(registry).decode()
    assert text.count("# TYPE kvroute_decisions_total counter") == 1  # one family, not one per policy


def test_ext_authz_checks_and_ends_reach_the_policy_that_decided(policies):
    a, b = policies
    authz = Authz(a.processor, a.metrics, TOKEN, lambda: 100.0, max_age_s=60.0)
    status, headers, _ = check(authz, chat("model-b"))
    served = headers[DESTINATION_HEADER].split(",")[0]
    assert status == 200 and served in {B1, B2} and headers["x-kvroute-decision"]
    assert (a.decisions(), b.decisions(), b.active()) == (0, 1, 1)
    authz.ended(entry(headers[EXCHANGE_HEADER], 200, served))
    assert b.router.stats.learned == 1 and b.active() == 0


def test_the_control_api_answers_for_the_policy_of_each_model(policies):
    a, b = policies
    admin = Admin(a.router, a.pool, a.metrics, clock=lambda: 5.0, name="llm/a")
    registry = CollectorRegistry()
    registry.register(PolicyLabelled([("llm/a", a.metrics.registry), ("llm/b", b.metrics.registry)]))
    dispatch = a.processor.routes
    assert dispatch is not None
    admin.serve_also([("llm/b", b.router, b.pool, None, dict, list)], lambda m: dispatch.serving(m).router, registry)

    async def scenario() -> None:
        control = TestClient(TestServer(admin.control_app(TOKEN)), headers={"authorization": f"Bearer {TOKEN}"})
        async with control as client, TestClient(TestServer(admin.monitoring_app())) as monitoring:
            query = {"body": orjson.loads(chat("model-b"))}
            answer = orjson.loads(await (await client.post("/v1/query", data=orjson.dumps(query))).read())
            assert answer["backend"] in {B1, B2} and b.active() == 1 and a.decisions() == 0
            notify = {"lease": answer["lease"], "backend": answer["backend"]}
            assert (await client.post("/v1/notify", data=orjson.dumps(notify))).status == 200
            assert b.router.stats.learned == 1
            stray = {"lease": answer["lease"], "backend": A1}  # a backend of another policy
            assert (await client.post("/v1/notify", data=orjson.dumps(stray))).status == 400
            released = await client.post("/v1/release", data=orjson.dumps({"lease": answer["lease"]}))
            assert released.status == 200 and b.active() == 0
            state = orjson.loads(await (await client.get("/debug/state")).read())
            assert set(state["policies"]) == {"llm/a", "llm/b"}
            assert {x["address"] for x in state["policies"]["llm/b"]["backends"]} == {B1, B2}
            b.pool.replace([])  # policy b's pods all gone: the process still serves policy a
            ready = orjson.loads(await (await monitoring.get("/readyz")).read())
            assert ready["ready"] is False and ready["problems"] == ["gRPC server not serving"]
            admin.serving = True
            ready = orjson.loads(await (await monitoring.get("/readyz")).read())
            assert ready["ready"] and "policy llm/b: no healthy backend" in ready["warnings"]
            text = (await (await monitoring.get("/metrics")).read()).decode()
            assert 'policy="llm/a"' in text and 'policy="llm/b"' in text

    asyncio.run(scenario())


def test_requests_whose_model_is_not_read_go_where_unlisted_models_go(policies):
    """No body, or a body that is not JSON: decided by the policy with a backend that lists no
    model (it serves any), as an unlisted model's request is, and counted there."""
    a, b = policies
    b.pool.replace([*b.pool.backends, Backend("10.0.2.3:8000")])
    stream, target = decide(a.processor, b"{not json")
    assert target.split(",")[0] in {B1, B2, "10.0.2.3:8000"} and (a.decisions(), b.decisions()) == (0, 1)
    assert b.metrics.errors.labels("invalid_request")._value.get() == 1
    a.processor.closed(stream)
    empty = Stream()
    reply = a.processor.handle(request_headers(eos=True), empty)
    assert set_headers(reply.request_headers.response.header_mutation)[DESTINATION_HEADER].split(",")[0] in {
        B1,
        B2,
        "10.0.2.3:8000",
    }
    assert b.metrics.errors.labels("empty_body")._value.get() == 1 and b.decisions() == 2
    a.processor.closed(empty)
    assert b.active() == 0


def test_a_full_duplex_failure_fails_open_in_the_policy_that_took_the_stream(policies):
    """The body chose policy b, whose decision then fails: the held body is handed back unrouted
    by b (its turn, its error count), not by the first policy."""
    a, b = policies
    b.processor._routing_reply = broken  # type: ignore[method-assign]
    stream = Stream()
    stream.request_duplex = stream.response_duplex = True
    data = chat("model-b")

    async def replies() -> list[list[pb.ProcessingResponse]]:
        messages = [
            duplex(request_headers()),
            pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=True)),
        ]
        return [await a.processor._duplex(m, stream) for m in messages]

    _, released = asyncio.run(replies())
    assert released[0].WhichOneof("response") == "request_headers"
    assert b"".join(r.request_body.response.body_mutation.streamed_response.body for r in released[1:]) == data
    assert b.metrics.errors.labels("internal")._value.get() == 1
    assert a.metrics.errors.labels("internal")._value.get() == 0


def test_another_policys_expired_leases_end_before_its_table_is_judged_full(policies):
    """Each call ends every policy's expired leases, not the first policy's alone: a full table
    of another policy's leases its gateway never came back for answered 503 until the sweep."""
    a, b = policies
    now = [5.0]
    admin = Admin(a.router, a.pool, a.metrics, clock=lambda: now[0], name="llm/a")
    dispatch = a.processor.routes
    assert dispatch is not None
    admin.serve_also(
        [("llm/b", b.router, b.pool, None, dict, list)], lambda m: dispatch.serving(m).router, CollectorRegistry()
    )
    admin._served[1].leases.capacity = 1

    async def scenario() -> None:
        control = TestClient(TestServer(admin.control_app(TOKEN)), headers={"authorization": f"Bearer {TOKEN}"})
        async with control as client:
            query = orjson.dumps({"body": orjson.loads(chat("model-b"))})
            assert (await client.post("/v1/query", data=query)).status == 200
            assert (await client.post("/v1/query", data=query)).status == 503  # its one lease is open
            now[0] += admin._lease_ttl_s + 1  # the gateway never came back
            assert (await client.post("/v1/query", data=query)).status == 200
            assert b.active() == 1  # the expired lease's load went with it

    asyncio.run(scenario())
