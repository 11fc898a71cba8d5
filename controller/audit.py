"""What kopf's indexes still hold that the API server no longer has.

kopf restarts a watch whose resource version has expired (410 Gone, after the operator was cut off
from the API server for long enough) with a fresh list. It reports every object of that list, but
not those deleted while it was away: they stay in its indexes for good. A pod deleted then would
stay in its policy's status, an address Envoy is sent to even when another pod takes it over; a
policy deleted then would be patched forever (404) and keep the operator unready. So every
interval the operator lists what its indexes cover, and the reconciler leaves out every indexed
object whose uid the list lacks (`stale`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from typing import Any

import orjson
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from controller.reconciler import Reconciler, Snapshot
from extproc.core import policy as contract

log = logging.getLogger(__name__)

PAGE = 500  # objects per list call: a namespace of thousands of pods is read a page at a time
LEADERSHIP_POLL_S = 2.0  # how soon a replica that lost or won the lead is seen to (Auditor.follow)


def uids(snapshot: Snapshot) -> dict[str, set[str]]:
    """namespace -> the uids indexed there (entries without one are never judged)."""
    return {namespace: {e["uid"] for e in entries if e.get("uid")} for namespace, entries in snapshot.items()}


def stale(
    indexed: Mapping[str, Collection[str]],
    listed: Mapping[str, Collection[str]],
    covered: Collection[str] | None = None,
) -> set[str]:
    """The uids indexed (before the list was asked for) in a namespace the list covers (`covered`;
    by default those it names, a cluster-wide list every one), and absent from it. An object
    created after the index was read is not in `indexed`, so a list that predates it cannot
    condemn it."""
    covered = listed.keys() if covered is None else covered
    return {
        uid
        for namespace, known in indexed.items()
        if namespace in covered
        for uid in set(known) - set(listed.get(namespace, ()))
    }


ListPage = Callable[[str | None], Awaitable[dict[str, Any]]]


async def _listed(list_page: ListPage) -> dict[str, set[str]]:
    """namespace -> uids, over every page of one list call."""
    out: dict[str, set[str]] = {}
    token: str | None = None
    while True:
        page = await list_page(token)
        for item in page.get("items") or ():
            metadata = item.get("metadata") or {}
            out.setdefault(metadata.get("namespace") or "", set()).add(metadata.get("uid") or "")
        token = (page.get("metadata") or {}).get("continue") or None
        if token is None:
            return out


async def _json(call: Awaitable[Any]) -> dict[str, Any]:
    """A list call made with `_preload_content=False`: its JSON, parsed once, not into models.
    Unpreloaded, kubernetes-asyncio hands back any status; an error's body (a Status, no items)
    would read as an empty list, condemning everything indexed, so it is raised here."""
    response = await call
    try:
        body = await response.read()
        if not 200 <= response.status <= 299:
            raise ApiException(status=response.status, reason=body[:200].decode("utf-8", "replace"))
        return dict(orjson.loads(body))
    finally:
        response.release()


def _paging(token: str | None) -> dict[str, Any]:
    """A list call's keywords: one page, from `token` on, its JSON left unparsed (`_json`), within
    the calls' time limits (a list never answered held the audit, and the statuses, for good)."""
    paging = {"limit": PAGE, "_preload_content": False, "_request_timeout": contract.CALL_TIMEOUT}
    return {**paging, **({"_continue": token} if token else {})}


async def list_uids(
    api: client.ApiClient, pod_namespaces: Iterable[str], pools: bool
) -> tuple[dict[str, set[str]], dict[str, set[str]], dict[str, set[str]] | None]:
    """What the API server has now: pods of `pod_namespaces` (each namespace covered even if empty),
    every policy, every InferencePool (None where their CRD is not installed)."""
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    pods: dict[str, set[str]] = {}
    for namespace in pod_namespaces:

        def page(token: str | None, namespace: str = namespace) -> Awaitable[dict[str, Any]]:
            return _json(core.list_namespaced_pod(namespace, **_paging(token)))

        pods[namespace] = (await _listed(page)).get(namespace, set())

    def custom_page(group: str, version: str, plural: str) -> ListPage:
        def page(token: str | None) -> Awaitable[dict[str, Any]]:
            return _json(custom.list_cluster_custom_object(group, version, plural, **_paging(token)))

        return page

    policies = await _listed(custom_page(contract.GROUP, contract.VERSION, contract.PLURAL))
    pool_uids: dict[str, set[str]] | None = None
    if pools:
        try:
            pool_uids = await _listed(custom_page(contract.POOL_GROUP, contract.POOL_VERSION, contract.POOL_PLURAL))
        except ApiException as exc:
            if exc.status != 404:  # the CRD went away: nothing of it to judge
                raise
    return pods, policies, pool_uids


class Auditor:
    """One loop: every interval, while `leading`, the reconciler told which indexed objects are gone."""

    def __init__(
        self,
        reconciler: Reconciler,
        interval_s: float,
        leading: Callable[[], Awaitable[bool]],
    ) -> None:
        self._reconciler = reconciler
        self._interval_s = interval_s
        self._leading = leading
        self.errors = 0

    async def run(self) -> None:
        """Forever; survives any error (logged, counted)."""
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                if await self._leading():
                    async with client.ApiClient() as api:
                        await self.audit(api)
            except Exception:
                self.errors += 1
                log.exception("checking the operator's indexes against the API server failed; it goes on")

    async def follow(self, poll_s: float = LEADERSHIP_POLL_S) -> None:
        """Forever: the reconciler writes only while this replica leads and has audited since it
        began to (or began again) to lead. A replica kopf paused keeps its indexes, and the relist
        that resumes it removes nothing deleted meanwhile: without the audit first, the pods
        deleted while another replica led were published ready again, for up to an interval."""
        reconciler = self._reconciler
        reconciler.hold()
        while True:
            try:
                if not await self._leading():
                    reconciler.hold()
                elif reconciler.held:
                    async with client.ApiClient() as api:
                        await self.audit(api)
                    reconciler.release()
            except Exception:
                self.errors += 1
                log.exception("following the operator's leadership failed; it goes on")
            await asyncio.sleep(poll_s)

    async def audit(self, api: client.ApiClient) -> set[str]:
        """Read the indexes, then list; hand the reconciler what the lists lack (also when nothing)."""
        reconciler = self._reconciler
        pods, policies = uids(reconciler.indexed_pods), uids(reconciler.indexed_policies)
        pools = uids(reconciler.indexed_pools)
        # the namespaces whose pods matter: a policy's own, and any holding an ext_proc pod
        ext_procs = {ns for ns, entries in reconciler.indexed_pods.items() if any(e.get("policy") for e in entries)}
        namespaces = sorted(set(policies) | ext_procs)
        listed_pods, listed_policies, listed_pools = await list_uids(api, namespaces, bool(pools))
        gone = stale(pods, listed_pods) | stale(policies, listed_policies, policies.keys())
        if listed_pools is not None:
            gone |= stale(pools, listed_pools, pools.keys())
        if new := gone - reconciler.gone:
            log.warning("%d objects were deleted while the operator's watch was cut off; left out", len(new))
        reconciler.forget(gone)
        return gone
