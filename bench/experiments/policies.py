"""`kvroute-dev bench policies`: two models' policies in one ext_proc against one ext_proc each.

The same trace in both setups: the agentic workload generated twice (a seed per model), each copy
asking for its own model, merged by time (bench/workloads/models.py). Four simulated backends,
two per model (each simulator process serves only its model), with a cache of `capacity_ratio`
times its model's working set:
- `one`: one Envoy and one ext_proc serving both policies (a YAML `policies` list);
- `two`: one Envoy and one ext_proc per model, each client sending a model's requests to its own.

Each run starts cold (new simulators, new ext_procs). Reported per setup: the engines' hit rate
(their per-request count of cached prompt tokens, both models together and each), and the ext_procs' CPU per
request (every ext_proc process's, from /proc, over the replay). The setups alternate, so a
difference the rounds do not repeat is noise.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

import orjson

from bench.harness.processes import cpu_seconds
from bench.harness.replay import Pacing, replay
from bench.harness.stack import Stack
from bench.workloads import models
from bench.workloads.prompts import PromptBuilder
from bench.workloads.trace import BLOCK_TOKENS, TraceRequest, working_set_blocks

MODELS = ("model-a", "model-b")
SIM_BLOCK_TOKENS = 16  # the simulator's default block size


def capacity_blocks(requests: list[TraceRequest], ratio: float, backends_per_model: int) -> int:
    """Each simulated backend's KV blocks: `ratio` of its model's working set, over its backends."""
    most = max(working_set_blocks([r for r in requests if r.adapter == m]) for m in MODELS)
    return max(64, int(most * BLOCK_TOKENS / SIM_BLOCK_TOKENS * ratio / backends_per_model))


def run_setup(
    setup: str, requests: list[TraceRequest], workdir: Path, sim_args: list[str], concurrency: int
) -> dict[str, Any]:
    """One cold run of `setup` (`one` or `two`); its hit rates and ext_proc CPU per request."""
    builder = PromptBuilder(MODELS[0], models.CHARS_PER_TOKEN, max_output_tokens=16)
    if setup == "one":
        stacks = {MODELS: Stack(workdir / "one", sims=4, sim_args=sim_args, policy_models=MODELS)}
    else:
        stacks = {(m,): Stack(workdir / m, sims=2, sim_args=sim_args, policy_models=(m,)) for m in MODELS}
    started: list[Stack] = []
    try:
        for stack in stacks.values():
            started.append(stack.start())
        pids = [stack.processes["extproc"].pid for stack in started]
        before = [cpu_seconds([pid]) for pid in pids]

        async def replays() -> list[dict[str, Any]]:
            share = concurrency // len(stacks)  # the same clients in all, split between the gateways
            return list(
                await asyncio.gather(
                    *(
                        replay(
                            stack.url,
                            [r for r in requests if r.adapter in served],
                            builder,
                            Pacing(concurrency=share),
                            stack.backends,
                            label=f"{setup}:{','.join(served)}",
                        )
                        for served, stack in stacks.items()
                    )
                )
            )

        summaries = asyncio.run(replays())
        cpu = [cpu_seconds([pid]) - used for pid, used in zip(pids, before, strict=True)]
    finally:
        for stack in started:
            stack.stop()
    return _figures(setup, requests, stacks, summaries, cpu)


def _figures(
    setup: str,
    requests: list[TraceRequest],
    stacks: dict[tuple[str, ...], Stack],
    summaries: list[dict[str, Any]],
    cpu: list[float],
) -> dict[str, Any]:
    by_model: dict[str, dict[str, float]] = {m: {"prompt": 0.0, "cached": 0.0} for m in MODELS}
    adapter = {r.index: r.adapter for r in requests}
    for summary in summaries:
        for record in summary["records"]:
            if record["status"] == 200:
                model = adapter[record["index"]] or MODELS[0]
                by_model[model]["prompt"] += record["prompt_tokens"]
                by_model[model]["cached"] += record["cached_tokens"]
    ok = sum(s["ok"] for s in summaries)
    prompt = sum(m["prompt"] for m in by_model.values())
    cached = sum(m["cached"] for m in by_model.values())
    return {
        "setup": setup,
        "extprocs": len(stacks),
        "requests": len(requests),
        "ok": ok,
        "hit_rate": round(cached / prompt, 4) if prompt else None,
        **{f"hit_rate_{m}": round(v["cached"] / v["prompt"], 4) if v["prompt"] else None for m, v in by_model.items()},
        "wall_s": max(s["wall_s"] for s in summaries),
        "extproc_cpu_s": [round(used, 3) for used in cpu],  # each ext_proc's
        "extproc_cpu_us_per_request": round(sum(cpu) / ok * 1e6, 1) if ok else None,
    }


def main(rounds: int, sessions: int, capacity_ratio: float, concurrency: int) -> None:
    """Alternate the setups for `rounds` rounds; one JSON line per run."""
    with tempfile.TemporaryDirectory(prefix="kvroute-policies-") as directory:
        workdir = Path(directory)
        requests = models.generate(MODELS, sessions)
        sim_args = ["--capacity-blocks", str(capacity_blocks(requests, capacity_ratio, 2))]
        for round_number in range(rounds):
            for setup in ("one", "two") if round_number % 2 == 0 else ("two", "one"):
                row = run_setup(setup, requests, workdir / f"{setup}-{round_number}", sim_args, concurrency)
                row.update(round=round_number, capacity_ratio=capacity_ratio, sessions_per_model=sessions)
                print(orjson.dumps(row).decode(), flush=True)
