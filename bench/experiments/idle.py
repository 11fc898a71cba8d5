"""`kvroute-dev bench idle`: the ext_proc's own CPU with no requests at all, as the fleet grows.

Every backend costs the ext_proc work whether or not requests come: its /metrics scraped, its
/health probed, its KV event sources asked for. One simulator process serves all the backends
(one event loop, one port each); an ext_proc with its default settings follows them; after a
warm-up, its CPU (every thread, from /proc) is read over a window. `--unbounded` lifts the feeds'
rates (`engine_scrapes_per_s`, `health_probes_per_s`) to what they were before they existed.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness.processes import cpu_seconds, free_port, spawn, stop, wait_http
from bench.harness.stack import dev_command, kvroute_command

_ADDRESS = re.compile(rb"on http://(127\.0\.0\.1:\d+)")


def _addresses(log: Path, count: int, process: Any, timeout_s: float = 120.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = _ADDRESS.findall(log.read_bytes()) if log.exists() else []
        if len(found) >= count:
            return [a.decode() for a in found[:count]]
        if process.poll() is not None:
            raise RuntimeError(f"the simulator exited: {log.read_text()[-2000:]}")
        time.sleep(0.2)
    raise TimeoutError(f"the simulator did not serve {count} backends in {timeout_s} s")


def run(backends: int, seconds: float = 20.0, warmup_s: float = 10.0, unbounded: bool = False) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as directory:
        workdir = Path(directory)
        ports = [arg for _ in range(backends) for arg in ("--port", "0")]
        sim = spawn(dev_command("sim", *ports), workdir / "sim.log")
        extproc = None
        try:
            addresses = _addresses(workdir / "sim.log", backends, sim)
            admin = free_port()
            args = ["--grpc-port", str(free_port()), "--admin-port", str(admin)]
            for address in addresses:
                args += ["--backend", address]
            env = None
            if unbounded:
                env = {**os.environ, "KVROUTE_ENGINE_SCRAPES_PER_S": "1e9", "KVROUTE_HEALTH_PROBES_PER_S": "1e9"}
            extproc = spawn(kvroute_command("extproc", *args), workdir / "extproc.log", env)
            wait_http(f"http://127.0.0.1:{admin}/readyz", timeout_s=120.0, process=extproc)
            time.sleep(warmup_s)
            before, sim_before, started = cpu_seconds([extproc.pid]), cpu_seconds([sim.pid]), time.monotonic()
            time.sleep(seconds)
            elapsed = time.monotonic() - started
            used, sim_used = cpu_seconds([extproc.pid]) - before, cpu_seconds([sim.pid]) - sim_before
            return {
                "backends": backends,
                "unbounded": unbounded,
                "seconds": round(elapsed, 1),
                "extproc_cores": round(used / elapsed, 3),
                "simulator_cores": round(sim_used / elapsed, 3),
            }
        finally:
            stop(extproc)
            stop(sim)
