"""The routers kvroute is compared with, each started over the same backends.

vllm-router and sglang-router are installed from PyPI into a virtualenv of their own
(bench/harness/venvs.py, outside the clone), pinned, by the benchmark itself. Both default their
metrics port to 29000, so each gets its own; both pick the least-loaded worker on a cache miss.
vllm-router's cache_aware renders every request on every worker (`/v1/chat/completions/render`,
which vLLM serves only with --enable-scale-out: VllmFleet starts every server with it; until
2026-12-07 it did not, every render was refused with a 403 and vllm-router routed on its fallback),
which shows in its TTFT.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from bench.harness.fleets import first_prefills
from bench.harness.processes import cpu_seconds, free_port, spawn, stop, wait_http
from bench.harness.replay import UPSTREAM_HEADER
from bench.harness.stack import Stack
from bench.harness.store import PASSWORD, RedisServer
from bench.harness.venvs import peers_venv

ROUTERS = (
    "kvroute",
    "kvroute-authz",
    "kvroute-precise",
    "kvroute-unshared",
    "envoy-round-robin",
    "vllm-router-cache_aware",
    "vllm-router-round_robin",
    "sglang-router-cache_aware",
)
# kvroute as ROUTERS run it, with one change, for benchmarks that need the difference
VARIANTS = {
    "kvroute-no-flow-control": ("--flow-control", "false"),
    # as kvroute routed before it weighed LoRA adapters: their slots cost nothing
    "kvroute-no-adapter-affinity": ("--adapter-load-cost", "0", "--adapter-evict-cost", "0"),
}
# kvroute whose Envoy asks each route over ext_authz instead of ext_proc (extproc/envoy/authz.py)
AUTHZ = "kvroute-authz"
# kvroute over a disaggregated fleet: the first backend prefills for the others, which decode (on
# servers that speak vLLM's kv_transfer_params: `bench compare` starts them so when it runs)
DISAGGREGATED = "kvroute-pd"
# kvroute over a flexible fleet: every server both roles (kv_both), split only where it pays
FLEXIBLE = "kvroute-pd-flex"
# kvroute placing the fleet's LoRA adapters itself (--adapter-sources, the fleet's own paths): its
# run starts with no server listing any adapter, the others' with every server listing every one
PLACEMENT = "kvroute-placement"
# What each of them needs: the roles of the fleet's servers, by how many there are
FLEET_ROLES: dict[str, Callable[[int], tuple[str, ...]]] = {
    DISAGGREGATED: first_prefills,
    FLEXIBLE: lambda count: ("both",) * count,
}


def fleet_roles(routers: Sequence[str], count: int) -> tuple[str, ...]:
    """The roles `count` servers run with for `routers` (none: aggregated, no connector); every
    router of one run shares the fleet, so at most one layout may be asked for."""
    layouts = {base for base in (router_spec(r)[0] for r in routers) if base in FLEET_ROLES}
    if len(layouts) > 1:
        raise ValueError(f"{' and '.join(sorted(layouts))} need fleets of their own: compare them in separate runs")
    return FLEET_ROLES[layouts.pop()](count) if layouts else ()


def router_spec(name: str) -> tuple[str, tuple[str, ...]]:
    """'kvroute:--max-backend-requests=4,--saturation-waiting=2' -> the router and its own extra
    ext_proc flags, so one run compares kvroute under several settings side by side."""
    base, _, flags = name.partition(":")
    return base, tuple(flag for flag in flags.split(",") if flag)


def parse_routers(text: str) -> tuple[str, ...]:
    """A comma-separated list of routers, each maybe with its flags (`router_spec`): a comma
    followed by `--` continues the router before it."""
    return tuple(r.strip() for r in re.split(r",(?!--)", text) if r.strip())


def workdir_name(name: str) -> str:
    """A router spec as a folder name."""
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", name)


@dataclass
class RunningRouter:
    """A router in front of the backends, stoppable."""

    name: str
    url: str
    stack: Stack | None = None
    processes: list[subprocess.Popen] = field(default_factory=list)
    store: RedisServer | None = None

    def pids(self) -> list[int]:
        """Every process this router runs (Envoy and ext_proc included; the backends are not its)."""
        processes = [*self.processes, *(self.stack.processes.values() if self.stack else ())]
        if self.store is not None and self.store.process is not None:
            processes.append(self.store.process)
        return [p.pid for p in processes]

    def cpu_by_process(self) -> dict[str, float]:
        """CPU seconds each process of kvroute's stack has used so far (none for a peer)."""
        if self.stack is None:
            return {}
        return {name: cpu_seconds([process.pid]) for name, process in self.stack.processes.items()}

    def exited(self) -> list[str]:
        """The router's processes that have exited (a crash while it ran makes its results void)."""
        named = [*((p.args[0], p) for p in self.processes), *(self.stack.processes.items() if self.stack else ())]
        return [f"{name} (exit {p.returncode})" for name, p in named if p.poll() is not None]

    def stop(self) -> None:
        if self.stack is not None:
            self.stack.stop()
        for process in self.processes:
            stop(process)
        if self.store is not None:
            self.store.stop()


def _kvroute(
    name: str, backends: Sequence[str], workdir: Path, args: Sequence[str], replicas: int, graceful_close: bool
) -> RunningRouter:
    """kvroute's stack with `replicas` ext_proc processes behind Envoy, sharing through a Redis of
    their own unless the router is `kvroute-unshared` (each replica routes alone); `kvroute-pd`'s
    first backend prefills for the others."""
    store = RedisServer(workdir).start() if replicas > 1 and name != "kvroute-unshared" else None
    try:
        stack = Stack(
            workdir,
            backends=list(backends),
            extproc_args=args,
            extproc_replicas=replicas,
            replica_store=store.url if store else "",
            replica_store_password=PASSWORD if store else "",
            graceful_close=graceful_close,
            disaggregated=name == DISAGGREGATED,
            transport="ext_authz" if name == AUTHZ else "ext_proc",
        ).start()
    except BaseException:
        if store is not None:
            store.stop()
        raise
    return RunningRouter(name, stack.url, stack=stack, store=store)


def start(
    name: str,
    backends: Sequence[str],
    workdir: Path,
    tokenizer_dir: Path | None = None,
    replicas: int = 1,
    graceful_close: bool = True,
    extproc_args: Sequence[str] = (),
    adapter_paths: Mapping[str, str] | None = None,
) -> RunningRouter:
    """Start router `name` (one of ROUTERS or VARIANTS) over `backends` (ip:port) and wait until it
    serves. kvroute-precise needs the served model's tokenizer directory (real vLLM backends),
    kvroute-placement the paths the servers load the adapters from; kvroute's routers run
    `replicas` ext_proc processes with `extproc_args`, the peers `replicas` independent processes
    behind an Envoy round robin."""
    workdir.mkdir(parents=True, exist_ok=True)
    if name == "kvroute-precise":
        if tokenizer_dir is None:
            raise ValueError("kvroute-precise needs real vLLM backends (their tokenizer and KV events)")
        args = ("--index-mode", "precise", "--tokenizer-path", str(tokenizer_dir), *extproc_args)
        router = _kvroute(name, backends, workdir, args, replicas, graceful_close)
        assert router.stack is not None
        if router.stack.debug_state()["index_mode"] != "precise":
            router.stop()
            raise RuntimeError(f"kvroute did not start precise: {router.stack.debug_state()['index_mode']}")
        return router
    if name == PLACEMENT:
        if not adapter_paths:
            raise ValueError(f"{PLACEMENT} needs the adapters' paths (a fleet that serves adapters)")
        sources = ",".join(f"{adapter}={path}" for adapter, path in adapter_paths.items())
        args = ("--adapter-sources", sources, *extproc_args)
        return _kvroute(name, backends, workdir, args, replicas, graceful_close)
    if name in ("kvroute", "kvroute-unshared", AUTHZ, DISAGGREGATED, FLEXIBLE, *VARIANTS):
        flexible = ("--pd-flexible", "true") if name == FLEXIBLE else ()
        args = (*VARIANTS.get(name, ()), *flexible, *extproc_args)
        return _kvroute(name, backends, workdir, args, replicas, graceful_close)
    if name == "envoy-round-robin":
        stack = Stack(workdir, backends=list(backends), ext_proc=False, envoy_edit=_name_upstream).start()
        return RunningRouter(name, stack.url, stack=stack)
    router = RunningRouter(name, "")
    try:
        ports = [_peer(name, backends, workdir / f"{name}-{i}.log", router) for i in range(replicas)]
        if replicas == 1:
            router.url = f"http://127.0.0.1:{ports[0]}"
        else:  # independent replicas behind a round robin, as they would run for availability
            router.stack = Stack(workdir, backends=[f"127.0.0.1:{p}" for p in ports], ext_proc=False).start()
            router.url = router.stack.url
    except BaseException:
        router.stop()
        raise
    return router


def _name_upstream(config: dict[str, Any]) -> None:
    """Envoy names the backend that served each response, so the records of a round robin on real
    vLLM (which names nothing) show where each request went, as kvroute's and the simulator's do."""
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    for host in manager["route_config"]["virtual_hosts"]:
        for route in host["routes"]:
            header = {"key": UPSTREAM_HEADER, "value": "%UPSTREAM_REMOTE_ADDRESS%"}
            route.setdefault("response_headers_to_add", []).append({"header": header})


def _peer(name: str, backends: Sequence[str], log: Path, router: RunningRouter) -> int:
    """Start one vllm-router or sglang-router process (kept in `router`); return its port once it serves."""
    tool, policy = name.rsplit("-", 1)
    port, metrics_port = free_port(), free_port()
    binary = peers_venv() / "bin" / tool
    argv = [str(binary), *(["launch"] if tool == "sglang-router" else [])]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--policy", policy]
    argv += ["--worker-urls", *(f"http://{b}" for b in backends)]
    argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
    process = spawn(argv, log)
    router.processes.append(process)
    wait_http(f"http://127.0.0.1:{port}/v1/models", timeout_s=60, process=process)
    if tool == "sglang-router":
        # It registers its workers in the background and serves once the first is up: a run
        # started then sends its first sessions to that worker alone, and its cache-aware tree
        # keeps them there (seen: every request on one of two vLLM servers). Wait for them all.
        wait_http(f"http://127.0.0.1:{port}/workers", 60, process, accept=_registers(backends))
    return port


def _registers(backends: Sequence[str]) -> Callable[[bytes], bool]:
    """Whether an sglang-router `/workers` answer lists every backend as healthy."""
    wanted = {f"http://{b}" for b in backends}

    def accept(body: bytes) -> bool:
        try:
            workers = orjson.loads(body)["workers"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return False
        return {w.get("url") for w in workers if w.get("is_healthy")} >= wanted

    return accept
