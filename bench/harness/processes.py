"""Child processes and ports for the developer tools and the tests: free loopback ports, a child
in its own process group and its stop, waiting for a server to answer, a process tree's CPU time
and a process's resident memory."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

_HANDED_OUT: set[int] = set()
LOWEST_PORT = 10_000


def _ephemeral_low() -> int:
    """The bottom of the kernel's ephemeral range, which outgoing connections draw from."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _share(low: int) -> tuple[int, int]:
    """This process's share of the ports below `low`: pytest-xdist runs several test processes at
    once (make test-fast), and two probing the same free port before either's child binds it
    would collide; each worker (and the children it starts, which inherit its environment) draws
    from a slice of its own."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    if not worker.startswith("gw") or not worker[2:].isdigit() or count <= 1:
        return LOWEST_PORT, low
    width = (low - LOWEST_PORT) // count
    start = LOWEST_PORT + int(worker[2:]) % count * width
    return start, start + width


def free_port() -> int:
    """A loopback port bindable now, below the ephemeral range (a port from that range may be
    taken as the source port of an outgoing connection before our server binds it: under a
    benchmark's thousands of connections, that happened) and never handed out twice here."""
    low = _ephemeral_low()
    if low - LOWEST_PORT < 1000:  # no room below it: let the kernel choose
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    start, end = _share(low)
    while True:
        port = random.randrange(start, end)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port


def _wait(
    answered: Callable[[], bool], until: str, missed: str, timeout_s: float, process: subprocess.Popen | None
) -> None:
    """Poll `answered` until it holds; fail early if the process serving it died. `until`: what it
    waits for ("URL answered"), `missed`: the timeout's words for it ("URL did not answer 200")."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{process.args[0]} exited with {process.returncode} before {until}")
        with contextlib.suppress(OSError):
            if answered():
                return
        time.sleep(0.1)
    raise TimeoutError(f"{missed} within {timeout_s}s")


def wait_http(
    url: str,
    timeout_s: float = 30.0,
    process: subprocess.Popen | None = None,
    accept: Callable[[bytes], bool] | None = None,
) -> None:
    """Poll until `url` answers 200 (with a body `accept` takes, if given); fail early if the
    process serving it died."""

    def answered() -> bool:
        with urllib.request.urlopen(url, timeout=1) as response:
            return response.status == 200 and (accept is None or accept(response.read()))

    missed = f"{url} did not answer 200{' as awaited' if accept else ''}"
    _wait(answered, f"{url} answered", missed, timeout_s, process)


def wait_tcp(host: str, port: int, process: subprocess.Popen | None = None, timeout_s: float = 30.0) -> None:
    """Until something accepts connections on host:port (a server that speaks no HTTP/1.1)."""

    def answered() -> bool:
        with socket.create_connection((host, port), timeout=1):
            return True

    _wait(answered, f"{host}:{port} listened", f"nothing listened on {host}:{port}", timeout_s, process)


def spawn(argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A child in its own process group (so stopping it stops its children), output to a log."""
    log = open(log_path, "ab")  # noqa: SIM115 (lives as long as the child)
    return subprocess.Popen(
        argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, env=env
    )


def stop(process: subprocess.Popen | None, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> None:
    """Signal a child's whole process group and wait until all of it is gone; SIGKILL what
    lingers. Also when the child itself has exited: a vLLM server that crashed leaves its engine
    process running (its threads spinning on a core, its ports held) unless its group is stopped."""
    if process is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    if not _group_gone(process.pid, timeout_s):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        _group_gone(process.pid, timeout_s)


def _group_gone(group: int, timeout_s: float) -> bool:
    """Whether no live process of the group is left (zombies count as gone: where PID 1 does not
    reap orphans they stay), waiting up to `timeout_s` for it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return True
        if not any(_in_group(int(entry.name), group) for entry in Path("/proc").iterdir() if entry.name.isdigit()):
            return True
        time.sleep(0.05)
    return False


def _in_group(pid: int, group: int) -> bool:
    """A live (not zombie) process of that process group."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z" and int(fields[2]) == group


def _stat(pid: int) -> list[str] | None:
    """A process's /proc stat fields after its name (state first), or None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _tree(pids: Iterable[int]) -> Iterator[tuple[int, list[str]]]:
    """These processes and their live descendants, each with its stat fields (as `_stat`)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    todo, seen = list(pids), set()
    while todo:
        pid = todo.pop()
        if pid in seen or (fields := _stat(pid)) is None:
            continue
        seen.add(pid)
        yield pid, fields
        todo += children.get(pid, [])


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU time used so far by these processes and their live descendants (every
    thread included): what a router took from the machine, helpers it started included."""
    ticks = sum(int(fields[11]) + int(fields[12]) for _, fields in _tree(pids))
    return ticks / os.sysconf("SC_CLK_TCK")


def preemptions(pids: Iterable[int]) -> int:
    """Involuntary context switches so far of every thread of these processes and their live
    descendants: how often something else took their core while they could have run on (what a
    router's wake-ups cost engines that spin on theirs)."""
    total = 0
    for pid, _ in _tree(pids):
        for task in Path(f"/proc/{pid}/task").glob("*/status"):
            with contextlib.suppress(OSError):
                for line in task.read_text().splitlines():
                    if line.startswith("nonvoluntary_ctxt_switches:"):
                        total += int(line.split()[1])
    return total


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")
