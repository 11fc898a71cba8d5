"""The operator's own counts for Prometheus, on its health port's `/metrics`: what it would
otherwise only log (failed status patches, failed reads of the ext_procs, failed audits, objects
deleted while its watch was cut off, pods claiming policies from untrusted namespaces). Read at
scrape time from the objects that keep them, so counting costs nothing between scrapes.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from controller.audit import Auditor
from controller.reconciler import Reconciler
from controller.reuse_reader import ReuseReader


class OperatorCollector(Collector):
    """The counts of one operator replica (a standby's stay at 0: only the leader reads and audits)."""

    def __init__(self, reconciler: Reconciler, reader: ReuseReader | None, auditor: Auditor | None) -> None:
        self._reconciler = reconciler
        self._reader = reader
        self._auditor = auditor

    def collect(self) -> Iterator[Metric]:
        reconciler, reader, auditor = self._reconciler, self._reader, self._auditor
        yield CounterMetricFamily(
            "kvroute_operator_status_patches", "policy statuses written", value=reconciler.patches
        )
        errors = CounterMetricFamily(
            "kvroute_operator_errors",
            "failures the operator logged and went on from, by what failed",
            labels=["kind"],
        )
        errors.add_metric(["status"], reconciler.errors)
        errors.add_metric(["reuse_read"], reader.errors if reader is not None else 0)
        errors.add_metric(["audit"], auditor.errors if auditor is not None else 0)
        yield errors
        yield GaugeMetricFamily(
            "kvroute_operator_deleted_while_unwatched",
            "objects the audit found deleted while the watch was cut off, left out of every status",
            value=len(reconciler.gone),
        )
        yield GaugeMetricFamily(
            "kvroute_operator_untrusted_extproc_claims",
            "pods claiming a policy from a namespace whose ext_procs are not read (listed in /readyz)",
            value=len(reader.refused) if reader is not None else 0,
        )


def registry(reconciler: Reconciler, reader: ReuseReader | None, auditor: Auditor | None) -> CollectorRegistry:
    """A registry holding only the operator's collector (no process or platform collectors: the
    kubelet reports the pod's CPU and memory)."""
    out = CollectorRegistry(auto_describe=True)
    out.register(OperatorCollector(reconciler, reader, auditor))
    return out
