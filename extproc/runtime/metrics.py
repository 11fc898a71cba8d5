"""Prometheus metrics of one ext_proc process.

Counters and the latency histogram are updated on the request path; sizes and per-backend load
are read from the router at scrape time, so they can never drift from the real state.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from extproc.core.router import Router
from extproc.kube.follower import PolicyFollower
from extproc.runtime.pool import BackendPool


class _StateCollector(Collector):
    def __init__(self, router: Router, pool: BackendPool, follower: PolicyFollower | None) -> None:
        self._router = router
        self._pool = pool
        self._follower = follower

    def collect(self) -> Iterator[GaugeMetricFamily]:
        state = self._router.state()
        yield GaugeMetricFamily(
            "kvroute_index_entries", "(block, backend) locations held", value=state["index_entries"]
        )
        yield GaugeMetricFamily("kvroute_sessions", "session bindings held", value=state["sessions"])
        reserved = GaugeMetricFamily("kvroute_backend_reserved_blocks", "prefill blocks reserved", labels=["backend"])
        active = GaugeMetricFamily("kvroute_backend_active_requests", "requests in flight", labels=["backend"])
        for backend, load in state["load"].items():
            reserved.add_metric([backend], load["reserved_blocks"])
            active.add_metric([backend], load["active"])
        yield reserved
        yield active
        healthy = GaugeMetricFamily("kvroute_backend_healthy", "1 if the backend is routable", labels=["backend"])
        for backend in self._pool.backends:
            healthy.add_metric([backend.address], float(backend.healthy))
        yield healthy
        if self._follower is not None:
            yield GaugeMetricFamily(
                "kvroute_policy_connected",
                "1 while the KVRoutingPolicy watch is live; 0 means routing with the last known backends",
                value=float(self._follower.connected),
            )


class Metrics:
    """The process's metrics, in a registry of its own."""

    def __init__(self, router: Router, pool: BackendPool, follower: PolicyFollower | None = None) -> None:
        self.registry = CollectorRegistry()
        self.decisions = Counter(
            "kvroute_decisions", "routing decisions by label", ["decision"], registry=self.registry
        )
        self.decision_seconds = Histogram(
            "kvroute_decision_seconds",
            "CPU time from body to decision",
            buckets=(50e-6, 100e-6, 200e-6, 400e-6, 800e-6, 1.6e-3, 3.2e-3, 6.4e-3, 12.8e-3, 25.6e-3, 51.2e-3),
            registry=self.registry,
        )
        self.errors = Counter(
            "kvroute_errors", "requests kvroute could not handle, by kind", ["kind"], registry=self.registry
        )
        self.learned = Counter("kvroute_learned", "successful responses that taught the index", registry=self.registry)
        self.rerouted = Counter(
            "kvroute_rerouted", "responses served by another backend than the first choice", registry=self.registry
        )
        self.registry.register(_StateCollector(router, pool, follower))
