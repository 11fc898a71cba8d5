"""Resources whose CRD came after the operator started, and that kopf missed.

kopf looks up the resources it watches in the API server's discovery at start-up and again on
every event of a CRD. When every event of a newly installed CRD (added, names accepted,
established) arrives before discovery serves its resource, kopf never watches it: policies naming
an InferencePool then stayed at `PoolNotFound` until the operator restarted (two of six test runs
once). While a resource the operator indexes is not yet followed, this looks it up in discovery
again every ten seconds, with the same rescan kopf runs on a CRD event. Once kopf follows it,
nothing is asked of the API server. It uses kopf's own rescan (`process_discovered_resource_event`,
kopf 1.45.2, pinned): a second discovery client would have to replace kopf's watching, and with it
kopf's peering, which keeps all but one operator replica paused.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging

import kopf
from kopf._cogs.structs.references import Insights
from kopf._core.reactor.observation import process_discovered_resource_event

__all__ = ["Insights", "follow_late_crd", "followed"]

log = logging.getLogger(__name__)

INTERVAL_S = 10.0
KOPF_TESTED = "1.45.2"  # the kopf whose internals this calls; with another, no rescans (as without it)


def supported() -> bool:
    """The installed kopf is the one whose internal rescan this was written and tested against."""
    return importlib.metadata.version("kopf") == KOPF_TESTED


def followed(insights: Insights, group: str, plural: str) -> bool:
    """kopf indexes this resource now."""
    return any(r.group == group and r.plural == plural for r in insights.indexed_resources)


async def follow_late_crd(
    insights: Insights,
    settings: kopf.OperatorSettings,
    registry: kopf.OperatorRegistry,
    group: str,
    plural: str,
    interval_s: float = INTERVAL_S,
) -> None:
    """Forever: every `interval_s` while kopf does not follow `plural` of `group`, rescan that
    group's discovery as a CRD event would (a no-op while the CRD is not installed). With another
    kopf than KOPF_TESTED it says so and returns: a late CRD then needs an operator restart."""
    if not supported():
        log.warning(
            "kopf %s is not %s: not rescanning for late CRDs (restart the operator after installing one)",
            importlib.metadata.version("kopf"),
            KOPF_TESTED,
        )
        return
    while True:
        await asyncio.sleep(interval_s)
        if followed(insights, group, plural):
            continue
        try:
            await process_discovered_resource_event(
                raw_event={"type": "MODIFIED", "object": {"spec": {"group": group}}},
                settings=settings,
                registry=registry,
                insights=insights,
            )
        except Exception as error:  # the API server away: the next round tries again
            log.debug("rescan of %s failed: %s", group, error)
            continue
        if followed(insights, group, plural):
            log.info("following %s.%s, whose CRD came after the operator started", plural, group)
