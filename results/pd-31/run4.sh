#!/bin/sh
# Issue 31, fourth run: a flexible fleet (both servers kv_both, split only where it pays) against
# the same two servers aggregated, at the two loads of runs 1-3.
set -e
cd "$(dirname "$0")/../.."
for c in 2 6; do
  .venv/bin/kvroute-dev bench compare --trace results/pd-31/mixed-check.jsonl --concurrency $c \
    --max-input-tokens 4000 --max-output-tokens 128 --backends vllm-cpu:2 --envoy-reset-streams \
    --routers kvroute,kvroute-pd-flex --out results/pd-31/flex-conc$c
done
