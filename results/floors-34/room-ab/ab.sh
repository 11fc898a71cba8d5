#!/bin/bash
# room A/B on the default simulator (2026-12-05): old = a second checkout at 579ef70 (git worktree add /tmp/ab 579ef70), new = 867417e onwards in /work/main; alternated
T=/work/shared/traces/agents/agent-check.jsonl
ARGS="--limit 480 --concurrency 16 --order arrival --max-input-tokens 12000 --max-output-tokens 32 --backends 2 --capacity-ratio 0.5 --envoy-reset-streams --routers kvroute,kvroute-authz"
for round in 1 2 3; do
  for side in old new; do
    if [ $side = old ]; then D=/tmp/ab; else D=/work/main; fi
    cd $D && KVROUTE_FLOW_CONTROL=false timeout 1200 /work/main/.venv/bin/python -m bench.cli bench compare --trace $T $ARGS --out /tmp/w/roomab-$side-$round > /tmp/w/roomab-$side-$round.log 2>&1
    echo "$side $round done $(date)"
  done
done
