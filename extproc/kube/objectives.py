"""Follow the InferenceObjectives of the policy's namespace: the priority each one gives the
requests that name it (flow control's bands).

The ext_proc reads them with its own read-only rights. The current API (`llm-d.ai/v1alpha2`) is
read where it is installed, else the deprecated `inference.networking.x-k8s.io/v1alpha2`; with
neither, every request has the default priority and the CRDs are looked for again every minute.
Only objectives whose `poolRef` names the policy's InferencePool count, when it names one. If the
API server goes away, the last known priorities stay.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from extproc.core.policy import OBJECTIVE_APIS, OBJECTIVE_PLURAL, objective_terms
from extproc.kube import watching
from extproc.kube.watching import Backoff, follow

log = logging.getLogger(__name__)

ABSENT_RETRY_S = 60.0  # neither CRD installed: look again this often
MAX_OBJECTIVES = 10_000


class ObjectiveWatcher:
    """Name -> priority of every InferenceObjective that applies."""

    def __init__(self, namespace: str, pool: Callable[[], str | None] = lambda: None) -> None:
        """`pool`: the InferencePool the policy names now (None: every objective counts)."""
        self.namespace = namespace
        self._pool = pool
        self._objectives: dict[str, tuple[str | None, int]] = {}  # name -> (its pool, its priority)
        self._view: tuple[str | None, dict[str, int]] | None = None  # priorities() for one pool, until a change
        self.api: tuple[str, str] | None = None  # the group and version followed
        self.connected = False
        self.last_error: str | None = None

    def apply(self, event_type: str, objective: Mapping[str, Any]) -> None:
        """One watch event for an objective."""
        name = (objective.get("metadata") or {}).get("name")
        if not isinstance(name, str):
            return
        terms = None if event_type == "DELETED" else objective_terms(objective)
        self._view = None
        if terms is None:
            self._objectives.pop(name, None)
        elif name in self._objectives or len(self._objectives) < MAX_OBJECTIVES:
            self._objectives[name] = terms

    def warnings(self) -> list[str]:
        """/readyz's: while the watch is down every objective keeps the priority last read, and a
        new one has the default."""
        if self.connected or self.last_error is None:
            return []
        return [f"InferenceObjective watch down ({self.last_error}); the last known priorities apply"]

    def priorities(self) -> dict[str, int]:
        """Name -> priority of the objectives of the policy's pool (all, when it names none)."""
        pool = self._pool()
        if self._view is None or self._view[0] != pool:
            mine = {name: p for name, (owner, p) in self._objectives.items() if pool is None or owner == pool}
            self._view = (pool, mine)
        return self._view[1]

    async def _listing(self, objects: client.CustomObjectsApi) -> tuple[tuple[str, str], dict[str, Any]] | None:
        """The first installed API this process may read and its objectives, or None when neither
        is installed. An API it may not list (403: a Role granting only the other group) is passed
        over like an absent one, and raised only when no API answered."""
        refused: ApiException | None = None
        for group, version in OBJECTIVE_APIS:
            try:
                listing = await objects.list_namespaced_custom_object(
                    group, version, self.namespace, OBJECTIVE_PLURAL, _request_timeout=watching.CALL_TIMEOUT
                )
            except ApiException as exc:
                if exc.status == 404:  # that CRD is not installed
                    continue
                if exc.status == 403:
                    refused = refused or exc
                    continue
                raise
            return (group, version), listing
        if refused is not None:
            raise refused
        return None

    async def run(self, configuration: client.Configuration | None = None) -> None:
        """List then watch, forever; on any failure keep the last priorities and start over."""
        loop = asyncio.get_running_loop()
        backoff = Backoff()
        while True:
            try:
                async with client.ApiClient(configuration) as api:
                    objects = client.CustomObjectsApi(api)
                    found = await self._listing(objects)
                    backoff.listed()
                    if found is None:
                        if self.api is not None or not self.connected:
                            log.info("no InferenceObjective CRD installed: every request has the default priority")
                        self.api, self._objectives, self._view, self.connected = None, {}, None, True
                        self.last_error = None
                        await asyncio.sleep(ABSENT_RETRY_S)
                        continue
                    (group, version), listing = found
                    self.api = (group, version)
                    self._objectives, self._view = {}, None
                    for item in listing.get("items") or []:
                        self.apply("ADDED", item)
                    self.connected, self.last_error = True, None
                    version_seen = listing["metadata"]["resourceVersion"]
                    args = (group, version, self.namespace, OBJECTIVE_PLURAL)
                    watched = loop.time()
                    await follow(objects.list_namespaced_custom_object, args, version_seen, self.apply)
                await asyncio.sleep(backoff.after_watch(loop.time() - watched))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the API server is away or the watch broke: relist later
                if self.connected or self.last_error is None:
                    log.warning("InferenceObjective watch failed (%s); keeping the last priorities", exc)
                self.connected = False
                self.last_error = f"{type(exc).__name__}: {str(exc)[:300]}"
                await asyncio.sleep(backoff.failed())
