"""The InferenceObjective watcher's list/watch loop (extproc/kube/objectives.py) against a
stand-in for the Kubernetes API, as tests/test_follower.py does for the policy (the live API
server's run is tests/test_k8s_live.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import orjson
import pytest
from aiohttp import web
from kubernetes_asyncio import client

from extproc.kube import watching
from extproc.kube.objectives import ObjectiveWatcher

CURRENT = "/apis/llm-d.ai/v1alpha2/namespaces/llm/inferenceobjectives"
OLDER = "/apis/inference.networking.x-k8s.io/v1alpha2/namespaces/llm/inferenceobjectives"
CRITICAL = {"metadata": {"name": "critical"}, "spec": {"priority": 10}}


async def forbidden(_request: web.Request) -> web.StreamResponse:
    status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden", "code": 403}
    return web.Response(status=403, body=orjson.dumps(status), content_type="application/json")


async def listing(request: web.Request) -> web.StreamResponse:
    if request.query.get("watch") not in ("true", "True", "1"):
        return web.json_response({"metadata": {"resourceVersion": "1"}, "items": [CRITICAL]})
    response = web.StreamResponse()
    await response.prepare(request)
    await asyncio.sleep(3600)  # a watch with nothing to tell
    return response


async def run_against(
    older: Callable[[web.Request], Awaitable[web.StreamResponse]], check: Callable[[ObjectiveWatcher], bool]
) -> ObjectiveWatcher:
    app = web.Application()
    app.router.add_get(CURRENT, forbidden)
    app.router.add_get(OLDER, older)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    watcher = ObjectiveWatcher("llm")
    task = asyncio.create_task(watcher.run(client.Configuration(host=f"http://127.0.0.1:{runner.addresses[0][1]}")))
    try:
        for _ in range(200):
            if check(watcher):
                return watcher
            await asyncio.sleep(0.02)
        raise AssertionError(f"not reached: api {watcher.api}, error {watcher.last_error}")
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await runner.cleanup()


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(watching, "RETRY_S", 0.05)


def test_an_api_the_extproc_may_not_read_is_passed_over_for_the_other():
    """A Role granting only the older group (403 on llm-d.ai): the older API is followed, where
    the watcher retried the refused one forever and every request had the default priority."""
    watcher = asyncio.run(run_against(listing, lambda w: w.connected))
    assert watcher.api == ("inference.networking.x-k8s.io", "v1alpha2")
    assert watcher.priorities() == {"critical": 10} and watcher.warnings() == []


def test_a_watch_that_cannot_read_either_api_says_so_in_readyz():
    watcher = asyncio.run(run_against(forbidden, lambda w: w.last_error is not None))
    assert not watcher.connected and "403" in (watcher.last_error or "")
    (warning,) = watcher.warnings()
    assert warning.startswith("InferenceObjective watch down (ApiException")
