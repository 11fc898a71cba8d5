"""Follow one KVRoutingPolicy live: its status names the backends, its spec the routing settings.

The operator publishes ready backends in the policy's status; this module watches that single
object and applies it to the running router and backend pool, with no restart. If the API server
goes away, routing continues with the last known backend set, and /readyz and
`kvroute_policy_connected` say so.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from kubernetes_asyncio import client, config

from extproc.core.backends import Backend, Role, parse_address
from extproc.core.policy import GROUP, PLURAL, VERSION, ready_backends, routing_changes
from extproc.core.router import Router
from extproc.core.settings import Settings
from extproc.kube import watching
from extproc.kube.watching import Backoff, follow
from extproc.runtime.policy_state import PolicyState
from extproc.runtime.pool import BackendPool

log = logging.getLogger(__name__)


def backends_from_status(status: Mapping[str, Any] | None) -> tuple[list[Backend], list[str]]:
    """The ready backends the operator published, and why any entry was left out (an address or
    role this process cannot use must not keep the others from being followed)."""
    backends, refused = [], []
    for ip, port, models, role in ready_backends(status):
        try:
            backends.append(Backend(parse_address(f"{ip}:{port}"), frozenset(models), role=Role.parse(role)))
        except (ValueError, TypeError) as exc:
            refused.append(f"{ip}:{port}: {exc}"[:200])
    return backends, refused


class PolicyFollower:
    """Keeps a router and pool in step with one policy."""

    def __init__(
        self,
        namespace: str,
        name: str,
        base: Settings,
        router: Router,
        pool: BackendPool,
        on_settings: Callable[[Settings], Awaitable[str | None]] | None = None,
    ) -> None:
        """`on_settings` runs after the router took new settings (the index mode follows them: a
        tokenizer is read off the loop); a problem it returns is reported on the policy as a
        Warning event."""
        self.namespace = namespace
        self.name = name
        self._base = base
        self._router = router
        self._pool = pool
        self._on_settings = on_settings
        self._configuration: client.Configuration | None = None
        self._settling: set[asyncio.Task[None]] = set()
        self.state = PolicyState(f"{namespace}/{name}")
        self.pool: str | None = None  # the InferencePool the policy names (spec.poolRef), if any

    def apply(self, event_type: str, policy: Mapping[str, Any]) -> None:
        """Apply one watch event (ADDED, MODIFIED, DELETED) for the followed policy."""
        if event_type == "DELETED":  # nothing of it stays: its pool, its refusals, its fields
            log.warning("policy %s/%s was deleted: no backends to route to", self.namespace, self.name)
            self._pool.replace([])
            self.pool = None
            self.state.unknown_fields = []
            self.state.problems = ["the policy does not exist (deleted or not yet created): no backends to route to"]
            return
        pool_ref = (policy.get("spec") or {}).get("poolRef")
        self.pool = pool_ref.get("name") if isinstance(pool_ref, Mapping) and pool_ref.get("name") else None
        backends, refused = backends_from_status(policy.get("status"))
        problems = [f"backend {entry} left out" for entry in refused]
        try:
            changes, unknown = routing_changes((policy.get("spec") or {}).get("routing"))
            settings = dataclasses.replace(self._base, **changes)
        except (ValueError, TypeError) as exc:  # the last good settings stay; the backends still follow
            problems.insert(0, f"spec.routing rejected, the last accepted settings kept: {exc}")
        else:
            if unknown != self.state.unknown_fields:
                self.state.unknown_fields = unknown
                if unknown:
                    log.warning(
                        "policy %s/%s: ignoring unknown spec.routing fields %s", self.namespace, self.name, unknown
                    )
            if settings != self._router.settings:
                self._router.reconfigure(settings)
                if self._on_settings is not None:
                    settled = self._settle(policy, self._on_settings(settings))
                    task = asyncio.get_running_loop().create_task(settled)
                    self._settling.add(task)
                    task.add_done_callback(self._settling.discard)
        if problems != self.state.problems:
            for problem in problems:
                log.error("policy %s/%s: %s", self.namespace, self.name, problem)
        self.state.problems = problems
        self._pool.replace(backends)
        self.state.generation = (policy.get("metadata") or {}).get("generation", 0)

    async def _settle(self, policy: Mapping[str, Any], following: Awaitable[str | None]) -> None:
        """What follows new settings (`on_settings`), its problem reported, off the watch."""
        problem = await following
        if problem is not None:
            await self._report(policy, problem)

    async def _report(self, policy: Mapping[str, Any], problem: str) -> None:
        """A Warning event on the policy (`kubectl describe kvroutingpolicy` shows it); best effort."""
        metadata = policy.get("metadata") or {}
        now = datetime.datetime.now(datetime.UTC)
        instance = os.environ.get("HOSTNAME", "kvroute-extproc")
        event = client.EventsV1Event(
            metadata=client.V1ObjectMeta(generate_name=f"{self.name}-", namespace=self.namespace),
            event_time=now,
            type="Warning",
            reason="PreciseIndexUnavailable",
            action="LoadTokenizer",
            note=problem[:1024],
            reporting_controller="kvroute.io/extproc",
            reporting_instance=instance[:128],
            regarding=client.V1ObjectReference(
                api_version=f"{GROUP}/{VERSION}",
                kind="KVRoutingPolicy",
                name=self.name,
                namespace=self.namespace,
                uid=metadata.get("uid"),
            ),
        )
        try:
            async with client.ApiClient(self._configuration) as api:
                await client.EventsV1Api(api).create_namespaced_event(
                    self.namespace, event, _request_timeout=watching.CALL_TIMEOUT
                )
        except Exception as exc:  # reporting must never disturb following or routing
            detail = str(getattr(exc, "body", "") or exc)[:300]
            log.warning("could not post an event on policy %s/%s: %s", self.namespace, self.name, detail)

    async def run(self, configuration: client.Configuration | None = None) -> None:
        """List then watch, forever; on any failure keep the last state and start over."""
        self._configuration = configuration
        field_selector = f"metadata.name={self.name}"
        loop = asyncio.get_running_loop()
        backoff = Backoff()
        while True:
            try:
                async with client.ApiClient(configuration) as api:
                    objects = client.CustomObjectsApi(api)
                    listing = await objects.list_namespaced_custom_object(
                        GROUP,
                        VERSION,
                        self.namespace,
                        PLURAL,
                        field_selector=field_selector,
                        _request_timeout=watching.CALL_TIMEOUT,
                    )
                    items = listing.get("items") or []
                    self.apply("ADDED" if items else "DELETED", items[0] if items else {})
                    self.state.connected, self.state.last_error = True, None
                    backoff.listed()
                    args = (GROUP, VERSION, self.namespace, PLURAL)
                    version_seen = listing["metadata"]["resourceVersion"]
                    watched = loop.time()
                    await follow(
                        objects.list_namespaced_custom_object,
                        args,
                        version_seen,
                        self.apply,
                        field_selector=field_selector,
                    )
                await asyncio.sleep(backoff.after_watch(loop.time() - watched))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the API server is away or the watch broke: relist later
                self.state.connected = False
                self.state.last_error = f"{type(exc).__name__}: {exc}"
                log.warning("policy watch failed (%s); routing with the last known backends", self.state.last_error)
                await asyncio.sleep(backoff.failed())


async def load_kubernetes_config() -> None:
    """In-cluster credentials, or the local kubeconfig when run outside a cluster."""
    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]  # kubernetes-asyncio ships no types
    except config.ConfigException:
        await config.load_kube_config()
