"""`kvroute controller` with kopf's rescans on CRD events switched off.

Every CRD installed after start-up is then missed, as in the race of docs/kubernetes.md, which
otherwise happens in some runs only; the operator's own lookup (controller/late_crds.py) is what
must find it. Run as `python tests/k8s/operator_missing_crd_events.py controller ARGS`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import kopf._core.reactor.observation as observation

import controller.late_crds  # noqa: F401  (takes kopf's rescan before it is switched off)
from extproc.cli import main


async def _missed(**_: Any) -> None:
    """A CRD event, handled as if discovery did not serve the new resource yet."""


observation.process_discovered_resource_event = _missed
main(sys.argv[1:])
