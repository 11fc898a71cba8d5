"""The harness's process handling (bench/harness/processes.py): stopping a child stops its whole
group, also once the child itself has exited."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from bench.harness.processes import _in_group, spawn, stop


def _live(group: int) -> list[int]:
    return [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit() and _in_group(int(e.name), group)]


def test_a_child_that_exited_has_the_rest_of_its_group_stopped(tmp_path: Path):
    """A vLLM server that crashed left its engine process running (its threads on a core, its
    ports held) past the fleet's stop."""
    process = spawn(["sh", "-c", "sleep 60 & exit"], tmp_path / "log")
    for _ in range(100):
        if process.poll() is not None and _live(process.pid):
            break
        time.sleep(0.02)
    assert process.poll() is not None and _live(process.pid)  # the leader gone, its child not
    try:
        stop(process)
        assert _live(process.pid) == []
    finally:
        for pid in _live(process.pid):  # (if it failed: nothing left behind)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
