"""Holding new conversations while the live ones' contexts fill the caches (`conversation_hold_share`).

The rule is the core's (`Router.crowded_by`); this module only makes a request wait for it, on
the event loop, before its decision (and before flow control's turn, which is about room to run
it now, not about the caches). A held first turn is looked at again every `TICK_S` and goes on
once the rule no longer holds it, or after `conversation_hold_max_s`: it is never refused. A
client that leaves while held frees its place at once (the waiting coroutine is cancelled).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from extproc.core.backends import Backend
from extproc.core.request import PromptRequest
from extproc.core.router import Router

TICK_S = 0.1  # how often a held first turn looks again
MAX_HELD = 4096  # first turns held at most at once; beyond, a new one goes on at once (counted)


class ConversationHoldMetrics:
    def __init__(self, registry: CollectorRegistry, live_blocks: Callable[[], int]) -> None:
        """`live_blocks`: the live contexts' blocks now (`LiveContexts.blocks`)."""
        live = Gauge(
            "kvroute_live_context_blocks",
            "Blocks of the last prompts of the conversations served within conversationHoldWindowSeconds "
            "(counted only while conversationHoldShare is on)",
            registry=registry,
        )
        live.set_function(live_blocks)
        self.held = Gauge(
            "kvroute_conversation_holds", "First turns held while live contexts fill the caches", registry=registry
        )
        self.outcomes = Counter(
            "kvroute_conversation_hold_outcomes",
            "First turns held, by how they went on: room (the live contexts left room), timeout "
            "(conversationHoldMaxSeconds), cancelled (the client left), full (too many held: not held)",
            ["outcome"],
            registry=registry,
        )
        self.seconds = Histogram(
            "kvroute_conversation_hold_seconds",
            "Time a first turn was held",
            buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=registry,
        )


class ConversationHold:
    """Makes a first turn wait while `Router.crowded_by` holds it."""

    def __init__(self, metrics: ConversationHoldMetrics, clock: Callable[[], float] = time.monotonic) -> None:
        """`clock`: the router's (the times its live contexts were served at)."""
        self._metrics = metrics
        self._clock = clock
        self.held = 0

    async def wait(self, router: Router, request: PromptRequest, backends: Sequence[Backend]) -> None:
        """Return once the request may go on (at once when the rule does not hold it)."""
        if not router.crowded_by(request, backends, self._clock()):
            return
        if self.held >= MAX_HELD:
            self._metrics.outcomes.labels("full").inc()
            return
        clock = self._clock
        started = clock()
        deadline = started + router.settings.conversation_hold_max_s
        outcome = "cancelled"
        self.held += 1
        self._metrics.held.inc()
        try:
            while True:
                await asyncio.sleep(TICK_S)
                now = clock()
                if not router.crowded_by(request, backends, now):
                    outcome = "room"
                    return
                if now >= deadline:
                    outcome = "timeout"
                    return
        finally:
            self.held -= 1
            self._metrics.held.dec()
            self._metrics.outcomes.labels(outcome).inc()
            self._metrics.seconds.observe(clock() - started)
