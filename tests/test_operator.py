"""controller/operator.py: what its kopf layer registers and feeds the reconciler."""

from __future__ import annotations

import asyncio
from typing import Any

import kopf
import pytest

import controller.operator as operator
from controller import logic
from controller.late_crds import Insights
from tests.k8s_objects import inference_pool, pod, policy


def test_kopf_layer_registers_indexes_events_and_lifecycle():
    registry = operator.REGISTRY
    indexes = {
        h.id: (h.selector.group, h.selector.version, h.selector.any_name) for h in registry._indexing.get_all_handlers()
    }
    assert indexes == {
        "pods_by_namespace": ("", "v1", "pods"),
        "policies_by_namespace": ("kvroute.io", "v1alpha1", "kvroutingpolicies"),
        "pools_by_namespace": ("inference.networking.k8s.io", "v1", "inferencepools"),
    }
    watched = {(h.selector.group, h.selector.any_name) for h in registry._watching.get_all_handlers()}
    assert watched == {
        ("", "pods"),
        ("kvroute.io", "kvroutingpolicies"),
        ("inference.networking.k8s.io", "inferencepools"),
    }
    assert not registry._changing.get_all_handlers()  # nothing that would write finalizers or annotations
    assert not registry._spawning.get_all_handlers()
    activities = {h.activity.value for h in registry._activities.get_all_handlers()}
    assert activities == {"startup", "cleanup", "authentication"}


def test_kopf_handlers_feed_the_reconciler():
    body = kopf.Body(pod("a"))
    assert operator.pods_by_namespace(namespace="llm", body=body) == {"llm": logic.pod_summary(pod("a"))}
    indexed = operator.policies_by_namespace(namespace="llm", name="default", body=kopf.Body(policy(generation=3)))
    assert indexed["llm"]["metadata"] == {"generation": 3} and indexed["llm"]["spec"]["targetPort"] == "http"
    touched: list[str] = []

    class Recorder:
        def touch(self, namespace: str, pods: Any, policies: Any, pools: Any) -> None:
            touched.append(namespace)

    memo = kopf.Memo(reconciler=Recorder())
    assert asyncio.iscoroutinefunction(operator.changed)  # on kopf's event loop, not in its thread pool
    asyncio.run(
        operator.changed(
            namespace="llm", memo=memo, pods_by_namespace={}, policies_by_namespace={}, pools_by_namespace={}
        )
    )
    pool = operator.pools_by_namespace(namespace="llm", body=kopf.Body(inference_pool("p", (8000, 8001))))
    expected = {"name": "p", "uid": "", "selector": {"matchLabels": {"app": "vllm"}}, "targetPorts": [8000, 8001]}
    assert pool == {"llm": expected}
    assert touched == ["llm"]


def test_startup_configures_kopf_quietly(monkeypatch):
    settings = kopf.OperatorSettings()

    async def local() -> Any:
        return operator.client.Configuration(host="https://127.0.0.1:1")

    monkeypatch.setattr(operator, "_client_configuration", local)
    memo = kopf.Memo(
        health_host="127.0.0.1",
        health_port=0,
        insights=Insights(),
        reuse_interval_s=30.0,
        audit_interval_s=60.0,
        extproc_namespaces=(),
    )

    async def scenario() -> None:
        await operator.start(settings=settings, memo=memo)
        # the reconciler, the reuse reader, the auditor's two loops and the two late-CRD followers
        assert len(memo.tasks) == 6 and not any(task.done() for task in memo.tasks)
        await operator.stop(memo=memo)
        assert all(task.cancelled() for task in memo.tasks)

    asyncio.run(scenario())
    assert settings.posting.enabled is False and settings.scanning.disabled is False  # a later pool CRD is seen
    assert settings.peering.mandatory is True and settings.peering.priority > 0


def test_a_startup_that_fails_on_its_probe_port_leaves_nothing_running(monkeypatch):
    """kopf retries a failed startup handler: an attempt that could not bind the probe port must
    not leave its tasks running beside the next one's."""

    async def local() -> Any:
        return operator.client.Configuration(host="https://127.0.0.1:1")

    monkeypatch.setattr(operator, "_client_configuration", local)

    async def scenario() -> None:
        taken = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = taken.sockets[0].getsockname()[1]
        memo = kopf.Memo(
            health_host="127.0.0.1",
            health_port=port,
            insights=Insights(),
            reuse_interval_s=30.0,
            audit_interval_s=60.0,
            extproc_namespaces=(),
        )
        before = len(asyncio.all_tasks())
        try:
            with pytest.raises(OSError):
                await operator.start(settings=kopf.OperatorSettings(), memo=memo)
        finally:
            taken.close()
            await taken.wait_closed()
        assert len(asyncio.all_tasks()) == before and "tasks" not in memo
        await operator.stop(memo=memo)  # kopf's cleanup after a startup that never succeeded

    asyncio.run(scenario())


def test_the_health_port_serves_the_operators_counts_and_untrusted_claims():
    """What the operator would otherwise only log, on /metrics for Prometheus; the pods claiming
    policies from untrusted namespaces by name on /readyz, which stays ready."""
    from aiohttp.test_utils import TestClient, TestServer

    from controller.audit import Auditor
    from controller.reconciler import Reconciler
    from controller.reuse_reader import ReuseReader

    async def scenario() -> tuple[str, dict]:
        reconciler = Reconciler(lambda *_: asyncio.sleep(0))
        reader = ReuseReader(reconciler, 30.0, lambda: asyncio.sleep(0, True))
        auditor = Auditor(reconciler, 60.0, lambda: asyncio.sleep(0, True))
        reconciler.errors, reconciler.patches, reader.errors, auditor.errors = 1, 7, 2, 3
        reader.refused = {("tenant/intruder", "llm/default")}
        reconciler.forget(frozenset({"uid-1", "uid-2"}))
        async with TestClient(TestServer(operator._health_app(reconciler, reader, auditor))) as http:
            page = await (await http.get("/metrics")).text()
            ready = await http.get("/readyz")
            assert ready.status == 200
            return page, await ready.json()

    page, ready = asyncio.run(scenario())
    for line in (
        "kvroute_operator_status_patches_total 7.0",
        'kvroute_operator_errors_total{kind="status"} 1.0',
        'kvroute_operator_errors_total{kind="reuse_read"} 2.0',
        'kvroute_operator_errors_total{kind="audit"} 3.0',
        "kvroute_operator_deleted_while_unwatched 2.0",
        "kvroute_operator_untrusted_extproc_claims 1.0",
    ):
        assert line in page.splitlines()
    assert ready["untrusted_extprocs"] == ["tenant/intruder claims llm/default"]
    assert ready["untrusted_extprocs_total"] == 1


def test_the_operators_calls_give_up_on_an_api_server_that_never_answers(monkeypatch):
    """A status patch, the peering read and the audit's lists had no time limit: one accepted and
    never answered (a half-open connection looks the same) held every policy's status for good,
    while /healthz and /readyz stayed green."""
    from aiohttp import web
    from kubernetes_asyncio import client

    from controller import audit
    from extproc.core import policy as contract

    monkeypatch.setattr(contract, "CALL_TIMEOUT", (1.0, 0.3))

    async def main() -> None:
        held = asyncio.Event()

        async def never(_request: web.Request) -> web.Response:
            await held.wait()
            return web.Response()

        app = web.Application()
        app.router.add_route("*", "/{path:.*}", never)
        runner = web.AppRunner(app, shutdown_timeout=0.5)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        monkeypatch.setattr(
            client.Configuration, "_default", client.Configuration(host=f"http://127.0.0.1:{runner.addresses[0][1]}")
        )

        async def gives_up(call: Any) -> None:
            """The call ends by itself, with its own timeout, long before the test's 5 s."""
            task = asyncio.ensure_future(call)
            done, _ = await asyncio.wait({task}, timeout=5)
            if not done:
                task.cancel()
            assert done and isinstance(task.exception(), TimeoutError)

        try:
            await gives_up(operator._patch_status("llm", "default", {"observedGeneration": 1}))
            await gives_up(operator._leading(0))
            async with client.ApiClient() as api:
                await gives_up(audit.list_uids(api, ["llm"], pools=False))
        finally:
            held.set()
            await runner.cleanup()

    asyncio.run(main())
