"""`kvroute controller`: the kopf layer, kept thin. Logic lives in controller/logic.py and
controller/reconciler.py.

kopf keeps three in-memory indexes (pods, policies and InferencePools by namespace); every event
of theirs marks its namespace dirty, and the reconciler writes changed statuses. Only event and
index handlers are used, so kopf writes nothing to the policies itself (no finalizers, no
annotations) and the operator needs no more than read access plus `kvroutingpolicies/status` patch. Replicas
coordinate through kopf peering: the one with the highest priority works, the others wait.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import kopf
from aiohttp import web
from kubernetes_asyncio import client, config
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from controller import logic, metrics
from controller.audit import Auditor
from controller.late_crds import Insights, follow_late_crd
from controller.reconciler import Reconciler
from controller.reuse import leading
from controller.reuse_reader import ReuseReader
from extproc.core import policy as contract

log = logging.getLogger(__name__)
REGISTRY = kopf.OperatorRegistry()
PEERING = "kvroute"  # kopf's ClusterKopfPeering object the replicas coordinate through
# where the kubelet mounts a pod's own namespace beside its service account's token
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
REFUSED_SHOWN = 20  # untrusted ext_proc claims /readyz lists by name (all are counted)


async def _patch_status(namespace: str, name: str, status: dict[str, Any]) -> None:
    async with client.ApiClient() as api:
        await client.CustomObjectsApi(api).patch_namespaced_custom_object_status(
            contract.GROUP,
            contract.VERSION,
            namespace,
            contract.PLURAL,
            name,
            {"status": status},
            _content_type="application/merge-patch+json",  # type: ignore[call-arg]  # taken by its **kwargs
            _request_timeout=contract.CALL_TIMEOUT,  # a half-open connection must not hold every status for good
        )


async def _leading(priority: int) -> bool:
    """Whether kopf's peering lets this replica work (controller/reuse.py `leading`)."""
    async with client.ApiClient() as api:
        peering = await client.CustomObjectsApi(api).get_cluster_custom_object(
            "kopf.dev", "v1", "clusterkopfpeerings", PEERING, _request_timeout=contract.CALL_TIMEOUT
        )
    return leading(peering.get("status"), priority, datetime.datetime.now(datetime.UTC))


def _health_app(reconciler: Reconciler, reader: ReuseReader | None, auditor: Auditor | None) -> web.Application:
    async def healthz(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(_request: web.Request) -> web.Response:
        ok = reconciler.last_error is None
        body: dict[str, Any] = {"ready": ok, "last_error": reconciler.last_error}
        if reader is not None and reader.refused:  # a warning, not unreadiness: the policies are served
            claims = sorted(reader.refused)
            body["untrusted_extprocs"] = [f"{pod} claims {policy}" for pod, policy in claims[:REFUSED_SHOWN]]
            body["untrusted_extprocs_total"] = len(claims)
        return web.json_response(body, status=200 if ok else 503)

    counts = metrics.registry(reconciler, reader, auditor)

    async def exposition(_request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(counts), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", exposition)
    return app


async def _client_configuration() -> client.Configuration:
    """In-cluster credentials, or the local kubeconfig when run outside a cluster."""
    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]  # untyped library
    except config.ConfigException:
        await config.load_kube_config(client_configuration=configuration)
    return configuration


@kopf.on.login(registry=REGISTRY)
async def login(**_: Any) -> kopf.ConnectionInfo:
    """kopf's own API calls use the same credentials as ours (kopf has no built-in login for
    kubernetes-asyncio); kopf calls this again when they stop working (a rotated token)."""
    configuration = await _client_configuration()
    if configuration.refresh_api_key_hook is not None:
        configuration.refresh_api_key_hook(configuration)  # type: ignore[operator]  # untyped library: a callable
    token = configuration.api_key.get("BearerToken") or configuration.api_key.get("authorization") or ""
    return kopf.ConnectionInfo(
        server=configuration.host or "",
        ca_path=configuration.ssl_ca_cert,
        insecure=not configuration.verify_ssl,
        scheme="Bearer" if token else None,
        token=token.removeprefix("Bearer ") or None,
        certificate_path=configuration.cert_file,
        private_key_path=configuration.key_file,
    )


@kopf.on.startup(registry=REGISTRY)
async def start(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Quiet kopf (no events), load API credentials, start the reconciler and probes. CRDs are
    watched so an InferencePool CRD installed after the operator starts is followed without a restart;
    when kopf's rescans on its events all come before discovery serves it, `follow_late_crd` finds it."""
    settings.posting.enabled = False
    settings.peering.mandatory = True
    settings.peering.priority = random.randint(1, 1_000_000)  # distinct priorities: one replica leads
    client.Configuration.set_default(await _client_configuration())
    reconciler = Reconciler(_patch_status)
    priority = settings.peering.priority
    reader = auditor = None
    if memo.reuse_interval_s > 0:
        reader = ReuseReader(reconciler, memo.reuse_interval_s, lambda: _leading(priority), memo.extproc_namespaces)
    if memo.audit_interval_s > 0:
        auditor = Auditor(reconciler, memo.audit_interval_s, lambda: _leading(priority))
    # The probe port first: kopf retries a startup that failed (the port taken), and tasks started
    # before the failure would be left running beside the next attempt's.
    health = web.AppRunner(_health_app(reconciler, reader, auditor), access_log=None)
    await health.setup()
    try:
        await web.TCPSite(health, memo.health_host, memo.health_port).start()
    except BaseException:
        await health.cleanup()
        raise
    memo.health = health
    memo.reconciler = reconciler
    memo.reconciler_task = asyncio.create_task(reconciler.run())
    tasks = [memo.reconciler_task]
    if reader is not None:
        tasks.append(asyncio.create_task(reader.run()))
    if auditor is not None:
        tasks += [asyncio.create_task(auditor.run()), asyncio.create_task(auditor.follow())]
    tasks += [
        asyncio.create_task(follow_late_crd(memo.insights, settings, REGISTRY, group, plural))
        for group, plural in ((contract.GROUP, contract.PLURAL), (contract.POOL_GROUP, contract.POOL_PLURAL))
    ]
    memo.tasks = tasks


@kopf.on.cleanup(registry=REGISTRY)
async def stop(memo: kopf.Memo, **_: Any) -> None:
    """Every task cancelled and awaited (one that had failed is logged, not raised: the rest still
    stop), then the probe port."""
    tasks = memo.get("tasks", [])
    for task in tasks:
        task.cancel()
    for task, result in zip(tasks, await asyncio.gather(*tasks, return_exceptions=True), strict=True):
        if isinstance(result, Exception):
            log.error("operator task %s had failed: %r", task.get_coro(), result)
    if "health" in memo:
        await memo.health.cleanup()


@kopf.index("", "v1", "pods", registry=REGISTRY)
def pods_by_namespace(namespace: str | None, body: kopf.Body, **_: Any) -> dict[str, dict[str, Any]]:
    return {namespace or "": logic.pod_summary(body)}  # pods are namespaced: kopf always names one


@kopf.index(contract.GROUP, contract.VERSION, contract.PLURAL, registry=REGISTRY)
def policies_by_namespace(namespace: str | None, name: str, body: kopf.Body, **_: Any) -> dict[str, dict[str, Any]]:
    return {
        namespace or "": {
            "name": name,
            "uid": body.metadata.uid or "",
            "metadata": {"generation": body.metadata.get("generation", 0)},
            "spec": dict(body.spec),
            "status": dict(body.status),
        }
    }


@kopf.index(contract.POOL_GROUP, contract.POOL_VERSION, contract.POOL_PLURAL, registry=REGISTRY)
def pools_by_namespace(namespace: str | None, body: kopf.Body, **_: Any) -> dict[str, dict[str, Any]]:
    return {namespace or "": logic.pool_summary(body)}


# kopf passes its indices as keywords that its handler protocol does not list, so mypy cannot
# match this function to it
@kopf.on.event("", "v1", "pods", registry=REGISTRY)
@kopf.on.event(contract.GROUP, contract.VERSION, contract.PLURAL, registry=REGISTRY)
@kopf.on.event(contract.POOL_GROUP, contract.POOL_VERSION, contract.POOL_PLURAL, registry=REGISTRY)  # type: ignore[arg-type]
async def changed(
    namespace: str | None,
    memo: kopf.Memo,
    pods_by_namespace: kopf.Index[str, dict[str, Any]],
    policies_by_namespace: kopf.Index[str, dict[str, Any]],
    pools_by_namespace: kopf.Index[str, dict[str, Any]],
    **_: Any,
) -> None:
    """Any pod, policy or InferencePool event: settle that namespace's policies soon. A coroutine,
    so that kopf runs it on the event loop: a plain function would run in its thread pool, and
    the reconciler's wake-up event and set of namespaces are the loop's alone."""
    memo.reconciler.touch(namespace or "", pods_by_namespace, policies_by_namespace, pools_by_namespace)


def trusted_namespaces(extra: Sequence[str] = (), path: Path = SERVICE_ACCOUNT_NAMESPACE) -> tuple[str, ...]:
    """Namespaces whose ext_proc pods may report for any policy: the one the operator runs in (its
    service account's mount; none outside a cluster) and `extra`."""
    try:
        own = path.read_text().strip()
    except OSError:
        own = ""
    return tuple(dict.fromkeys(n for n in (own, *extra) if n))


def main(
    health_host: str = "0.0.0.0",
    health_port: int = 8080,
    reuse_interval_s: float = 30.0,
    audit_interval_s: float = 60.0,
    extproc_namespaces: Sequence[str] = (),
) -> None:
    """Blocking entry point: all namespaces, peering on; /healthz and /readyz on the health port;
    the ext_procs' reuse counters read every `reuse_interval_s` (0: never), from a policy's own
    namespace, the operator's and `extproc_namespaces`; the indexes checked against the API server
    every `audit_interval_s` (controller/audit.py; 0: never)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    insights = Insights()  # what kopf follows; shared so that late CRDs can be looked up again
    memo = kopf.Memo(
        health_host=health_host,
        health_port=health_port,
        insights=insights,
        reuse_interval_s=reuse_interval_s,
        audit_interval_s=audit_interval_s,
        extproc_namespaces=trusted_namespaces(extproc_namespaces),
    )
    kopf.run(registry=REGISTRY, clusterwide=True, peering_name=PEERING, memo=memo, insights=insights)
