#!/bin/bash
# bench core, interleaved: 14b65d6 (before issue 29) and HEAD, five runs each, one sitting.
# The same PYTHONHASHSEED for both sides of a pair: string hashing otherwise moves a run by ~5 %.
# git worktree add /tmp/before 14b65d6 first. Summary: python results/bench-core-29/2026-12-02/summary.py
set -e
here=$(cd "$(dirname "$0")" && pwd)
for i in 1 2 3 4 5; do
  (cd /tmp/before && PYTHONHASHSEED=$i PYTHONPATH=/tmp/before /work/main/.venv/bin/python -m bench.cli bench core > "$here/before.$i.jsonl")
  (cd /work/main && PYTHONHASHSEED=$i .venv/bin/kvroute-dev bench core > "$here/after.$i.jsonl")
done
# Instructions per lifecycle (callgrind: the same count every run, whatever the other core does):
#   export PYTHONHASHSEED=0
#   for n in 0 1000; do valgrind --tool=callgrind --callgrind-out-file=/dev/null \
#     /work/main/.venv/bin/python results/bench-core-29/2026-12-02/lifecycles.py $n 2>&1 | grep Collected; done
#   (PYTHONPATH=/tmp/before from /tmp/before for 14b65d6)
# 14b65d6: 567,640,824 -> 1,213,766,224 (646.1 k per lifecycle)
# 85c259f (before this sitting's CBR changes): 690,132,184 -> 1,377,167,292 (687.0 k)
# this sitting's HEAD: 691,019,043 -> 1,335,256,594 (644.2 k)
