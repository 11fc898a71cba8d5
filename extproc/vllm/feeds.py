"""Everything that follows the engines themselves, in one place for the service, /readyz,
/debug/state and /metrics: the index mode (with its tokenizer), the /metrics scraper and the KV
event subscriber."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from extproc.core.router import Router
from extproc.vllm.index_mode import IndexModeSwitch
from extproc.vllm.scraper import EngineScraper
from extproc.vllm.subscriber import EventSubscriber


@dataclass(slots=True)
class EngineFeeds:
    """The router's links to its engines."""

    router: Router
    index_mode: IndexModeSwitch
    scraper: EngineScraper
    subscriber: EventSubscriber | None

    def state(self) -> dict[str, Any]:
        """For /debug/state."""
        tokenizer = self.index_mode.tokenizer
        return {
            "index_mode": self.index_mode.status,
            "tokenizer": None
            if tokenizer is None
            else {
                "segmented": tokenizer.segmented,
                "cached_tokens": tokenizer.cached_tokens,
                "pieces_tokenized": tokenizer.pieces_tokenized,
                "pieces_reused": tokenizer.pieces_reused,
            },
            "kv_events": None if self.subscriber is None else dict(self.subscriber.status),
            "engine_scrape_failures": self.scraper.failures,
            "adapters": self.router.adapters.state(),
        }

    def warnings(self) -> list[str]:
        """For /readyz: what costs precision, not readiness."""
        out = []
        if self.index_mode.status.startswith("approximate ("):
            out.append(self.index_mode.status)
        if self.router.precise and self.subscriber is not None:
            missing = sorted(b for b, s in self.subscriber.status.items() if not s.startswith("subscribed"))
            if missing:
                out.append(f"precise index without KV events from {', '.join(missing)}")
        return out


class EngineCollector(Collector):
    """Prometheus view of the engine feeds, read at scrape time."""

    def __init__(self, feeds: EngineFeeds) -> None:
        self._feeds = feeds

    def collect(self) -> Iterator[Metric]:
        feeds = self._feeds
        stats = feeds.router.stats
        mode = GaugeMetricFamily("kvroute_index_precise", "1 while routing on the precise (event-fed) index")
        mode.add_metric([], float(feeds.router.precise))
        yield mode
        resets = CounterMetricFamily(
            "kvroute_backend_resets", "times a backend's cached picture was dropped, by reason", labels=["reason"]
        )
        for reason, count in stats.resets.items():
            resets.add_metric([str(reason)], count)
        yield resets
        events = CounterMetricFamily("kvroute_engine_events", "KV cache events applied, by type", labels=["type"])
        for kind, count in stats.events.items():
            events.add_metric([kind], count)
        yield events
        problems = CounterMetricFamily(
            "kvroute_engine_event_problems",
            "KV event stream problems: bad_message, unknown_event, malformed_event, other_tier (an offloading "
            "tier's events, skipped), gap, lost, restart, replay_failed, subscription_failed, rejected (refused "
            "by the index)",
            labels=["kind"],
        )
        if feeds.subscriber is not None:
            for kind, count in feeds.subscriber.problems.items():
                problems.add_metric([kind], count)
        problems.add_metric(["rejected"], stats.bad_events)
        yield problems
        yield CounterMetricFamily(
            "kvroute_untokenized",
            "precise mode: requests placed without a prefix (not tokenizable)",
            value=stats.untokenized,
        )
        yield CounterMetricFamily(
            "kvroute_engine_scrape_failures", "failed /metrics scrapes of backends", value=feeds.scraper.failures
        )
        ages = GaugeMetricFamily(
            "kvroute_engine_sample_age_seconds",
            "seconds since a healthy backend's /metrics last gave a sample (none while scraping is off)",
            labels=["backend"],
        )
        for backend, age in feeds.scraper.ages().items():
            ages.add_metric([backend], age)
        yield ages
        tokenizer = feeds.index_mode.tokenizer
        yield GaugeMetricFamily(
            "kvroute_tokenizer_cached_tokens",
            "tokens of message pieces in the precise tokenizer's cache, each piece counted 50 more (its bound)",
            value=0 if tokenizer is None else tokenizer.cached_tokens,
        )
