#!/bin/sh
# Issue 31, second run: the load-aware decider (a leg only when the prefill backend's queue is no
# deeper than the decode backend's), kvroute aggregated beside it in the same run.
set -e
cd "$(dirname "$0")/../.."
for c in 2 6; do
  .venv/bin/kvroute-dev bench compare --trace results/pd-31/mixed-check.jsonl --concurrency $c \
    --max-input-tokens 4000 --max-output-tokens 128 --backends vllm-cpu:2 --envoy-reset-streams \
    --routers kvroute,kvroute-pd --out results/pd-31/decider-conc$c
done
