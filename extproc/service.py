"""`kvroute extproc`: the gRPC ext_proc server, gRPC health, the admin port and backend probes,
in one event loop, stopped cleanly on SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import signal
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from extproc.admin.app import Admin
from extproc.envoy.auth import TokenInterceptor
from extproc.envoy.authz import Authz
from extproc.envoy.dispatch import PolicyDispatch
from extproc.envoy.proto import ext_proc_pb2 as pb
from extproc.envoy.proto import ext_proc_pb2_grpc as pb_grpc
from extproc.envoy.tls import server_credentials, server_ssl_context
from extproc.runtime import tracing_wanted
from extproc.runtime.config import ExtProcConfig, read_token
from extproc.runtime.metrics import PolicyLabelled
from extproc.runtime.prefill import PrefillLegs
from extproc.units import build_unit

if TYPE_CHECKING:
    from extproc.runtime.tracing import RequestTracer

log = logging.getLogger("kvroute")


# Gateways ping the ext_proc's connection to notice a dead processor (kvroute's own Envoy every
# 10 s). gRPC servers by default count a ping that arrives while they have sent nothing for five
# minutes as a strike and after two answer GOAWAY (too_many_pings), cutting every stream on the
# connection: each request waiting that long for its backend's response lost its response phase.
# A ping costs next to nothing: the gateway's are accepted at any rate, with calls in flight or not.
STOP_GRACE_S = 2.0  # what a stopping ext_proc gives the calls it is deciding to be answered
TASKS_STOP_S = 5.0  # what it gives its background tasks to stop (the replica link flushes within 2 s)
KEEPALIVE_TOLERANCE = (("grpc.http2.max_ping_strikes", 0), ("grpc.keepalive_permit_without_calls", 1))


def tracer_from_environment() -> RequestTracer | None:
    """Traces when the standard OTEL_* variables name an OTLP endpoint; the SDK is loaded only then."""
    if not tracing_wanted.wanted(os.environ):
        return None
    from extproc.runtime import tracing

    endpoint = next(os.environ[n] for n in tracing_wanted.ENDPOINTS if os.environ.get(n))
    log.info("tracing on: OTLP spans to %s", endpoint)
    return tracing.RequestTracer.from_environment()


async def serve(config: ExtProcConfig, stop: asyncio.Event) -> None:
    """Run until `stop` is set."""
    legs = PrefillLegs()  # split requests' prefill legs (a disaggregated fleet's)
    tracer = tracer_from_environment()
    configured = config.units()
    several = len(configured) > 1
    units = [await build_unit(config, unit, several, legs, tracer) for unit in configured]
    first = units[0]
    processor, metrics, link = first.processor, first.metrics, first.link
    registry = metrics.registry
    dispatch = None
    if several:  # the first policy's processor takes every stream, and hands each to its model's
        dispatch = processor.routes = PolicyDispatch([unit.processor for unit in units])
        registry = CollectorRegistry()
        registry.register(PolicyLabelled([(unit.name, unit.metrics.registry) for unit in units]))

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
    pb_grpc.add_ExternalProcessorServicer_to_server(processor, server)  # type: ignore[no-untyped-call]  # generated, untyped
    authz = None
    if config.authz_port:  # the ext_authz transport: routes over HTTP, ends from Envoy's access log (same port)
        authz = Authz(
            processor,
            metrics,
            token,
            time.monotonic,
            config.max_stream_age_s,
            replica=link.replica if link is not None else "",
            forward=link.forward_end if link is not None else None,
        )
        if link is not None:
            link.on_end = authz.ended_elsewhere
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
    admin = Admin(  # the process's own (ext_authz's) state goes with the first policy's
        first.router,
        first.pool,
        metrics,
        first.policy,
        lease_ttl_s=config.lease_ttl_s,
        details=lambda: {**first.details(), **({} if authz is None else {"authz": authz.state()})},
        warnings=lambda: [*first.warnings(), *(() if authz is None else authz.warnings())],
        name=first.name,
    )
    if dispatch is not None:
        others = [(u.name, u.router, u.pool, u.policy, u.details, u.warnings) for u in units[1:]]
        admin.serve_also(others, lambda model: dispatch.serving(model).router, registry)
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
        # Torn down after the ports (pushed before them): the replica link goes on forwarding the
        # ends the access log brings until its connections are closed, and flushes them as it
        # stops; stopped earlier, a sibling's requests ended here would stay in flight there.
        tasks: list[asyncio.Task[None]] = []
        cleanup.push_async_callback(stop_tasks, tasks)
        if authz is not None:
            cleanup.callback(authz.close_all)  # after the ports close: no entry comes any more
        cleanup.push_async_callback(server.stop, config.stop_grace_s)  # (2 s cut every generation streaming)
        if authz is not None:
            files = (config.grpc_tls_cert_file, config.grpc_tls_key_file, config.grpc_tls_client_ca_file)
            port = await asyncio.get_running_loop().create_server(
                authz.protocols(), config.grpc_host, config.authz_port, ssl=server_ssl_context(*files)
            )
            cleanup.push_async_callback(authz.close_calls, STOP_GRACE_S)  # then the calls, once answered
            cleanup.callback(authz.close_logs)  # then Envoy's log connections
            cleanup.callback(port.close)  # first, no new connection
        for unit in units:  # before the server stops: what is held is answered, not cut
            cleanup.callback(unit.room.drain)
        # The endpoint-picker protocol's health services, as gateways probe them, besides the server's own.
        processor_service = pb.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name
        for service in ("", "liveness", "readiness", processor_service):
            await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
        admin.serving = True
        tasks.append(background(admin.expire_forever(max(1.0, config.lease_ttl_s / 4))))
        tasks += [background(task) for unit in units for task in unit.tasks(config)]
        if authz is not None:
            tasks.append(background(authz.sweep_forever()))
        cleanup.push_async_callback(health_servicer.enter_graceful_shutdown)
        cleanup.callback(setattr, admin, "serving", False)
        log.info(
            "ext_proc on %s:%d, admin on http://%s:%d, %s",
            config.grpc_host,
            config.grpc_port,
            config.admin_host,
            config.admin_port,
            ", ".join(f"policy {u.name}: {len(u.pool.backends)} backends" for u in units),
        )
        await stop.wait()


def background(work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
    """A background task whose failure is logged when it happens, not at shutdown: a loop that
    died (its `except` did not cover what it met) would otherwise go unnoticed until then."""
    task = asyncio.create_task(work)
    task.add_done_callback(_report_failure)
    return task


def _report_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("background task %s failed: %r", task.get_coro(), task.exception())


async def stop_tasks(tasks: list[asyncio.Task[None]], within_s: float = TASKS_STOP_S) -> None:
    """Cancel the background tasks and wait for them, at most `within_s`: one that does not stop
    (a library swallowed its cancel) is logged and left behind, never keeping the rest of the
    shutdown from running."""
    for task in tasks:
        task.cancel()
    if not tasks:
        return
    _, running = await asyncio.wait(tasks, timeout=within_s)
    for task in running:
        log.error("background task %s did not stop within %.0f s; shutting down without it", task.get_coro(), within_s)


def raise_open_files_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit, and return it. Each
    backend holds a kept-alive connection for its scrape and one for its probes, and its KV event
    sockets: past a few hundred backends a soft limit of 1,024 (some hosts' default) would fail
    connections, and a failed probe reads as a dead backend. (Go's runtime does the same.)"""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def main(config: ExtProcConfig) -> None:
    """Blocking entry point."""
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.info("open files limit: %d", raise_open_files_limit())

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(config, stop)

    asyncio.run(run())
