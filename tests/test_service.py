"""The process wiring's shutdown: whatever failed before, every step of it runs."""

from __future__ import annotations

import asyncio
import logging

from extproc.service import stop_tasks


def test_a_background_task_that_already_failed_does_not_cut_the_shutdown_short(caplog):
    async def main() -> list[asyncio.Task[None]]:
        async def fails() -> None:
            raise RuntimeError("scrape loop broke")

        async def forever() -> None:
            await asyncio.Event().wait()

        tasks = [asyncio.create_task(fails()), asyncio.create_task(forever())]
        await asyncio.sleep(0.01)  # the first has failed by now
        await stop_tasks(tasks)  # returns: the next shutdown steps (server.stop, the HTTP runners) run
        return tasks

    with caplog.at_level(logging.ERROR, logger="kvroute"):
        tasks = asyncio.run(main())
    assert all(task.done() for task in tasks) and tasks[1].cancelled()
    assert "scrape loop broke" in caplog.text
