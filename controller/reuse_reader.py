"""Reads the ext_proc replicas' `/metrics` on an interval and hands each policy's reuse summary
(controller/reuse.py) to the reconciler, which writes it into the policy's status.

Only the replica kopf's peering lets work reads and writes: a standby's pod list may be stale.
A replica that cannot be read is left out of the sums (the summary says how many answered), logged
once until it answers again, and counted. Only ext_procs in the policy's own namespace or one the
operator trusts are read (controller/reuse.py `extproc_endpoints`); a pod elsewhere that claims a
policy is logged once and listed in the operator's /readyz while it does. A policy that no
trusted ext_proc serves any more gets an empty summary, so figures from before (an untrusted
pod's, read by an older operator) do not stay.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import aiohttp

from controller.reconciler import Reconciler
from controller.reuse import ReplicaReuse, extproc_endpoints, parse, summary, untrusted_claims, worth_writing

log = logging.getLogger(__name__)

MAX_METRICS_BYTES = 8 * 1024 * 1024  # an ext_proc's /metrics is tens of KB; more is not one
READ_TIMEOUT_S = 3.0
REFRESH_S = 300.0  # a summary whose ratios held still is written at least this often (its token sums)


class ReuseReader:
    """One loop for every policy; `leading` says whether this replica works now."""

    def __init__(
        self,
        reconciler: Reconciler,
        interval_s: float,
        leading: Callable[[], Awaitable[bool]],
        trusted: Iterable[str] = (),
    ) -> None:
        self._reconciler = reconciler
        self._interval_s = interval_s
        self._leading = leading
        self._trusted = frozenset(trusted)  # namespaces besides a policy's own whose ext_procs are read
        self._failing: set[str] = set()  # pods whose last read failed (logged once)
        # (namespace/pod, policy) claims from untrusted namespaces, as of the last round (logged once)
        self.refused: set[tuple[str, str]] = set()
        self.errors = 0
        self._rounds = 0
        self._handed: dict[tuple[str, str], tuple[dict[str, Any], int]] = {}  # the summary written, its round

    async def run(self) -> None:
        """Forever, every interval; survives any error (logged, counted)."""
        timeout = aiohttp.ClientTimeout(total=READ_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            while True:
                await asyncio.sleep(self._interval_s)
                try:
                    if await self._leading():
                        await self.read_all(http)
                except Exception:
                    self.errors += 1
                    log.exception("reading the ext_procs' reuse counters failed; it goes on")

    async def read_all(self, http: aiohttp.ClientSession) -> None:
        """Every policy: read its trusted ext_procs all at once, hand the sums on."""
        pods = {  # ext_proc pods only (they carry the annotation): every policy looks through them twice
            namespace: claimants
            for namespace, entries in self._reconciler.pods.items()
            if (claimants := [pod for pod in entries if pod.get("policy")])
        }
        refused: set[tuple[str, str]] = set()
        read_pods: set[str] = set()
        self._rounds += 1
        known = {
            (namespace, policy["name"])
            for namespace, entries in self._reconciler.policies.items()
            for policy in entries
        }
        self._handed = {key: handed for key, handed in self._handed.items() if key in known}
        for namespace, policies in list(self._reconciler.policies.items()):
            for policy in list(policies):
                name = f"{namespace}/{policy['name']}"
                refused.update((pod, name) for pod in untrusted_claims(name, pods, self._trusted))
                endpoints = extproc_endpoints(name, pods, self._trusted)
                if not endpoints:
                    self._hand(namespace, policy["name"], summary([], 0))
                    continue
                read_pods.update(pod for pod, _ in endpoints)
                read = await asyncio.gather(*(self._read(http, pod, url, name) for pod, url in endpoints))
                replicas = [replica for replica in read if replica is not None]
                if not replicas:  # none answered: the last sums stand rather than zeros
                    continue
                self._hand(namespace, policy["name"], summary(replicas, len(endpoints)))
        for claimant, claimed in sorted(refused - self.refused):
            log.warning(
                "pod %s claims policy %s from a namespace whose ext_procs are not read (the policy's own, the "
                "operator's and --extproc-namespaces are); its counters are left out",
                claimant,
                claimed,
            )
        self.refused = refused
        self._failing &= read_pods  # a pod gone is logged afresh should it come back failing

    def _hand(self, namespace: str, name: str, reuse: dict[str, Any]) -> None:
        """To the reconciler, if it says something new (reuse.worth_writing) or the last one
        written is REFRESH_S old."""
        before = self._handed.get((namespace, name))
        due = before is None or (self._rounds - before[1]) * self._interval_s >= REFRESH_S
        if due or worth_writing(before[0] if before else None, reuse):
            self._handed[namespace, name] = reuse, self._rounds
            self._reconciler.set_reuse(namespace, name, reuse)

    async def _read(self, http: aiohttp.ClientSession, pod: str, url: str, policy: str) -> ReplicaReuse | None:
        try:
            # never redirected: a pod in the policy's namespace must not send the operator elsewhere
            async with http.get(f"{url}/metrics", allow_redirects=False) as response:
                if response.status != 200:
                    raise ValueError(f"HTTP {response.status}")
                body = await response.content.read(MAX_METRICS_BYTES + 1)
                if len(body) > MAX_METRICS_BYTES:
                    raise ValueError(f"metrics larger than {MAX_METRICS_BYTES} bytes")
                replica = parse(body.decode("utf-8", "replace"), policy)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            self.errors += 1
            if pod not in self._failing:
                self._failing.add(pod)
                log.warning("cannot read the reuse counters of ext_proc pod %s (%s): %s", pod, url, exc)
            return None
        self._failing.discard(pod)
        return replica
