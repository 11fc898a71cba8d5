"""`kvroute extproc`: the gRPC ext_proc server, gRPC health, the admin port and backend probes,
in one event loop, stopped cleanly on SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import time
from typing import TYPE_CHECKING

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from extproc.admin.app import Admin
from extproc.core.router import Router
from extproc.core.saturation import has_room
from extproc.core.settings import Settings
from extproc.envoy.auth import TokenInterceptor
from extproc.envoy.authz import AccessLogs, Authz
from extproc.envoy.processor import Processor
from extproc.envoy.proto import access_log_pb2_grpc as als_grpc
from extproc.envoy.proto import ext_proc_pb2 as pb
from extproc.envoy.proto import ext_proc_pb2_grpc as pb_grpc
from extproc.envoy.tls import server_credentials, server_ssl_context
from extproc.runtime.config import ExtProcConfig, read_token
from extproc.runtime.metrics import Metrics
from extproc.runtime.placer import PLACEMENT_INTERVAL_S, AdapterPlacer, PlacementCollector
from extproc.runtime.pool import BackendPool
from extproc.runtime.prefill import PrefillLegs
from extproc.runtime.waiting_room import WaitingRoom, WaitingRoomMetrics
from extproc.vllm.feeds import EngineCollector, EngineFeeds
from extproc.vllm.index_mode import IndexModeSwitch
from extproc.vllm.scraper import EngineScraper
from extproc.vllm.subscriber import EventSubscriber

if TYPE_CHECKING:
    from extproc.kube.objectives import ObjectiveWatcher
    from extproc.runtime.tracing import RequestTracer

log = logging.getLogger("kvroute")


# Gateways ping the ext_proc's connection to notice a dead processor (kvroute's own Envoy every
# 10 s). gRPC servers by default count a ping that arrives while they have sent nothing for five
# minutes as a strike and after two answer GOAWAY (too_many_pings), cutting every stream on the
# connection: each request waiting that long for its backend's response lost its response phase.
# A ping costs next to nothing: the gateway's are accepted at any rate, with calls in flight or not.
KEEPALIVE_TOLERANCE = (("grpc.http2.max_ping_strikes", 0), ("grpc.keepalive_permit_without_calls", 1))


def priorities(settings: Settings, objectives: ObjectiveWatcher | None) -> dict[str, int]:
    """Each objective's priority: the policy's objectivePriorities, overridden by InferenceObjectives."""
    merged = dict(settings.objective_priorities)
    if objectives is not None:
        merged.update(objectives.priorities())
    return merged


def tracer_from_environment() -> RequestTracer | None:
    """Traces when the standard OTEL_* variables name an OTLP endpoint; the SDK is loaded only then."""
    from extproc.runtime import tracing

    if not tracing.wanted(os.environ):
        return None
    log.info("tracing on: OTLP spans to %s", next(os.environ[n] for n in tracing.ENDPOINTS if os.environ.get(n)))
    return tracing.RequestTracer.from_environment()


async def serve(config: ExtProcConfig, stop: asyncio.Event) -> None:
    """Run until `stop` is set."""
    router = Router(config.routing)
    pool = BackendPool(config.backends, router.remove_backend, config.unhealthy_after)
    index_mode = IndexModeSwitch(router)
    index_mode.apply(config.routing)
    follower = None
    objectives = None
    if config.policy:  # the Kubernetes client is loaded only by processes that follow a policy
        from extproc.kube.follower import PolicyFollower, load_kubernetes_config
        from extproc.kube.objectives import ObjectiveWatcher

        namespace, name = config.policy.split("/")
        await load_kubernetes_config()
        follower = PolicyFollower(namespace, name, config.routing, router, pool, index_mode.apply)
        objectives = ObjectiveWatcher(namespace, lambda: follower.pool if follower is not None else None)
    policy = follower.state if follower is not None else None
    scraper = EngineScraper(router, pool)
    subscriber = EventSubscriber(router, pool) if config.kv_events else None
    feeds = EngineFeeds(router, index_mode, scraper, subscriber)
    metrics = Metrics(router, pool, policy)
    metrics.registry.register(EngineCollector(feeds))
    clock = time.monotonic
    room = WaitingRoom(
        lambda: router.settings,
        lambda backends: has_room(
            router.loads, [b.address for b in backends if b.healthy], router.settings, clock(), router.block_tokens()
        ),
        WaitingRoomMetrics(metrics.registry),
        clock,
    )
    link = None
    if config.replica_store:  # siblings share learning, sessions and load through the store
        from extproc.replicas.redis_link import ReplicaCollector, connect

        group = config.replica_group or f"kvroute:{config.policy or 'default'}"
        link = connect(router, pool, config.replica_store, config.replica_store_password_file, group, room.queue)
        router.join(link, secrets.randbelow(1 << 30))
        metrics.registry.register(ReplicaCollector(link))
    legs = PrefillLegs()  # split requests' prefill legs (a disaggregated fleet's)
    # LoRA adapters the policy places (none: idle); with siblings, one replica moves an adapter
    placer = AdapterPlacer(router, pool, claim=link.claim if link is not None else None)
    metrics.registry.register(PlacementCollector(placer.placement))
    tracer = tracer_from_environment()

    limit = config.max_message_bytes
    interceptors = []
    token = read_token(config.grpc_token_file) if config.grpc_token_file else ""
    if token:
        refused = metrics.errors.labels("unauthenticated_stream")
        interceptors.append(TokenInterceptor(token, refused.inc))
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            ("grpc.max_concurrent_streams", config.max_streams),
            *KEEPALIVE_TOLERANCE,
        ],
    )
    processor = Processor(
        router,
        pool,
        metrics,
        clock=clock,
        max_stream_age_s=config.max_stream_age_s,
        fallback=config.destination_fallback,
        waiting_room=room,
        priorities=lambda: priorities(router.settings, objectives),
        prefill_legs=legs,
        placer=placer,
        tracer=tracer,
    )
    pb_grpc.add_ExternalProcessorServicer_to_server(processor, server)  # type: ignore[no-untyped-call]  # generated, untyped
    authz = None
    if config.authz_port:  # the ext_authz transport: routes over HTTP, ends from Envoy's access log
        authz = Authz(
            processor,
            pool,
            metrics,
            token,
            clock,
            config.max_stream_age_s,
            replica=link.replica if link is not None else "",
            forward=link.forward_end if link is not None else None,
        )
        if link is not None:
            link.on_end = authz.ended_elsewhere
        als_grpc.add_AccessLogServiceServicer_to_server(AccessLogs(authz), server)  # type: ignore[no-untyped-call]  # generated, untyped
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{config.grpc_host}:{config.grpc_port}"
    host = config.grpc_host if config.grpc_tls_self_signed else ""
    credentials = server_credentials(
        config.grpc_tls_cert_file, config.grpc_tls_key_file, host, config.grpc_tls_client_ca_file
    )
    if credentials is None:
        server.add_insecure_port(address)
    else:
        server.add_secure_port(address, credentials)
    admin = Admin(
        router,
        pool,
        metrics,
        policy,
        lease_ttl_s=config.lease_ttl_s,
        details=lambda: {
            **feeds.state(),
            "queue": room.state(),
            **({} if link is None else {"replicas": link.state()}),
            **({} if authz is None else {"authz": authz.state()}),
        },
        warnings=lambda: [
            *feeds.warnings(),
            *(() if link is None else link.warnings()),
            *(() if authz is None else authz.warnings()),
        ],
    )
    async with contextlib.AsyncExitStack() as cleanup:  # torn down in reverse, each step whatever failed before
        if tracer is not None:  # last: the spans of requests answered while stopping are exported too
            cleanup.push_async_callback(asyncio.to_thread, tracer.shutdown)
        cleanup.push_async_callback(legs.close)
        monitoring = web.AppRunner(admin.monitoring_app(), access_log=None)
        await monitoring.setup()
        cleanup.push_async_callback(monitoring.cleanup)
        await web.TCPSite(monitoring, config.admin_host, config.admin_port).start()
        if config.control_port:
            control = web.AppRunner(admin.control_app(read_token(config.control_token_file)), access_log=None)
            await control.setup()
            cleanup.push_async_callback(control.cleanup)
            await web.TCPSite(control, config.control_host, config.control_port).start()
        await server.start()
        # Torn down after the server (pushed before it): the replica link goes on forwarding the
        # ends the access-log stream brings until that stream is closed, and flushes them as it
        # stops; stopped earlier, a sibling's requests ended here would stay in flight there.
        tasks: list[asyncio.Task[None]] = []
        cleanup.push_async_callback(stop_tasks, tasks)
        if authz is not None:
            cleanup.callback(authz.close_all)  # after the server stops: no entry comes any more
        cleanup.push_async_callback(server.stop, 2)
        if authz is not None:
            # A client that leaves while its request is held cancels Envoy's check call: the handler
            # is cancelled with it, and the request leaves flow control's queue at once.
            checks = web.AppRunner(authz.app(), access_log=None, handler_cancellation=True)
            await checks.setup()
            cleanup.push_async_callback(checks.cleanup)
            files = (config.grpc_tls_cert_file, config.grpc_tls_key_file, config.grpc_tls_client_ca_file)
            tls = server_ssl_context(*files)
            await web.TCPSite(checks, config.grpc_host, config.authz_port, ssl_context=tls).start()
        cleanup.callback(room.drain)  # before the server stops: what is held is answered, not cut
        # The endpoint-picker protocol's health services, as gateways probe them, besides the server's own.
        processor_service = pb.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name
        for service in ("", "liveness", "readiness", processor_service):
            await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
        admin.serving = True
        tasks += [
            asyncio.create_task(
                pool.probe_forever(config.health_interval_s, config.health_timeout_s, config.health_probes_per_s)
            ),
            asyncio.create_task(admin.expire_forever(max(1.0, config.lease_ttl_s / 4))),
            asyncio.create_task(room.run()),
            asyncio.create_task(placer.run(PLACEMENT_INTERVAL_S)),
        ]
        if config.engine_scrape_interval_s > 0:
            tasks.append(asyncio.create_task(scraper.run(config.engine_scrape_interval_s, config.engine_scrapes_per_s)))
        if subscriber is not None:
            tasks.append(asyncio.create_task(subscriber.run()))
        if follower is not None:
            tasks.append(asyncio.create_task(follower.run()))
        if objectives is not None:
            tasks.append(asyncio.create_task(objectives.run()))
        if link is not None:
            tasks.append(asyncio.create_task(link.run()))
        if authz is not None:
            tasks.append(asyncio.create_task(authz.sweep_forever()))
        cleanup.push_async_callback(health_servicer.enter_graceful_shutdown)
        cleanup.callback(setattr, admin, "serving", False)
        log.info(
            "ext_proc on %s:%d, admin on http://%s:%d, %d backends",
            config.grpc_host,
            config.grpc_port,
            config.admin_host,
            config.admin_port,
            len(config.backends),
        )
        await stop.wait()


async def stop_tasks(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel the background tasks and wait for them; one that had already failed is logged, and
    never keeps the rest of the shutdown from running."""
    for task in tasks:
        task.cancel()
    for task, result in zip(tasks, await asyncio.gather(*tasks, return_exceptions=True), strict=True):
        if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
            log.error("background task %s had failed: %r", task.get_coro(), result)


def main(config: ExtProcConfig) -> None:
    """Blocking entry point."""
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(config, stop)

    asyncio.run(run())
