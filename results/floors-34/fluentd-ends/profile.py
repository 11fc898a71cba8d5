"""Where the ext_proc's CPU goes over the ext_authz transport: 8 KB follow-ups at 16 concurrent
through kvroute's own layout over 4 fast simulated backends, py-spy attached for 25 s (py-spy from
a scratch virtualenv, an investigation tool, not a project dependency). Further arguments go to
py-spy: with --gil, only samples holding the GIL (the Python work, without syscalls or waits for a
core).

    python results/floors-34/fluentd-ends/profile.py PATH-TO-PY-SPY OUTPUT [--gil]
    # fluentd-ends/py-spy.raw (2026-12-04, the calls served by aiohttp);
    # lean-calls/py-spy-gil.raw with --gil (the calls read by extproc/envoy/calls.py)
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from bench.experiments.latency import FAST_SIM, followups, send_all
from bench.harness.stack import Stack

with (
    tempfile.TemporaryDirectory() as scratch,
    Stack(Path(scratch), sims=4, sim_args=FAST_SIM, transport="ext_authz") as stack,
):
    bodies = followups(8_000, 2000)
    asyncio.run(send_all(stack.url, bodies[:100], 16))  # warm-up
    pid = str(stack.processes["extproc"].pid)
    record = ["record", "--pid", pid, "--duration", "25", "--rate", "250", "--format", "raw", "--nonblocking"]
    spy = subprocess.Popen([sys.argv[1], *record, *sys.argv[3:], "--output", sys.argv[2]])
    time.sleep(1)
    end, sent = time.time() + 22, 0
    while time.time() < end:
        asyncio.run(send_all(stack.url, bodies, 16))
        sent += len(bodies)
    print("requests", sent)
    spy.wait()
