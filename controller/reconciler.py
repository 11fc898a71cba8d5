"""Collapses bursts of pod and policy events into one status write per policy that changed."""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from controller import logic

log = logging.getLogger(__name__)

RETRY_S = 5.0  # a namespace whose status failed to be written is tried again after this,
RETRY_MAX_S = 60.0  # doubled while it goes on failing, up to this; the other namespaces do not wait
PatchStatus = Callable[[str, str, dict[str, Any]], Awaitable[None]]
Snapshot = Mapping[str, Iterable[Mapping[str, Any]]]


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Reconciler:
    """Namespaces are marked dirty by events; `run` settles them after a short quiet period.

    `pods`, `policies` and `pools` map a namespace to pod summaries, policy records
    (`{"name", "metadata", "spec", "status"}`) and InferencePool summaries; kopf's indexes are such
    mappings (the pools' stays empty where the InferencePool CRD is not installed).
    """

    def __init__(self, patch_status: PatchStatus, debounce_s: float = 0.5, clock: Callable[[], str] = _now) -> None:
        self._patch_status = patch_status
        self._debounce_s = debounce_s
        self._clock = clock
        self._dirty: set[str] = set()
        self._wake = asyncio.Event()
        self._pods: Snapshot = {}
        self._policies: Snapshot = {}
        self._pools: Snapshot = {}
        self._reuse: dict[tuple[str, str], dict[str, Any]] = {}  # (namespace, policy) -> status.reuse
        self.gone: frozenset[str] = frozenset()  # uids the indexes hold and the API server has not (audit.py)
        self.patches = 0
        self.errors = 0
        self.last_error: str | None = None
        self._failing: dict[tuple[str, str], str] = {}  # policy -> why its status is not as it should be
        self._retry: dict[str, tuple[float, float]] = {}  # failing namespace -> (when it is tried again, backoff)
        self._retry_wake: asyncio.TimerHandle | None = None
        # Nothing is written while held: the indexes may hold objects deleted while this replica
        # did not lead (kopf paused its watches; its relist on resuming removes nothing), until an
        # audit has left them out (audit.Auditor.follow).
        self.held = False

    def touch(self, namespace: str, pods: Snapshot, policies: Snapshot, pools: Snapshot) -> None:
        """Something changed in a namespace; settle it soon."""
        self._pods, self._policies, self._pools = pods, policies, pools
        self._dirty.add(namespace)
        self._wake.set()

    @property
    def indexed_pods(self) -> Snapshot:
        return self._pods

    @property
    def indexed_policies(self) -> Snapshot:
        return self._policies

    @property
    def indexed_pools(self) -> Snapshot:
        return self._pools

    @property
    def pods(self) -> dict[str, list[Mapping[str, Any]]]:
        """The pods the API server still has, by namespace."""
        return {namespace: self._live(entries) for namespace, entries in self._pods.items()}

    @property
    def policies(self) -> dict[str, list[Mapping[str, Any]]]:
        """The policies the API server still has, by namespace."""
        return {namespace: self._live(entries) for namespace, entries in self._policies.items()}

    def _live(self, entries: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        return [entry for entry in entries if entry.get("uid") not in self.gone]

    def forget(self, gone: Iterable[str]) -> None:
        """The audit's latest verdict: these indexed objects are gone. Every namespace whose view
        changes with it is settled again."""
        gone = frozenset(gone)
        changed = gone ^ self.gone
        self.gone = gone
        if not changed:
            return
        for namespace, policies in self._policies.items():
            for policy in policies:  # its failed patch (404) is no reason to stay unready
                if policy.get("uid") in gone:
                    self._settled(namespace, str(policy.get("name")))
        for snapshot in (self._pods, self._policies, self._pools):
            for namespace, entries in snapshot.items():
                if any(entry.get("uid") in changed for entry in entries):
                    self._dirty.add(namespace)
        self._wake.set()

    def hold(self) -> None:
        """Write nothing until `release`."""
        self.held = True

    def release(self) -> None:
        """Write again: what was touched meanwhile is settled now."""
        self.held = False
        if self._dirty:
            self._wake.set()

    def set_reuse(self, namespace: str, name: str, reuse: dict[str, Any]) -> None:
        """The policy's reuse summary (controller/reuse.py) changed; write it soon."""
        if self._reuse.get((namespace, name)) != reuse:
            self._reuse[namespace, name] = reuse
            self._dirty.add(namespace)
            self._wake.set()

    async def settle(self, namespaces: Iterable[str]) -> set[str]:
        """Write the status of every policy in these namespaces whose status must change; the
        namespaces where a write failed (dirty again)."""
        failed: set[str] = set()
        for namespace in namespaces:
            pods = self._live(self._pods.get(namespace, ()))
            pools = self._live(self._pools.get(namespace, ()))
            policies = self._live(self._policies.get(namespace, ()))
            self._forget_deleted(namespace, {str(policy.get("name")) for policy in policies})
            for policy in policies:
                try:
                    desired = logic.desired_status(policy, pods, self._clock(), pools)
                    reuse = self._reuse.get((namespace, policy["name"]))
                    if reuse is not None:
                        desired["reuse"] = reuse
                    for stale in logic.stale_status_keys(policy.get("status"), desired):
                        desired[stale] = None  # a merge patch removes a key only where it says null
                except Exception as exc:  # one malformed policy must not stop the others
                    self._failed(namespace, str(policy.get("name")), f"{type(exc).__name__}: {exc}")
                    log.exception("cannot compute the status of %s/%s", namespace, policy.get("name"))
                    continue
                if not logic.status_differs(policy.get("status"), desired):
                    self._settled(namespace, policy["name"])
                    continue
                try:
                    await self._patch_status(namespace, policy["name"], desired)
                    self.patches += 1
                    self._settled(namespace, policy["name"])
                    log.info("status of %s/%s: %d ready backends", namespace, policy["name"], desired["readyBackends"])
                except Exception as exc:  # the API server may be away: retry on the next event
                    self._failed(namespace, policy["name"], str(exc)[:1024])
                    log.warning("status patch failed: %s", self.last_error)
                    self._dirty.add(namespace)
                    failed.add(namespace)
        return failed

    def _forget_deleted(self, namespace: str, names: set[str]) -> None:
        """A policy deleted takes its failure and its reuse figures with it: /readyz is not held
        at 503 by a patch of what no longer exists, and a policy made again under its name starts
        without them."""
        for key in [key for key in self._failing if key[0] == namespace and key[1] not in names]:
            self._settled(*key)
        for key in [key for key in self._reuse if key[0] == namespace and key[1] not in names]:
            del self._reuse[key]

    def _failed(self, namespace: str, name: str, why: str) -> None:
        """A policy's status could not be computed or written: counted (kind=status), and
        /readyz says so until that policy's status is settled (another's success does not)."""
        self.errors += 1
        self.last_error = self._failing[namespace, name] = f"{namespace}/{name}: {why}"

    def _settled(self, namespace: str, name: str) -> None:
        """A policy's status is as it should be (or the policy is gone)."""
        if self._failing.pop((namespace, name), None) is not None or not self._failing:
            self.last_error = next(reversed(self._failing.values()), None)

    async def run(self) -> None:
        """Forever: wait for a change, let the burst finish, settle what it touched. Survives any
        error: logs it, counts it, reports it in /readyz, and goes on. A namespace whose write
        failed waits its backoff (RETRY_S doubling to RETRY_MAX_S) before it is tried again, events
        or not, while the others are settled as they change: until 2026-12-07 every failure put
        the whole loop to sleep for RETRY_S, so one status the API server always refused delayed
        every other policy's by five seconds."""
        while True:
            await self._wake.wait()
            await asyncio.sleep(self._debounce_s)
            self._wake.clear()
            if self.held:  # what was touched stays to settle; `release` wakes the loop
                continue
            now = time.monotonic()
            due = {namespace for namespace in self._dirty if self._retry.get(namespace, (0.0, 0.0))[0] <= now}
            self._dirty -= due
            try:
                failed = await self.settle(due)
            except Exception as exc:
                self.errors += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.exception("reconciliation failed; it goes on")
                self._dirty |= due
                failed = due
            self._back_off(due, failed, now)

    def _back_off(self, tried: set[str], failed: set[str], now: float) -> None:
        """Each failed namespace's next try, and one wake for the earliest of them."""
        for namespace in tried - failed:
            self._retry.pop(namespace, None)
        for namespace in failed:
            backoff = min(RETRY_MAX_S, 2 * self._retry[namespace][1]) if namespace in self._retry else RETRY_S
            self._retry[namespace] = (now + backoff, backoff)
        waiting = [self._retry[namespace][0] for namespace in self._dirty if namespace in self._retry]
        if self._retry_wake is not None:
            self._retry_wake.cancel()
            self._retry_wake = None
        if waiting:
            delay = max(0.0, min(waiting) - time.monotonic())
            self._retry_wake = asyncio.get_running_loop().call_later(delay, self._wake.set)
