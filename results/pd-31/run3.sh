#!/bin/sh
# Issue 31, third run: run2.sh again (the first two runs differed 2x in wall time for the same router).
set -e
cd "$(dirname "$0")/../.."
for c in 2 6; do
  .venv/bin/kvroute-dev bench compare --trace results/pd-31/mixed-check.jsonl --concurrency $c \
    --max-input-tokens 4000 --max-output-tokens 128 --backends vllm-cpu:2 --envoy-reset-streams \
    --routers kvroute,kvroute-pd --out results/pd-31/decider-conc$c-r2
done
