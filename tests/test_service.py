"""The process wiring's shutdown: whatever failed before, every step of it runs."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import subprocess
import sys
import time

from extproc.service import background, stop_tasks


def test_a_background_task_that_fails_is_logged_at_once_and_does_not_cut_the_shutdown_short(caplog):
    async def main() -> list[asyncio.Task[None]]:
        async def fails() -> None:
            raise RuntimeError("scrape loop broke")

        async def forever() -> None:
            await asyncio.Event().wait()

        tasks = [background(fails()), background(forever())]
        await asyncio.sleep(0.01)  # the first has failed by now
        assert "scrape loop broke" in caplog.text  # said when it happened
        await stop_tasks(tasks)  # returns: the next shutdown steps (server.stop, the HTTP runners) run
        return tasks

    with caplog.at_level(logging.ERROR, logger="kvroute"):
        tasks = asyncio.run(main())
    assert all(task.done() for task in tasks) and tasks[1].cancelled()


def test_a_task_that_swallows_its_cancel_is_left_behind_not_waited_for(caplog):
    """As a loop did when a library swallowed the cancel (extproc/runtime/stopping.py)."""

    async def main() -> float:
        heard = asyncio.Event()

        async def deaf() -> None:
            while not heard.is_set():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.sleep(3600)

        task = background(deaf())
        await asyncio.sleep(0.01)
        started = time.monotonic()
        await stop_tasks([task], within_s=0.2)
        waited = time.monotonic() - started
        heard.set()  # (so that the test's own loop can end)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return waited

    with caplog.at_level(logging.ERROR, logger="kvroute"):
        waited = asyncio.run(main())
    assert waited < 5 and "did not stop" in caplog.text


def test_the_open_files_soft_limit_is_raised_to_the_hard_one():
    """A kept-alive connection per backend for the scrape and one for the probes: at 1,000
    backends a soft limit of 1,024 would fail probes, and a failed probe reads as a dead backend."""
    code = (
        "import resource; from extproc.service import raise_open_files_limit; "
        "print(raise_open_files_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[1])"
    )

    def low_soft_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, preexec_fn=low_soft_limit
    ).stdout.split()
    soft, hard = int(out[0]), int(out[1])
    assert soft > 256 and (soft == hard or hard == resource.RLIM_INFINITY)
