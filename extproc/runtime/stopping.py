"""Whether the running task was asked to stop, whatever a library did with the cancel. On Python
3.11, `asyncio.wait_for` can swallow a cancellation that comes as what it waits for completes, and
redis-py sends every command through it: a loop (or a setup step) that relies on CancelledError
alone may run on after its task was cancelled, and the shutdown that awaits it never ends."""

from __future__ import annotations

import asyncio


def stop_asked() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
