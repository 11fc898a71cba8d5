"""The operator's reuse summary (controller/reuse.py): read from ext_procs' real /metrics pages,
summed over replicas (delivered once per backend), which pods are read, and which operator
replica works."""

from __future__ import annotations

import asyncio
import datetime

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from test_attribution import sample
from test_router import FLEET, A, chat, make_router, serve

from controller import logic
from controller.operator import trusted_namespaces
from controller.reuse import ReplicaReuse, extproc_endpoints, leading, parse, summary, untrusted_claims
from controller.reuse_reader import ReuseReader
from extproc.cli import parser
from extproc.core.router import Router
from extproc.runtime.metrics import Metrics, PolicyLabelled
from extproc.runtime.pool import BackendPool


def metrics_page(router: Router) -> str:
    return generate_latest(Metrics(router, BackendPool(FLEET, router.remove_backend, 2)).registry).decode()


def busy_router(conversation: str) -> Router:
    """A replica that served a conversation's two turns, and read an engine's counter twice."""
    router = make_router()
    serve(router, chat([], session=conversation), 0.0)
    serve(router, chat([], session=conversation + "-again"), 1.0)
    router.engine_sample(A, sample(100.0), 0.0)
    router.engine_sample(A, sample(400.0), 1.0)
    return router


def test_a_replicas_page_reads_back_as_its_own_sums():
    router = busy_router("s")
    replica = parse(metrics_page(router))
    reuse = router.attribution
    assert replica == ReplicaReuse(reuse.prompt, reuse.available, sum(reuse.routed.values()), {A: 300.0})
    state = router.state().reuse
    status = summary([replica], expected=1)
    assert status["routingEfficiency"] == pytest.approx(state["routing_efficiency"], abs=1e-3)
    assert status["extprocs"] == status["extprocsExpected"] == 1


def test_replicas_add_their_requests_and_count_each_engine_once():
    one, two = parse(metrics_page(busy_router("s"))), parse(metrics_page(busy_router("t")))
    status = summary([one, two], expected=3)
    assert status["promptTokens"] == round(one.prompt + two.prompt)
    assert status["routedTokens"] == round(one.routed + two.routed)
    assert status["deliveredTokens"] == 300  # both replicas read the same engine counter
    assert status["hitRate"] == round(300 / (one.prompt + two.prompt), 3)
    assert (status["extprocs"], status["extprocsExpected"]) == (2, 3)


def test_nothing_served_gives_no_ratio_and_a_page_without_the_counters_is_refused():
    status = summary([parse(metrics_page(make_router()))], expected=1)
    assert status["routingEfficiency"] is status["hitRate"] is status["predictionAccuracy"] is None
    with pytest.raises(ValueError):
        parse("# HELP up whatever\n# TYPE up gauge\nup 1\n")
    with pytest.raises(ValueError):
        parse("<html>not metrics</html>")


def test_ready_ext_proc_pods_of_the_policy_are_read_on_their_admin_port():
    def pod(name: str, policy: str | None, ready: bool = True, ip: str = "10.0.0.1") -> dict:
        body = {
            "metadata": {"name": name, "annotations": {"kvroute.io/policy": policy} if policy else {}},
            "spec": {"containers": [{"ports": [{"name": "admin", "containerPort": 9003}]}]},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
        }
        return logic.pod_summary(body)

    pods = {
        "llm": [
            pod("b", "llm/default"),
            pod("a", "llm/default", ip="fd00::1"),
            pod("c", "llm/other"),
            pod("d", "llm/default", ready=False),
            pod("e", None),
            pod("f", "llm/chat,llm/default", ip="10.0.0.6"),  # one ext_proc serving two policies
        ],
        "kvroute": [pod("g", "llm/default", ip="10.0.1.7")],  # where the chart runs the ext_procs
        "tenant": [pod("h", "llm/default", ip="10.0.2.8"), pod("i", "tenant/default", ip="10.0.2.9")],
    }
    assert extproc_endpoints("llm/default", pods, trusted=["kvroute"]) == [
        ("a", "http://[fd00::1]:9003"),
        ("b", "http://10.0.0.1:9003"),
        ("f", "http://10.0.0.6:9003"),
        ("g", "http://10.0.1.7:9003"),
    ]
    assert extproc_endpoints("llm/chat", pods) == [("f", "http://10.0.0.6:9003")]
    # a pod in another tenant's namespace that claims the policy is never read, only reported
    assert extproc_endpoints("llm/default", pods) == [
        ("a", "http://[fd00::1]:9003"),
        ("b", "http://10.0.0.1:9003"),
        ("f", "http://10.0.0.6:9003"),
    ]
    assert untrusted_claims("llm/default", pods, trusted=["kvroute"]) == ["tenant/h"]
    assert untrusted_claims("llm/default", pods) == ["kvroute/g", "tenant/h"]
    assert untrusted_claims("tenant/default", pods) == []


def test_the_operator_trusts_the_namespace_it_runs_in_and_those_named(tmp_path):
    mounted = tmp_path / "namespace"
    mounted.write_text("kvroute\n")
    assert trusted_namespaces((), mounted) == ("kvroute",)
    assert trusted_namespaces(("gateway", "kvroute"), mounted) == ("kvroute", "gateway")
    assert trusted_namespaces((), tmp_path / "absent") == ()  # outside a cluster: a policy's own namespace only
    assert parser().parse_args(["controller"]).extproc_namespaces == ()
    named = parser().parse_args(["controller", "--extproc-namespaces", "kvroute,gateway,"])
    assert named.extproc_namespaces == ("kvroute", "gateway")


class Policies:
    """What the reader reads of the reconciler, and the summaries it hands back."""

    def __init__(self, pods: dict[str, list[dict]]) -> None:
        self.pods = pods
        self.policies = {"llm": [{"name": "default"}]}
        self.reuse: dict[tuple[str, str], dict] = {}

    def set_reuse(self, namespace: str, name: str, reuse: dict) -> None:
        self.reuse[namespace, name] = reuse


def test_an_untrusted_claim_is_logged_once_while_it_lasts_and_never_read(caplog):
    claim = {"name": "intruder", "policy": "llm/default", "ready": True, "ip": "10.0.2.8", "ports": {"admin": 9003}}
    policies = Policies({"tenant": [claim]})
    reader = ReuseReader(policies, 30.0, lambda: asyncio.sleep(0, True))  # type: ignore[arg-type]

    def round_() -> None:  # nothing trusted serves the policy: no read is made (no HTTP session needed)
        asyncio.run(reader.read_all(None))  # type: ignore[arg-type]

    for _ in range(3):
        round_()
    assert reader.refused == {("tenant/intruder", "llm/default")}
    assert caplog.text.count("pod tenant/intruder claims policy llm/default") == 1
    # no trusted ext_proc: the policy's summary is emptied (figures read before do not stay)
    assert policies.reuse["llm", "default"] == summary([], 0) and summary([], 0)["extprocs"] == 0
    policies.pods = {}
    round_()
    assert reader.refused == set()
    policies.pods = {"tenant": [claim]}
    round_()  # back: logged again
    assert caplog.text.count("pod tenant/intruder claims policy llm/default") == 2


def test_an_extproc_serving_several_policies_gives_each_its_own_sums():
    """Its /metrics labels every sample with the policy: each policy reads back its own."""
    chat_router, code_router = busy_router("s"), make_router()
    serve(code_router, chat([], session="code"), 0.0)
    registry = CollectorRegistry()
    pages = [
        (n, Metrics(r, BackendPool(FLEET, r.remove_backend, 2)).registry)
        for n, r in (("llm/chat", chat_router), ("llm/code", code_router))
    ]
    registry.register(PolicyLabelled(pages))
    text = generate_latest(registry).decode()
    for name, router in (("llm/chat", chat_router), ("llm/code", code_router)):
        assert parse(text, name) == parse(metrics_page(router))
    assert parse(text, "llm/chat").prompt != parse(text, "llm/code").prompt


def test_only_the_replica_no_live_peer_outranks_works():
    now = datetime.datetime(2026, 12, 2, 12, 0, tzinfo=datetime.UTC)

    def peer(priority: int, seconds_ago: float) -> dict:
        seen = now - datetime.timedelta(seconds=seconds_ago)
        return {"priority": priority, "lifetime": 60, "lastseen": seen.isoformat()}

    assert leading({"me": peer(5, 1), "other": peer(3, 1)}, 5, now)
    assert not leading({"me": peer(3, 1), "other": peer(5, 1)}, 3, now)
    assert leading({"me": peer(3, 1), "other": peer(5, 120)}, 3, now)  # the higher one is gone
    assert leading({"me": peer(3, 1), "odd": {"priority": "x"}, "none": None}, 3, now)
    assert leading(None, 3, now)


def test_a_ratio_not_known_yet_does_not_make_a_patch_every_time():
    desired = {"readyBackends": 1, "conditions": [], "reuse": {"extprocs": 1, "hitRate": None}}
    stored = {"readyBackends": 1, "conditions": [], "reuse": {"extprocs": 1}}  # the API server dropped null
    assert not logic.status_differs(stored, desired)
    assert logic.status_differs(stored, {**desired, "reuse": {"extprocs": 2, "hitRate": None}})


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-5", "1e19"])
def test_a_replica_counter_that_is_no_count_is_refused_not_summed(value):
    """A pod serving such a counter is counted as unreadable (its figures left out); summed, NaN
    or infinity stopped every later policy's reuse from being written, and 1e19 is no JSON integer
    the API server keeps."""
    page = metrics_page(busy_router("s"))
    line = next(line for line in page.splitlines() if line.startswith("kvroute_prompt_tokens_total"))
    with pytest.raises(ValueError):
        parse(page.replace(line, f"{line.rsplit(' ', 1)[0]} {value}"))


def test_a_trusted_pods_redirect_is_not_followed():
    """An ext_proc pod's admin port answering with a redirect is an error, not a read of wherever
    it points: the operator's GET must not be sent to another address (a service in the cluster,
    the cloud's metadata) by a pod in a policy's namespace."""
    import aiohttp
    from aiohttp import web

    async def main() -> None:
        elsewhere: list[str] = []

        async def redirect(_request: web.Request) -> web.Response:
            raise web.HTTPFound("/elsewhere")

        async def target(request: web.Request) -> web.Response:
            elsewhere.append(request.path)
            return web.Response(text=metrics_page(busy_router("s")))

        app = web.Application()
        app.router.add_get("/metrics", redirect)
        app.router.add_get("/elsewhere", target)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        pod = {"name": "x", "policy": "llm/default", "ready": True, "ip": "127.0.0.1", "ports": {"admin": port}}
        policies = Policies({"llm": [pod]})
        reader = ReuseReader(policies, 30.0, lambda: asyncio.sleep(0, True))  # type: ignore[arg-type]
        try:
            async with aiohttp.ClientSession() as http:
                await reader.read_all(http)
        finally:
            await runner.cleanup()
        assert elsewhere == [] and reader.errors == 1
        assert ("llm", "default") not in policies.reuse  # none read: nothing summed

    asyncio.run(main())


def test_a_summary_is_written_when_it_says_something_new_or_is_due_not_on_every_read(monkeypatch):
    """The token sums grow with any traffic, so every read rewrote the whole status (every
    backend) of each busy policy every 30 s; now a summary is handed on when a replica count or a
    ratio changes, or once REFRESH_S has passed."""

    from controller import reuse_reader
    from controller.reuse import worth_writing

    before = {"extprocs": 1, "extprocsExpected": 1, "hitRate": 0.5, "routingEfficiency": 1.0, "promptTokens": 9}
    assert not worth_writing(before, {**before, "promptTokens": 90, "hitRate": 0.504})
    assert worth_writing(before, {**before, "hitRate": 0.505}) and worth_writing(before, {**before, "hitRate": None})
    assert worth_writing(before, {**before, "extprocs": 0}) and worth_writing(None, before)

    monkeypatch.setattr(reuse_reader, "REFRESH_S", 90.0)  # three rounds of 30 s
    policies = Policies({})
    written: list[dict] = []
    policies.set_reuse = lambda _namespace, _name, reuse: written.append(reuse)  # type: ignore[method-assign]
    reader = ReuseReader(policies, 30.0, lambda: asyncio.sleep(0, True))  # type: ignore[arg-type]
    for tokens in (9, 90, 900, 9000):  # one read a round; only the sums grow
        reader._rounds += 1
        reader._hand("llm", "default", {**before, "promptTokens": tokens})
    assert [w["promptTokens"] for w in written] == [9, 9000]  # the first, then the one 90 s after it
    reader._rounds += 1
    reader._hand("llm", "default", {**before, "promptTokens": 9001, "hitRate": 0.51})
    assert written[-1]["hitRate"] == 0.51  # a ratio moved: at once
