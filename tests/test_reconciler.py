"""controller/reconciler.py: bursts collapsed, only changes written, failures reported and retried."""

from __future__ import annotations

import asyncio
from typing import Any

from controller.audit import stale
from controller.reconciler import PatchStatus, Reconciler
from tests.controller_objects import T0, pools, record, summaries
from tests.k8s_objects import inference_pool, pod, policy, pool_policy


async def second_namespace_delay(
    reconciler: Reconciler, first: str, written: dict[str, float], settle_s: float
) -> float:
    """Touch `first`, then (`settle_s` later, its write under way or failed) namespace "b": how
    long "b"'s policy "pb" took to be written (inf: not within 2 s)."""
    pods = {first: summaries(pod("a")), "b": summaries(pod("b", "10.1.0.2"))}
    policies = {first: [record(first, policy("p" + first))], "b": [record("b", policy("pb"))]}
    task = asyncio.create_task(reconciler.run())
    reconciler.touch(first, pods, policies, {})
    await asyncio.sleep(settle_s)
    touched = asyncio.get_running_loop().time()
    reconciler.touch("b", pods, policies, {})
    for _ in range(100):
        if "pb" in written:
            break
        await asyncio.sleep(0.02)
    task.cancel()
    return written.get("pb", float("inf")) - touched


def test_reconciler_collapses_bursts_and_writes_only_changes():
    patches: list[tuple[str, str, dict[str, Any]]] = []

    async def patch(namespace: str, name: str, new: dict[str, Any]) -> None:
        patches.append((namespace, name, new))

    async def scenario() -> None:
        reconciler = Reconciler(patch, debounce_s=0.05, clock=lambda: T0)
        task = asyncio.create_task(reconciler.run())
        pods = {"llm": summaries(pod("a"))}
        policies = {
            "llm": [record("llm", policy("p1")), record("llm", policy("p2", selector={"matchLabels": {"x": "y"}}))]
        }
        for _ in range(50):  # a burst of events
            reconciler.touch("llm", pods, policies, {})
        await asyncio.sleep(0.3)
        assert len(patches) == 2 and {p[1] for p in patches} == {"p1", "p2"}
        # the patched statuses come back through the index: nothing more to write
        policies["llm"] = [{**r, "status": p[2]} for r, p in zip(policies["llm"], patches, strict=True)]
        reconciler.touch("llm", pods, policies, {})
        await asyncio.sleep(0.2)
        assert len(patches) == 2
        pods["llm"] = summaries(pod("a"), pod("b", "10.1.0.2"))
        reconciler.touch("llm", pods, policies, {})
        await asyncio.sleep(0.2)
        assert [p[1] for p in patches[2:]] == ["p1"]
        task.cancel()

    asyncio.run(scenario())


def test_reconciler_reports_and_retries_failed_patches():
    calls: list[str] = []

    async def flaky(_namespace: str, name: str, _status: dict[str, Any]) -> None:
        calls.append(name)
        if len(calls) == 1:
            raise ConnectionError("API server unreachable")

    async def scenario() -> None:
        reconciler = Reconciler(flaky, debounce_s=0)
        reconciler.touch("llm", {"llm": summaries(pod("a"))}, {"llm": [record("llm", policy())]}, {})
        await reconciler.settle(["llm"])
        assert reconciler.last_error and "unreachable" in reconciler.last_error
        await reconciler.settle(["llm"])
        assert reconciler.last_error is None and reconciler.patches == 1

    asyncio.run(scenario())


def test_a_malformed_policy_does_not_stop_the_others():
    patched: list[str] = []

    async def patch(_namespace: str, name: str, _status: dict[str, Any]) -> None:
        patched.append(name)

    async def scenario() -> None:
        reconciler = Reconciler(patch, debounce_s=0)
        broken = record("llm", policy("broken"))
        del broken["spec"]["targetPort"]  # the CRD forbids it; a reconciler must survive it anyway
        reconciler.touch("llm", {"llm": summaries(pod("a"))}, {"llm": [record("llm", policy("good")), broken]}, {})
        await reconciler.settle(["llm"])
        assert patched == ["good"] and reconciler.errors == 1 and "broken" in reconciler.last_error

    asyncio.run(scenario())


def recorder() -> tuple[list[dict[str, Any]], PatchStatus]:
    """A status patch that keeps the statuses it was given, in order."""
    patched: list[dict[str, Any]] = []

    async def patch(_namespace: str, _name: str, new: dict[str, Any]) -> None:
        patched.append(new)

    return patched, patch


def test_the_reconciler_settles_pool_policies_when_their_pool_appears():
    patched, patch = recorder()

    async def scenario() -> None:
        reconciler = Reconciler(patch, debounce_s=0)
        pods = {"llm": summaries(pod("a"))}
        reconciler.touch("llm", pods, {"llm": [record("llm", pool_policy("chat"))]}, {})
        await reconciler.settle(["llm"])
        reconciler.touch(
            "llm", pods, {"llm": [record("llm", pool_policy("chat"))]}, {"llm": pools(inference_pool("chat"))}
        )
        await reconciler.settle(["llm"])

    asyncio.run(scenario())
    assert [p["readyBackends"] for p in patched] == [0, 1]
    assert patched[0]["conditions"][1]["reason"] == "PoolNotFound"


def test_stale_condemns_only_indexed_objects_of_covered_namespaces_that_the_list_lacks():
    indexed = {"llm": {"a", "b"}, "other": {"c"}}
    # b deleted while cut off; d created after the index was read (the list may or may not have it);
    # "other" not listed, so nothing there is judged
    assert stale(indexed, {"llm": {"a", "d"}}) == {"b"}
    assert stale(indexed, {"llm": set(), "other": {"c"}}) == {"a", "b"}
    assert stale(indexed, {}) == set()


def test_reconciler_leaves_out_what_the_audit_found_gone_and_takes_it_back():
    patches, patch = recorder()

    async def scenario() -> None:
        reconciler = Reconciler(patch, debounce_s=0)
        pods = {"llm": summaries(pod("a"), pod("b", "10.1.0.2"))}
        gone_uid = pods["llm"][1]["uid"]
        assert gone_uid  # the summaries carry the pods' uids
        reconciler.touch("llm", pods, {"llm": [record("llm", policy())]}, {})
        await reconciler.settle(["llm"])
        assert patches[-1]["readyBackends"] == 2
        reconciler.forget({gone_uid})
        assert [p["name"] for p in reconciler.pods["llm"]] == ["a"] and len(reconciler.indexed_pods["llm"]) == 2
        await reconciler.settle(["llm"])
        assert patches[-1]["readyBackends"] == 1
        assert [b["ip"] for b in patches[-1]["backends"]] == [pods["llm"][0]["ip"]]
        reconciler.forget(set())  # a later audit no longer finds it gone (it never does in practice)
        await reconciler.settle(["llm"])
        assert patches[-1]["readyBackends"] == 2

    asyncio.run(scenario())


def test_a_policy_forgotten_after_its_patch_failed_leaves_the_operator_ready():
    """A policy deleted while the watch was cut off: its patch failed (404); once the audit
    finds it gone, that failure no longer keeps /readyz at 503."""

    async def missing(_namespace: str, name: str, _status: dict[str, Any]) -> None:
        raise LookupError(f"kvroutingpolicies {name!r} not found")

    async def scenario() -> None:
        reconciler = Reconciler(missing, debounce_s=0)
        gone = record("llm", policy("gone"))
        gone["uid"] = "uid-gone"
        reconciler.touch("llm", {"llm": summaries(pod("a"))}, {"llm": [gone]}, {})
        await reconciler.settle(["llm"])
        assert reconciler.last_error and reconciler.last_error.startswith("llm/gone: ")
        reconciler.forget({"uid-other"})
        assert reconciler.last_error  # another object's verdict changes nothing
        reconciler.forget({"uid-gone"})
        assert reconciler.last_error is None

    asyncio.run(scenario())


def test_a_status_that_cannot_be_written_is_counted_and_keeps_the_operator_unready():
    """Another policy's status written meanwhile does not hide it (the API server refusing one
    status, e.g. past etcd's size limit, would otherwise go unseen while the old backends stand)."""
    refusing = {"big"}

    async def patch(_namespace: str, name: str, _status: dict[str, Any]) -> None:
        if name in refusing:
            raise ValueError("etcdserver: request is too large")

    async def scenario() -> None:
        reconciler = Reconciler(patch, debounce_s=0)
        policies = {"llm": [record("llm", policy("big")), record("llm", policy("fine"))]}
        reconciler.touch("llm", {"llm": summaries(pod("a"))}, policies, {})
        await reconciler.settle(["llm"])
        assert reconciler.errors == 1 and reconciler.last_error and "llm/big" in reconciler.last_error
        await reconciler.settle(["llm"])  # "fine" written again (its status here never changes); "big" fails
        assert reconciler.errors == 2 and reconciler.last_error and "llm/big" in reconciler.last_error
        refusing.clear()
        await reconciler.settle(["llm"])
        assert reconciler.errors == 2 and reconciler.last_error is None

    asyncio.run(scenario())


def test_an_event_during_a_settle_is_settled_after_the_debounce_not_the_retry_delay():
    """A pod of another namespace changes while a status is being written: it is written half a
    second later, not five (the retry delay is for failed writes)."""
    written: dict[str, float] = {}

    async def patch(namespace: str, name: str, _status: dict[str, Any]) -> None:
        await asyncio.sleep(0.05)  # one API round trip
        written[name] = asyncio.get_running_loop().time()

    async def scenario() -> float:  # (0.07 s: pa's write under way)
        return await second_namespace_delay(Reconciler(patch, debounce_s=0.05, clock=lambda: T0), "a", written, 0.07)

    assert asyncio.run(scenario()) < 1.0


def test_a_deleted_policy_takes_its_failure_and_reuse_figures_with_it():
    """Deleted while its last write had failed (a 404 racing the deletion): /readyz is not held
    at 503 for it, and a policy made again under its name starts without its reuse figures."""

    async def missing(_namespace: str, name: str, _status: dict[str, Any]) -> None:
        raise LookupError(f"kvroutingpolicies {name!r} not found")

    async def scenario() -> None:
        reconciler = Reconciler(missing, debounce_s=0)
        pods = {"llm": summaries(pod("a"))}
        reconciler.set_reuse("llm", "p", {"promptTokens": 1000})
        reconciler.touch("llm", pods, {"llm": [record("llm", policy("p"))]}, {})
        await reconciler.settle(["llm"])
        assert reconciler.last_error and reconciler.last_error.startswith("llm/p: ")
        reconciler.touch("llm", pods, {"llm": []}, {})  # deleted: the index drops it
        assert await reconciler.settle(["llm"]) == set()  # nothing failed
        assert reconciler.last_error is None and not reconciler._reuse

    asyncio.run(scenario())


def test_a_status_key_the_operator_no_longer_writes_is_removed_once_then_nothing_is_written():
    """A reuse summary stored by a run that read reuse, with reuse reading off now: a merge patch
    that leaves the key out keeps it, so every settle wrote again; it is written null once."""
    patches: list[dict[str, Any]] = []

    async def patch(_namespace: str, _name: str, status: dict[str, Any]) -> None:
        patches.append(status)

    async def scenario() -> None:
        reconciler = Reconciler(patch, debounce_s=0, clock=lambda: T0)
        pods = {"llm": summaries(pod("a"))}
        stored = record("llm", policy("p"))
        reconciler.touch("llm", pods, {"llm": [stored]}, {})
        await reconciler.settle(["llm"])
        stored = {**stored, "status": {**patches[-1], "reuse": {"promptTokens": 1000}}}
        reconciler.touch("llm", pods, {"llm": [stored]}, {})
        await reconciler.settle(["llm"])
        assert len(patches) == 2 and patches[-1]["reuse"] is None
        stored = {**stored, "status": {k: v for k, v in patches[-1].items() if v is not None}}  # as stored
        reconciler.touch("llm", pods, {"llm": [stored]}, {})
        await reconciler.settle(["llm"])
        assert len(patches) == 2

    asyncio.run(scenario())


def test_nothing_is_written_until_an_audit_follows_each_start_of_the_lead():
    """A replica kopf paused keeps its indexes, and the relist that resumes it removes nothing
    deleted meanwhile: it writes nothing while it does not lead, nor once it leads again until
    its audit has run (it published the deleted pods ready again, until its next audit)."""
    from controller.audit import Auditor

    patches: list[str] = []
    leading = [False]
    audits: list[bool] = []

    async def patch(_namespace: str, name: str, _status: dict[str, Any]) -> None:
        patches.append(name)

    async def lead() -> bool:
        return leading[0]

    async def scenario() -> None:
        reconciler = Reconciler(patch, debounce_s=0.01, clock=lambda: T0)
        auditor = Auditor(reconciler, 60.0, lead)

        async def audit(_api: object) -> set[str]:
            audits.append(bool(patches))  # (whether anything was written before it)
            return set()

        auditor.audit = audit  # type: ignore[method-assign]  # the audit itself runs live: test_k8s_live
        tasks = [asyncio.create_task(reconciler.run()), asyncio.create_task(auditor.follow(0.02))]
        try:
            reconciler.touch("llm", {"llm": summaries(pod("a"))}, {"llm": [record("llm", policy("p"))]}, {})
            await asyncio.sleep(0.2)
            assert not patches and reconciler.held  # standby: nothing written
            leading[0] = True
            for _ in range(100):
                if patches:
                    break
                await asyncio.sleep(0.02)
            assert patches == ["p"] and audits == [False]  # audited first, then written
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(scenario())


def test_a_namespace_whose_status_always_fails_backs_off_and_does_not_delay_the_others():
    """Every failed write put the whole loop to sleep for RETRY_S, so one status the API server
    always refused (past etcd's size limit) delayed every other namespace's by five seconds, and
    was tried every five seconds for good. Now the failing namespace alone waits, twice as long
    each time up to RETRY_MAX_S."""
    from controller.reconciler import RETRY_MAX_S, RETRY_S

    written: dict[str, float] = {}

    async def patch(namespace: str, name: str, _status: dict[str, Any]) -> None:
        if namespace == "big":
            raise ValueError("etcdserver: request is too large")
        written[name] = asyncio.get_running_loop().time()

    async def scenario() -> tuple[float, list[float]]:
        reconciler = Reconciler(patch, debounce_s=0.01, clock=lambda: T0)
        delay = await second_namespace_delay(reconciler, "big", written, 0.1)  # (0.1 s: its first write failed)
        backoffs = []
        for _ in range(6):  # "big" failing round after round, then written
            reconciler._back_off({"big"}, {"big"}, 0.0)
            backoffs.append(reconciler._retry["big"][1])
        reconciler._back_off({"big"}, set(), 0.0)
        assert "big" not in reconciler._retry
        return delay, backoffs

    delay, backoffs = asyncio.run(scenario())
    assert delay < 1.0  # half a second at most, not the failing namespace's five
    assert backoffs == [2 * RETRY_S, 4 * RETRY_S, 8 * RETRY_S, RETRY_MAX_S, RETRY_MAX_S, RETRY_MAX_S]
