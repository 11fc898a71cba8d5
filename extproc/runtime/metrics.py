"""Prometheus metrics of one ext_proc process.

What the routing core did (decisions, learning, reroutes) and the sizes and per-backend load it
holds are read from the router at scrape time, so they can never drift from the real state;
the adapters count their own failures and time the decision path.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from extproc.core.attribution import ReuseAttribution
from extproc.core.router import Router
from extproc.runtime.policy_state import PolicyState
from extproc.runtime.pool import BackendPool


def _reuse(reuse: ReuseAttribution) -> Iterator[Metric]:
    """Prefix reuse won or lost (attribution.py): routing efficiency is routed / available, the
    picture's accuracy delivered / routed (delivered counts each backend's whole traffic)."""
    yield CounterMetricFamily("kvroute_prompt_tokens", "prompt tokens of requests served 2xx", value=reuse.prompt)
    yield CounterMetricFamily(
        "kvroute_reuse_available_tokens",
        "longest cached prefix any candidate held, by kvroute's picture, per request served",
        value=reuse.available,
    )
    for name, sums, help_text in (
        ("routed", reuse.routed, "cached prefix on the backend that served, by kvroute's picture"),
        ("delivered", reuse.delivered, "prompt tokens the engine found cached (its prefix-cache counter)"),
        ("reported", reuse.reported, "prompt tokens the responses kvroute read reported cached (full-duplex bodies)"),
        ("reported_routed", reuse.reported_routed, "cached prefix by kvroute's picture, of those same responses"),
    ):
        family = CounterMetricFamily(f"kvroute_reuse_{name}_tokens", help_text, labels=["backend"])
        for backend, tokens in sums.items():
            family.add_metric([backend], tokens)
        yield family


class _RouterCollector(Collector):
    def __init__(self, router: Router, pool: BackendPool, policy: PolicyState | None) -> None:
        self._router = router
        self._pool = pool
        self._policy = policy

    def collect(self) -> Iterator[Metric]:
        stats = self._router.stats
        decisions = CounterMetricFamily("kvroute_decisions", "routing decisions by label", labels=["decision"])
        for label, count in stats.decisions.items():
            decisions.add_metric([label], count)
        yield decisions
        yield CounterMetricFamily("kvroute_learned", "successful responses that taught the index", value=stats.learned)
        yield CounterMetricFamily(
            "kvroute_rerouted", "responses served by another backend than the first choice", value=stats.rerouted
        )
        state = self._router.state()
        yield GaugeMetricFamily("kvroute_index_entries", "(block, backend) locations held", value=state.index_entries)
        yield CounterMetricFamily(
            "kvroute_index_shed",
            "locations dropped, coldest first, to keep the index within indexMemoryMiB",
            value=state.index_shed,
        )
        yield GaugeMetricFamily("kvroute_sessions", "session bindings held", value=state.sessions)
        yield GaugeMetricFamily(
            "kvroute_bytes_per_token",
            "canonical prompt bytes per engine token, learned from the engines' prompt-token counters",
            value=state.bytes_per_token,
        )
        yield GaugeMetricFamily(
            "kvroute_cache_pressure",
            "share of their previous prompt that returning conversations find evicted (running mean)",
            value=state.cache_pressure,
        )
        yield GaugeMetricFamily(
            "kvroute_balance_gate_factor",
            "how much wider than configured the balance gates are under cache pressure while no backend is idle "
            "(1 with cachePressureGates off)",
            value=state.gate_factor,
        )
        yield GaugeMetricFamily("kvroute_prefix_homes", "prompt heads with a home backend", value=state.prefix_homes)
        yield from _reuse(self._router.attribution)
        reserved = GaugeMetricFamily("kvroute_backend_reserved_blocks", "prefill blocks reserved", labels=["backend"])
        active = GaugeMetricFamily("kvroute_backend_active_requests", "requests in flight", labels=["backend"])
        footprint = GaugeMetricFamily(
            "kvroute_backend_footprint_blocks",
            "distinct blocks of the prompts of this replica's requests in flight (the KV cache they take as they run)",
            labels=["backend"],
        )
        for backend, load in state.load.items():
            reserved.add_metric([backend], load.reserved_blocks)
            active.add_metric([backend], load.active)
            footprint.add_metric([backend], load.footprint_blocks)
        yield reserved
        yield active
        yield footprint
        ttft = self._router.ttft
        yield CounterMetricFamily(
            "kvroute_ttft_observations",
            "requests whose prefill kvroute saw stored (KV events): its time-to-first-token model's evidence",
            value=ttft.observed,
        )
        yield CounterMetricFamily(
            "kvroute_ttft_predictions",
            "of those, requests kvroute had predicted a time to first token for when it sent them",
            value=ttft.predicted,
        )
        yield CounterMetricFamily(
            "kvroute_ttft_prediction_error_seconds",
            "summed absolute error of those predictions (over kvroute_ttft_predictions_total: the mean)",
            value=ttft.error_seconds,
        )
        trust = GaugeMetricFamily(
            "kvroute_backend_prediction_trust",
            "share of the cached prefix kvroute predicts there that the engine's own counters confirm (at most 1)",
            labels=["backend"],
        )
        for backend in state.load:
            trust.add_metric([backend], self._router.trust.of(backend))
        yield trust
        healthy = GaugeMetricFamily("kvroute_backend_healthy", "1 if the backend is routable", labels=["backend"])
        for member in self._pool.backends:
            healthy.add_metric([member.address], float(member.healthy))
        yield healthy
        if self._policy is not None:
            yield GaugeMetricFamily(
                "kvroute_policy_connected",
                "1 while the KVRoutingPolicy watch is live; 0 means routing with the last known backends",
                value=float(self._policy.connected),
            )


class Metrics:
    """The process's metrics, in a registry of its own."""

    def __init__(self, router: Router, pool: BackendPool, policy: PolicyState | None = None) -> None:
        self.registry = CollectorRegistry()
        self.decision_seconds = Histogram(
            "kvroute_decision_seconds",
            "CPU time from body to decision",
            buckets=(50e-6, 100e-6, 200e-6, 400e-6, 800e-6, 1.6e-3, 3.2e-3, 6.4e-3, 12.8e-3, 25.6e-3, 51.2e-3),
            registry=self.registry,
        )
        self.errors = Counter(
            "kvroute_errors", "requests kvroute could not handle, by kind", ["kind"], registry=self.registry
        )
        self.disaggregation = Counter(
            "kvroute_disaggregation",
            "Requests a disaggregated fleet split (split: prefill leg done, decoded with its KV blocks) or "
            "served whole although split was chosen, by why (status, timeout, connect, parameters; transport: "
            "Envoy asks over ext_authz, which cannot split); and requests whose client-set kv_transfer_params "
            "were stripped",
            ["outcome"],
            registry=self.registry,
        )
        self.registry.register(_RouterCollector(router, pool, policy))


class PolicyLabelled(Collector):
    """Several policies' metrics in one exposition: each policy keeps its own registry, and each
    of its samples gains a `policy` label here, so one family holds every policy's series."""

    def __init__(self, registries: Sequence[tuple[str, CollectorRegistry]]) -> None:
        self._registries = registries

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for policy, registry in self._registries:
            for family in registry.collect():
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                for sample in family.samples:
                    labels = {**sample.labels, "policy": policy}
                    merged.add_sample(sample.name, labels, sample.value, sample.timestamp, sample.exemplar)
        yield from families.values()
