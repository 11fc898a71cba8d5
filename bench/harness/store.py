"""A real Redis server for replicas in tests and benchmarks: installed by bench/harness/redis/install
(cached outside the clone), on loopback, no persistence, a password."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

from bench.harness.processes import free_port

INSTALL = Path(__file__).parent / "redis" / "install"
PASSWORD = "replica-test-password"


def redis_binary() -> str:
    return subprocess.run([str(INSTALL)], check=True, capture_output=True, text=True).stdout.strip()


class RedisServer:
    """One redis-server process; `stop` and `start` again keep the port (the store going away and back)."""

    def __init__(self, workdir: Path) -> None:
        self.binary = redis_binary()
        self.port = free_port()
        self.workdir = workdir
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        argv = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        argv += ["--requirepass", PASSWORD, "--dir", str(self.workdir)]
        log = open(self.workdir / "redis.log", "ab")  # noqa: SIM115 - handed to the child process
        self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                if self.process.poll() is not None:
                    raise RuntimeError((self.workdir / "redis.log").read_text()) from None
                time.sleep(0.02)
        self.stop()  # the caller's teardown never runs for a server that did not start
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(5)
        self.process = None
