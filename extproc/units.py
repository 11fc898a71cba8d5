"""One policy an ext_proc serves, with everything that is its own: the router and its backends,
the policy's watch, the engines' feeds, flow control's waiting room, the replica link, the
adapter placer, its metrics and the processor that decides its requests.

An ext_proc serves one of these, or several side by side (each request goes to the one whose
backends list its model: envoy/dispatch.py); nothing here is shared between them but the
process's tracer and prefill-leg client.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from extproc.core.router import Router
from extproc.core.saturation import has_room
from extproc.core.settings import Settings
from extproc.envoy.processor import Processor
from extproc.runtime.config import ExtProcConfig, UnitConfig
from extproc.runtime.metrics import Metrics
from extproc.runtime.placer import PLACEMENT_INTERVAL_S, AdapterPlacer, PlacementCollector
from extproc.runtime.policy_state import PolicyState
from extproc.runtime.pool import BackendPool
from extproc.runtime.prefill import PrefillLegs
from extproc.runtime.waiting_room import WaitingRoom, WaitingRoomMetrics
from extproc.vllm.feeds import EngineCollector, EngineFeeds
from extproc.vllm.index_mode import IndexModeSwitch
from extproc.vllm.scraper import EngineScraper
from extproc.vllm.subscriber import EventSubscriber

if TYPE_CHECKING:
    from extproc.kube.follower import PolicyFollower
    from extproc.kube.objectives import ObjectiveWatcher
    from extproc.replicas.redis_link import RedisLink
    from extproc.runtime.tracing import RequestTracer


def priorities(settings: Settings, objectives: ObjectiveWatcher | None) -> dict[str, int]:
    """Each objective's priority: the policy's objectivePriorities, overridden by InferenceObjectives."""
    merged = dict(settings.objective_priorities)
    if objectives is not None:
        merged.update(objectives.priorities())
    return merged


@dataclass(slots=True)
class PolicyUnit:
    """A policy's routing state and the tasks that keep it current."""

    name: str
    router: Router
    pool: BackendPool
    metrics: Metrics
    processor: Processor
    room: WaitingRoom
    placer: AdapterPlacer
    scraper: EngineScraper
    feeds: EngineFeeds
    subscriber: EventSubscriber | None
    follower: PolicyFollower | None
    objectives: ObjectiveWatcher | None
    link: RedisLink | None

    @property
    def policy(self) -> PolicyState | None:
        """The followed KVRoutingPolicy's watch, if it follows one."""
        return self.follower.state if self.follower is not None else None

    def tasks(self, config: ExtProcConfig) -> list[Coroutine[Any, Any, None]]:
        """What runs in the background for this policy, with the process's intervals."""
        tasks = [
            self.pool.probe_forever(config.health_interval_s, config.health_timeout_s, config.health_probes_per_s),
            self.room.run(),
            self.placer.run(PLACEMENT_INTERVAL_S),
        ]
        if config.engine_scrape_interval_s > 0:
            tasks.append(self.scraper.run(config.engine_scrape_interval_s, config.engine_scrapes_per_s))
        for runner in (self.subscriber, self.follower, self.objectives, self.link):
            if runner is not None:
                tasks.append(runner.run())
        return tasks

    def details(self) -> dict[str, Any]:
        """This policy's part of /debug/state beyond the router's own."""
        return {
            **self.feeds.state(),
            "queue": self.room.state(),
            **({} if self.link is None else {"replicas": self.link.state()}),
        }

    def warnings(self) -> list[str]:
        """This policy's part of /readyz's warnings."""
        return [
            *self.feeds.warnings(),
            *(() if self.link is None else self.link.warnings()),
            *(() if self.objectives is None else self.objectives.warnings()),
        ]


async def build_unit(
    config: ExtProcConfig, unit: UnitConfig, several: bool, legs: PrefillLegs, tracer: RequestTracer | None
) -> PolicyUnit:
    """A policy's unit, ready to route with its first backends; its tasks are not yet running.
    `several`: the process serves other policies too (each its own replica group)."""
    router = Router(unit.routing)
    pool = BackendPool(unit.backends, router.remove_backend, config.unhealthy_after)
    index_mode = IndexModeSwitch(router)
    index_mode.apply(unit.routing)
    follower = None
    objectives = None
    if unit.follow:  # the Kubernetes client is loaded only by processes that follow a policy
        from extproc.kube.follower import PolicyFollower, load_kubernetes_config
        from extproc.kube.objectives import ObjectiveWatcher

        namespace, name = unit.follow.split("/")
        await load_kubernetes_config()
        follower = PolicyFollower(namespace, name, unit.routing, router, pool, index_mode.follow)
        objectives = ObjectiveWatcher(namespace, lambda: follower.pool if follower is not None else None)
    scraper = EngineScraper(router, pool)
    subscriber = EventSubscriber(router, pool, read_gap_s=config.kv_events_read_gap_s) if config.kv_events else None
    feeds = EngineFeeds(router, index_mode, scraper, subscriber)
    metrics = Metrics(router, pool, follower.state if follower is not None else None)
    metrics.registry.register(EngineCollector(feeds))
    clock = time.monotonic
    room = WaitingRoom(
        lambda: router.settings,
        lambda backends: has_room(  # (as the pool sees them now: a request held since may name one gone)
            router.loads,
            [b.address for b in backends if pool.routable(b.address)],
            router.settings,
            clock(),
            router.block_tokens(),
        ),
        WaitingRoomMetrics(metrics.registry),
        clock,
        lambda: pool.backends,
    )
    link = None
    if config.replica_store:  # siblings share learning, sessions and load through the store
        from extproc.replicas.redis_link import ReplicaCollector, connect

        group = replica_group(config, unit, several)
        link = connect(router, pool, config.replica_store, config.replica_store_password_file, group, room)
        router.join(link, secrets.randbelow(1 << 30))
        metrics.registry.register(ReplicaCollector(link))
    # LoRA adapters the policy places (none: idle); with siblings, one replica moves an adapter
    placer = AdapterPlacer(
        router,
        pool,
        claim=link.claim if link is not None else None,
        tell_leaving=link.adapter_leaving if link is not None else None,
    )
    metrics.registry.register(PlacementCollector(placer.placement))
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
    return PolicyUnit(
        unit.name,
        router,
        pool,
        metrics,
        processor,
        room,
        placer,
        scraper,
        feeds,
        subscriber,
        follower,
        objectives,
        link,
    )


def replica_group(config: ExtProcConfig, unit: UnitConfig, several: bool) -> str:
    """The store's key prefix of the replicas sharing this policy's picture: the configured group
    (or kvroute:<policy>) and, where the process serves several policies, the policy's name."""
    if not several:
        return config.replica_group or f"kvroute:{unit.follow or 'default'}"
    return f"{config.replica_group or 'kvroute'}:{unit.name}"
