"""The process wiring's shutdown: whatever failed before, every step of it runs."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import subprocess
import sys
import time

import pytest

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


@pytest.mark.slow
def test_a_stopping_ext_proc_lets_an_open_stream_go_on_for_its_grace(tmp_path):
    """SIGTERM while a gateway's stream is open (a full-duplex stream lasts as long as its
    response): the stream is still served seconds later, within `stop_grace_s`, and the process
    exits once it ends. With the former 2 s, every generation still streaming was cut."""
    import signal

    import grpc

    from bench.harness.processes import free_port, spawn, stop, wait_http
    from bench.harness.stack import kvroute_command
    from extproc.envoy.proto import ext_proc_pb2 as pb
    from extproc.envoy.proto import ext_proc_pb2_grpc as pb_grpc

    grpc_port, admin_port = free_port(), free_port()
    args = ["--grpc-port", str(grpc_port), "--admin-port", str(admin_port), "--backend", "127.0.0.1:9"]
    extproc = spawn(kvroute_command("extproc", *args, "--stop-grace-s", "8"), tmp_path / "extproc.log")
    headers = pb.HttpHeaders(headers=pb.HeaderMap(headers=[pb.HeaderValue(key=":path", raw_value=b"/v1/models")]))
    reply = pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(headers=pb.HeaderMap(headers=[pb.HeaderValue(key=":status", raw_value=b"200")]))
    )

    async def stream() -> tuple[bool, bool]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            call = pb_grpc.ExternalProcessorStub(channel).Process()
            await call.write(pb.ProcessingRequest(request_headers=headers))
            first = await call.read()
            extproc.send_signal(signal.SIGTERM)
            await asyncio.sleep(3.5)  # past the former 2 s
            await call.write(reply)
            later = await call.read()
            await call.done_writing()
            return first is not grpc.aio.EOF, later is not grpc.aio.EOF

    try:
        wait_http(f"http://127.0.0.1:{admin_port}/readyz", process=extproc)
        answered_first, answered_later = asyncio.run(stream())
        exited = extproc.wait(10)
    finally:
        stop(extproc)
    assert answered_first and answered_later and exited == 0
