"""The ext_authz transport's check handler and access-log records, on a real router, over the
port as the ext_proc serves it (calls and log on one socket; no Envoy: tests/test_e2e_envoy.py
runs it through Envoy, tests/test_calls.py the calls' HTTP)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import msgpack
import orjson
import pytest
from aiohttp import ClientSession

from extproc.core.backends import Backend, Role
from extproc.core.engine import EngineSample
from extproc.core.objectives import ENGINE_PRIORITY_HEADER
from extproc.core.router import Router
from extproc.core.settings import Settings
from extproc.envoy.authz import Authz
from extproc.envoy.ends import BACKSTOP_FIELD
from extproc.envoy.headers import DESTINATION_HEADER, EXCHANGE_HEADER, ROUTE_PREFIX
from extproc.envoy.processor import Processor
from extproc.runtime.metrics import Metrics
from extproc.runtime.pool import BackendPool

A, B = "10.0.0.1:8000", "10.0.0.2:8000"
BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 3000}]})
TOKEN = "s3cret"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def parts():
    router = Router(Settings(hash_key=b"k" * 16, decision_headers=True))
    pool = BackendPool([Backend(A), Backend(B)], router.remove_backend, unhealthy_after=2)
    metrics = Metrics(router, pool)
    clock = Clock()
    processor = Processor(router, pool, metrics, clock=clock)
    return router, pool, metrics, clock, Authz(processor, metrics, TOKEN, clock, max_age_s=60.0)


def check(authz: Authz, body: bytes, headers: dict[str, str] | None = None, path: str = "/v1/chat/completions"):
    """One check call as Envoy makes it: (status, headers, body)."""

    async def call() -> tuple[int, dict[str, str], bytes]:
        server, port = await _port(authz)
        try:
            async with ClientSession() as session:
                sent = {"authorization": f"Bearer {TOKEN}", **(headers or {})}
                url = f"http://127.0.0.1:{port}{ROUTE_PREFIX}{path}"
                async with session.post(url, data=body, headers=sent) as response:
                    return response.status, dict(response.headers), await response.read()
        finally:
            server.close()
            await authz.close_calls(1.0)

    return asyncio.run(call())


def entry(exchange: str, status: int, upstream: str, details: str = "via_upstream", **flags: bool) -> dict[str, Any]:
    """An access-log record as Envoy's Fluentd logger writes it at a request's end (ends.RECORD)."""
    return {
        "x": exchange,
        "u": upstream,
        "c": status,
        "d": details,
        "f": "UF" if flags.get("upstream_connection_failure") else "-",
    }


def active(router: Router) -> int:
    return sum(active for _, active in router.loads.snapshot().values())


def errors(metrics: Metrics, kind: str) -> float:
    return metrics.registry.get_sample_value("kvroute_errors_total", {"kind": kind}) or 0.0


def test_a_routed_request_is_learned_and_released_when_its_entry_comes(parts: Any):
    router, _, _, _, authz = parts
    status, headers, _ = check(authz, BODY, {"x-session-id": "conv"})
    assert status == 200 and headers[DESTINATION_HEADER] in (A, B)
    assert (
        headers["x-kvroute-decision"] == "least_loaded" and headers["x-kvroute-backend"] == headers[DESTINATION_HEADER]
    )
    assert active(router) == 1 and router.stats.learned == 0  # nothing learned before the backend answered
    authz.ended(entry(headers[EXCHANGE_HEADER], 200, headers[DESTINATION_HEADER]))
    assert active(router) == 0 and router.stats.learned == 1
    status, again, _ = check(authz, BODY, {"x-session-id": "conv"})
    assert again["x-kvroute-decision"] == "session_match" and again[DESTINATION_HEADER] == headers[DESTINATION_HEADER]
    authz.ended(entry(again[EXCHANGE_HEADER], 200, again[DESTINATION_HEADER]))
    assert authz.state() == {"open_exchanges": 0, "forwarded_ends": 0}


def test_the_engine_priority_comes_with_every_decided_request_routed_or_not(parts: Any):
    """The answer names the engine priority with the backend; with no backend to name (Envoy then
    picks one itself) still with the priority, so wherever the request goes it is scheduled as such."""
    _, pool, _, _, authz = parts
    status, headers, _ = check(authz, BODY)
    assert status == 200 and headers[ENGINE_PRIORITY_HEADER] == "0" and DESTINATION_HEADER in headers
    pool.replace([])
    status, headers, _ = check(authz, BODY)
    assert status == 200 and headers[ENGINE_PRIORITY_HEADER] == "0" and DESTINATION_HEADER not in headers


def test_an_error_or_a_failed_connection_releases_without_learning(parts: Any):
    router, pool, _, _, authz = parts
    _, first, _ = check(authz, BODY)
    authz.ended(entry(first[EXCHANGE_HEADER], 503, first[DESTINATION_HEADER]))
    _, second, _ = check(authz, BODY)
    target = second[DESTINATION_HEADER]
    authz.ended(
        entry(
            second[EXCHANGE_HEADER],
            503,
            target,
            "upstream_reset_before_response_started",
            upstream_connection_failure=True,
        )
    )
    assert router.stats.learned == 0 and active(router) == 0
    assert pool._suspects == {target}  # probed at once, as when the ext_proc path sees a refused connection


def test_entries_it_did_not_open_change_nothing(parts: Any):
    router, _, metrics, _, authz = parts
    _, headers, _ = check(authz, BODY)
    authz.ended(entry("ffff", 200, A))
    authz.ended(entry(headers[EXCHANGE_HEADER] + "0", 200, A))
    assert errors(metrics, "unknown_exchange") == 2
    assert active(router) == 1 and router.stats.learned == 0


def test_the_backstop_copy_ends_what_its_own_record_did_not_and_is_otherwise_ignored(parts: Any):
    router, _, metrics, _, authz = parts
    ends = []
    for _ in range(3):
        _, headers, _ = check(authz, BODY)
        ends.append(entry(headers[EXCHANGE_HEADER], 200, headers[DESTINATION_HEADER]))
    first, lost, overtaken = ends
    authz.ended(first)
    authz.ended({**first, BACKSTOP_FIELD: "1"})  # the expected copy
    authz.ended({**lost, BACKSTOP_FIELD: "1"})  # Envoy dropped its own record
    authz.ended({**overtaken, BACKSTOP_FIELD: "1"})  # the copy came first ...
    authz.ended(overtaken)  # ... and then its own record
    assert router.stats.learned == 3 and active(router) == 0
    assert errors(metrics, "late_end") == 2 and errors(metrics, "unknown_exchange") == 0
    authz.ended(overtaken)  # a third record of it is no copy
    authz.ended({**entry("ffff", 200, A), BACKSTOP_FIELD: "1"})  # a copy of nothing kvroute knows: nothing
    assert errors(metrics, "unknown_exchange") == 1 and router.stats.learned == 3


def test_a_failure_inside_kvroute_at_either_end_of_a_request_leaves_nothing_held(parts: Any, monkeypatch):
    """A failure as the answer is made (no exchange id reaches Envoy, so no record of its end
    will come), or as its record is read (it is out of the open exchanges by then), still releases
    the request; and a failed sweep does not end the sweeping."""
    router, _, metrics, _, authz = parts
    _, headers, _ = check(authz, BODY)

    def fails(*_args: Any) -> None:
        raise RuntimeError("a defect")

    monkeypatch.setattr(Router, "response_started", fails)
    with pytest.raises(RuntimeError):
        authz.ended(entry(headers[EXCHANGE_HEADER], 200, headers[DESTINATION_HEADER]))
    assert active(router) == 0 and authz.state()["open_exchanges"] == 0
    monkeypatch.setattr(Router, "decision_headers", fails)
    status, _, _ = check(authz, BODY)
    assert status == 500 and active(router) == 0 and authz.state()["open_exchanges"] == 0

    async def sweeping() -> None:
        monkeypatch.setattr(authz, "sweep", fails)
        task = asyncio.create_task(authz.sweep_forever(0.001))
        await asyncio.sleep(0.05)
        assert not task.done()
        task.cancel()

    asyncio.run(sweeping())
    assert errors(metrics, "internal") >= 2


def test_an_exchange_whose_entry_never_comes_is_swept(parts: Any):
    router, _, metrics, clock, authz = parts
    check(authz, BODY)
    clock.now += 30
    assert authz.sweep() == 0
    clock.now += 31
    assert authz.sweep() == 1
    assert active(router) == 0 and errors(metrics, "stream_age_limit") == 1


def test_requests_no_engine_holds_whose_entry_never_came_are_released(parts: Any):
    """An entry lost on the way (a log stream cut as a replica stopped) would leave its request
    counted in flight for an hour, and enough of them saturate a backend in kvroute's picture:
    a request decided 30 s before an engine sample, beyond what that sample counted running or
    waiting there, is released (oldest first); one the engine may still hold is not."""
    router, _, metrics, clock, authz = parts
    headers = {}
    for i in range(3):  # three requests, all to one backend (a conversation)
        _, headers[i], _ = check(authz, BODY, {"x-session-id": "conv"})
        clock.now += 1
    backend = headers[0][DESTINATION_HEADER]
    assert {h[DESTINATION_HEADER] for h in headers.values()} == {backend} and active(router) == 3

    def sample(running: int, waiting: int) -> None:
        router.engine_sample(backend, EngineSample(running, waiting, 0.1, None, None, None), clock.now)

    sample(0, 0)  # the engine holds none, but all three were sent within the last 30 s
    assert authz.sweep() == 0 and active(router) == 3
    clock.now += 31
    sample(1, 0)  # 32-34 s later: one is still running there (this fleet's or another client's)
    assert authz.sweep() == 0 and active(router) == 3  # found once: maybe just finished, entry on its way
    clock.now += 10  # (the next sweep; all still well within the fixture's max_age_s)
    sample(1, 0)
    assert authz.sweep() == 2 and active(router) == 1  # found again: lost
    assert errors(metrics, "unreported_end") == 2
    authz.ended(entry(headers[2][EXCHANGE_HEADER], 200, backend))  # the newest one was kept
    assert active(router) == 0 and errors(metrics, "unknown_exchange") == 0
    authz.ended(entry(headers[0][EXCHANGE_HEADER], 200, backend))  # a released one's entry, late
    assert errors(metrics, "unknown_exchange") == 1


def test_a_sweep_does_not_bring_back_a_backend_that_left(parts: Any):
    """A backend removed while one of its requests is open: the sweep looks its load up without
    making one, so its metric series and its entry in the replica store's vector do not return
    (they did, for every backend a rollout replaced, for the process's life)."""
    router, _, _, _, authz = parts
    _, headers, _ = check(authz, BODY)
    backend = headers[DESTINATION_HEADER]
    router.remove_backend(backend)
    assert backend not in router.loads.snapshot()
    authz.sweep()
    assert backend not in router.loads.snapshot()
    authz.close_all()
    assert backend not in router.loads.snapshot()


def test_without_the_token_nothing_is_decided(parts: Any):
    router, _, metrics, _, authz = parts
    status, _, _ = check(authz, BODY, {"authorization": "Bearer forged"})
    assert status == 401 and active(router) == 0
    assert errors(metrics, "unauthenticated_stream") == 1


def test_other_paths_get_a_destination_and_nothing_to_end(parts: Any):
    router, _, _, _, authz = parts
    status, headers, _ = check(authz, b"", path="/v1/models")
    assert status == 200 and headers[DESTINATION_HEADER] in (A, B)
    assert EXCHANGE_HEADER not in headers and active(router) == 0


def test_client_transfer_parameters_are_refused(parts: Any):
    router, _, metrics, _, authz = parts
    body = orjson.dumps({"model": "m", "prompt": "p", "kv_transfer_params": {"remote_host": "10.9.9.9"}})
    status, headers, _ = check(authz, body, path="/v1/completions")
    assert status == 400 and DESTINATION_HEADER not in headers
    assert active(router) == 0 and errors(metrics, "client_transfer_params") == 1


def test_a_fleet_with_prefill_servers_is_served_whole_and_told_why(parts: Any):
    """This transport cannot rewrite the body with a prefill's transfer parameters: in a fleet with
    prefill servers each request is counted as served whole, and /readyz says which transport
    would split it; a fleet without them hears nothing of it."""
    _, pool, metrics, _, authz = parts
    status, headers, _ = check(authz, BODY)
    assert status == 200 and authz.warnings() == []
    pool.replace([Backend(A, role=Role.PREFILL), Backend(B, role=Role.DECODE)])
    for _ in range(2):
        status, headers, _ = check(authz, BODY)
        assert status == 200 and headers[DESTINATION_HEADER] == B  # decode-capable, whole
    outcome = {"outcome": "transport"}
    assert metrics.registry.get_sample_value("kvroute_disaggregation_total", outcome) == 2
    (warning,) = authz.warnings()
    assert "--transport ext_proc" in warning
    pool.replace([Backend(A), Backend(B)])
    assert authz.warnings() == []


def test_a_next_turn_asked_before_the_last_ones_end_is_reported_follows_it(parts: Any):
    """A client may send its next turn the instant the last one's response ends, before Envoy's
    entry for it arrives: the turn follows its conversation all the same (the index still learns
    nothing before the entry)."""
    router, _, _, _, authz = parts
    _, first, _ = check(authz, BODY, {"x-session-id": "quick"})
    _, second, _ = check(authz, BODY, {"x-session-id": "quick"})
    assert second["x-kvroute-decision"] == "session_match"
    assert second[DESTINATION_HEADER] == first[DESTINATION_HEADER] and router.stats.learned == 0


def test_with_siblings_an_entry_goes_to_the_replica_that_decided_it(parts: Any):
    """Exchange ids name their replica; an entry for a sibling's exchange is forwarded to it (the
    link's `forward_end`) and applied there; one that cannot be forwarded, or names no replica,
    is counted unknown."""
    router, pool, metrics, clock, _ = parts
    sent: list[tuple[str, bytes]] = []
    mine = Authz(Processor(router, pool, metrics, clock=clock), metrics, TOKEN, clock, 60.0, "r1", None)
    sibling = Authz(
        Processor(router, pool, metrics, clock=clock), metrics, TOKEN, clock, 60.0, "r2",
        lambda replica, data: sent.append((replica, data)) is None,
    )  # fmt: skip
    _, headers, _ = check(mine, BODY)
    key = headers[EXCHANGE_HEADER]
    assert key.startswith("r1.") and active(router) == 1
    sibling.ended(entry(key, 200, headers[DESTINATION_HEADER]))  # its log stream reached the sibling
    assert [replica for replica, _ in sent] == ["r1"] and sibling.forwarded == 1
    mine.ended_elsewhere(sent[0][1])  # as the store hands it over
    assert active(router) == 0 and router.stats.learned == 1
    mine.ended_elsewhere(b"\xff not an entry")
    sibling.ended(entry("ffff", 200, A))
    assert errors(metrics, "unknown_exchange") == 2
    # what comes through the store is bounded as Envoy's own records are: past that, not applied
    _, headers, _ = check(mine, BODY)
    record = entry(headers[EXCHANGE_HEADER], 200, headers[DESTINATION_HEADER])
    mine.ended_elsewhere(msgpack.packb({**record, "pad": "a" * 70_000}))
    mine.ended_elsewhere(msgpack.packb({**record, **{f"k{i}": i for i in range(100)}}))
    assert errors(metrics, "unknown_exchange") == 4 and active(router) == 1
    mine.ended_elsewhere(msgpack.packb(record))
    assert active(router) == 0
    # the backstop's copies: forwarded too, the second one ignored by the replica it reaches
    _, headers, _ = check(mine, BODY)
    record = entry(headers[EXCHANGE_HEADER], 200, headers[DESTINATION_HEADER])
    sibling.ended({**record, BACKSTOP_FIELD: "1"})  # the copy overtook its record, at the sibling
    mine.ended(record)  # and the record itself reached the replica that decided it
    mine.ended_elsewhere(sent[-1][1])
    assert active(router) == 0 and router.stats.learned == 3
    assert errors(metrics, "unknown_exchange") == 4 and errors(metrics, "late_end") == 0


def test_exchange_ids_name_their_process_without_replicas_too(parts: Any):
    """A log connection may reach another process (a rolling update's new pod): an id of one
    process must not be another's."""
    router, pool, metrics, clock, first = parts
    second = Authz(Processor(router, pool, metrics, clock=clock), metrics, TOKEN, clock, 60.0)
    _, headers, _ = check(first, BODY)
    second.ended({**entry(headers[EXCHANGE_HEADER], 200, headers[DESTINATION_HEADER]), BACKSTOP_FIELD: "1"})
    _, own, _ = check(second, BODY)
    assert own[EXCHANGE_HEADER] != headers[EXCHANGE_HEADER] and active(router) == 2


def _logged(*records: dict[str, Any]) -> bytes:
    """Envoy's Fluentd logger's bytes for these records: one forward-mode message each."""
    return b"".join(msgpack.packb(["kvroute", [[1_800_000_000, record]]]) for record in records)


async def _port(authz: Authz) -> tuple[asyncio.Server, int]:
    """The authz port as the ext_proc serves it: calls and access log on one socket."""
    server = await asyncio.get_running_loop().create_server(authz.protocols(), "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def _call(port: int) -> dict[str, str]:
    async with ClientSession() as session:
        url = f"http://127.0.0.1:{port}{ROUTE_PREFIX}/v1/chat/completions"
        async with session.post(url, data=BODY, headers={"authorization": f"Bearer {TOKEN}"}) as response:
            assert response.status == 200
            return dict(response.headers)


async def _log(port: int, data: bytes, pieces: int = 1) -> bool:
    """Write `data` as a log connection would, in `pieces`; True if the port closed it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    step = -(-len(data) // pieces)
    for start in range(0, len(data), step):
        writer.write(data[start : start + step])
        await writer.drain()
        await asyncio.sleep(0.01)
    try:
        closed = await asyncio.wait_for(reader.read(1), 0.2) == b""
    except TimeoutError:
        closed = False
    writer.close()
    return closed


def test_the_port_takes_calls_and_the_access_log_on_one_socket(parts: Any):
    """A call (HTTP) and the log (MessagePack, told apart by its first byte) on the same port; a
    record split across writes is applied once whole; with a token, a log connection whose first
    record lacks it, or that is not a log, is closed and nothing it sent is applied; calls still
    go on; a stopping ext_proc closes the log connections still open."""
    router, _, metrics, _, authz = parts

    async def scenario() -> None:
        server, port = await _port(authz)
        try:
            first = await _call(port)
            record = entry(first[EXCHANGE_HEADER], 200, first[DESTINATION_HEADER])
            assert active(router) == 1
            assert await _log(port, _logged({**record, "k": "wrong"}))  # closed:
            assert active(router) == 1 and errors(metrics, "unauthenticated_stream") == 1
            assert await _log(port, _logged(record))  # ... without the token too
            assert active(router) == 1 and errors(metrics, "unauthenticated_stream") == 2
            assert await _log(port, b"\x92\xc1 not msgpack")  # not a log: closed
            second = await _call(port)
            proven = _logged({**record, "k": TOKEN}, entry(second[EXCHANGE_HEADER], 200, A))  # the token once
            assert not await _log(port, proven, pieces=7)
            assert active(router) == 0 and router.stats.learned == 2
            reader, writer = await asyncio.open_connection("127.0.0.1", port)  # a log connection, open
            writer.write(_logged({**entry("ffff", 200, A), "k": TOKEN}))
            await asyncio.sleep(0.05)
            authz.close_logs()  # stopping: it is closed from this side
            assert await asyncio.wait_for(reader.read(1), 1.0) == b""
            writer.close()
        finally:
            server.close()
            authz.close_logs()
            await authz.close_calls(1.0)

    asyncio.run(scenario())


def test_a_request_waiting_for_its_adapter_holds_no_turn_and_leaves_nothing_behind():
    """Placement comes before flow control's turn: while one request waits for its adapter to
    load, a request held behind the saturated fleet is dispatched as soon as there is room (the
    turn once waited for the first, until the waiting room's stall tick, not run here); and when
    Envoy closes the first call, nothing of it stays held."""
    from prometheus_client import CollectorRegistry

    from extproc.envoy.calls import Call
    from extproc.runtime.placer import AdapterPlacer
    from extproc.runtime.waiting_room import WaitingRoom, WaitingRoomMetrics

    def call(model: str, flow: str) -> Call:
        body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "x" * 300}]})
        headers = {"content-type": "application/json", "x-gateway-inference-fairness-id": flow}
        return Call("POST", ROUTE_PREFIX + "/v1/chat/completions", headers, body)

    async def scenario() -> None:
        router = Router(Settings(hash_key=b"k" * 16, adapter_sources=(("lora1", "/adapters/lora1"),)))
        pool = BackendPool([Backend(A), Backend(B)], router.remove_backend, unhealthy_after=2)
        metrics = Metrics(router, pool)
        room_free = False
        metered = WaitingRoomMetrics(CollectorRegistry())
        room = WaitingRoom(lambda: router.settings, lambda _: room_free, metered, time.monotonic)
        placer = AdapterPlacer(router, pool)  # not run: the request waits for its adapter
        authz = Authz(Processor(router, pool, metrics, waiting_room=room, placer=placer), metrics)
        first = asyncio.create_task(authz.check(call("lora1", "f1")))
        await asyncio.sleep(0.05)
        second = asyncio.create_task(authz.check(call("m", "f2")))
        await asyncio.sleep(0.05)
        assert len(room) == 1 and not first.done()  # the second held; the first waits for its adapter
        room_free = True
        room.pump()
        async with asyncio.timeout(5):
            assert await second  # dispatched at once
        first.cancel()  # Envoy closed the call
        await asyncio.gather(first, return_exceptions=True)
        assert len(room) == 0 and authz.state()["open_exchanges"] == 1  # the second's alone
        assert sum(active for _, active in router.loads.snapshot().values()) == 1

    asyncio.run(scenario())


async def _closed(reader: asyncio.StreamReader) -> bool:
    """The port closed the connection within 2 s (an end of stream, or a reset: it left unread bytes)."""
    try:
        async with asyncio.timeout(2):
            return await reader.read(1) == b""
    except ConnectionResetError:
        return True


def test_before_its_token_is_proven_a_caller_makes_nothing_grow(parts: Any, monkeypatch):
    """No token yet: a health check with a body is refused, not buffered; a log stream that has
    not proven the token within PROOF_BYTES (or PROOF_TIMEOUT_S), whatever sizes its MessagePack
    declares, is closed; calls go on."""
    from extproc.envoy import ends

    monkeypatch.setattr(ends, "PROOF_TIMEOUT_S", 0.2)
    _, _, metrics, _, authz = parts

    async def scenario() -> None:
        server, port = await _port(authz)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /health HTTP/1.1\r\ncontent-length: 33554432\r\n\r\n")
            async with asyncio.timeout(2):
                assert (await reader.read()).startswith(b"HTTP/1.1 404")  # answered at once, closed
            writer.close()
            assert errors(metrics, "malformed_call") == 1  # (refused unread: counted)
            huge = b"\x92\xa7kvroute\xdc\x0f\xa0"  # [tag, [4,000 entries (as many as one may hold) ...
            filler = msgpack.packb("x" * 4000) * 40  # ... each a string, none of them a record yet
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            with contextlib.suppress(ConnectionError):  # (closed while it still writes)
                for _ in range(4):
                    writer.write(huge + filler)
                    await writer.drain()
            assert await _closed(reader)  # past PROOF_BYTES
            writer.close()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(huge)  # then quiet
            assert await _closed(reader)  # once PROOF_TIMEOUT_S has passed
            writer.close()
            assert errors(metrics, "unauthenticated_stream") == 2
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"\x92\xa7kvroute\xdd\x00\x0f\x42\x40")  # declares a million: not a log
            assert await _closed(reader)
            writer.close()
            await _call(port)
        finally:
            server.close()
            authz.close_logs()
            await authz.close_calls(1.0)

    asyncio.run(scenario())


class _Transport(asyncio.Transport):
    """What EndsProtocol needs of a socket: closing."""

    def __init__(self) -> None:
        super().__init__()
        self.closed = False

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


def test_a_log_message_is_decoded_only_once_whole_and_an_unfinished_one_is_bounded():
    """Records split across reads are applied in order once their message is whole; bytes of a
    message still coming are only framed, so what the stream holds is about what it sent (not
    70 times that, decoded), and past MAX_MESSAGE_BYTES of one unfinished message the stream is
    closed; nesting deeper than MessagePack's framer allows closes it too."""
    import tracemalloc

    from extproc.envoy import ends

    def stream(token: str = "") -> tuple[ends.EndsProtocol, list[dict[str, Any]], _Transport, list[int]]:
        records: list[dict[str, Any]] = []
        refused: list[int] = []
        protocol = ends.EndsProtocol(records.append, token, lambda: refused.append(1), set())
        transport = _Transport()
        protocol.connection_made(transport)
        return protocol, records, transport, refused

    entry = [[1, {"x": "a.1", "u": "10.0.0.1:8000", "c": "200"}]]
    message = msgpack.packb(["kvroute", entry * 3])
    protocol, records, transport, _ = stream()
    for index in range(len(message)):  # a byte at a time
        protocol.data_received(message[index : index + 1])
        assert records == ([] if index < len(message) - 1 else [entry[0][1]] * 3)
    protocol.data_received(message + message[:5])  # one whole, one begun
    assert len(records) == 6 and not transport.closed
    protocol.data_received(message[5:])
    assert len(records) == 9 and not transport.closed

    # An unfinished message, a read at a time: arrays of 4,095 empty arrays, each array's last
    # element the next one, just under the bound: held as its bytes.
    level = b"\xdc\x10\x00" + b"\x90" * 4095
    protocol, records, transport, _ = stream()
    protocol.data_received(b"\x92\xa7kvroute\xdc\x0f\xa0")
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(ends.MAX_MESSAGE_BYTES // len(level)):
            protocol.data_received(level)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert not transport.closed and records == []
    assert held < 4 * ends.MAX_MESSAGE_BYTES, held  # decoded, these would take some 60 times it
    protocol.data_received(level)  # past the bound, still unfinished
    assert transport.closed and records == []

    protocol, records, transport, _ = stream()
    protocol.data_received(b"\x92\xa7kvroute" + b"\x91" * 5000)  # deeper than any record
    assert transport.closed and records == []

    async def unproven() -> None:  # with a token, the same before it is proven (and refused)
        protocol, records, transport, refused = stream(token="secret")
        protocol.data_received(b"\x92\xa7kvroute\xdc\x0f\xa0" + b"\x90" * (ends.PROOF_BYTES + 1))
        assert transport.closed and records == [] and refused == [1]
        protocol.connection_lost(None)

    asyncio.run(unproven())
