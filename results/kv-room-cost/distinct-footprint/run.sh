#!/bin/sh
# bench core interleaved: before (a0e4182: the footprint a sum of whole prompts) and after (320967f: distinct blocks, footprint.py), each from its own worktree, three times each
for i in 1 2 3; do
  for side in before after; do
    if [ $side = before ]; then dir=/work/main; else dir=/tmp/dev; fi
    (cd $dir && PYTHONHASHSEED=$i PYTHONPATH=$dir /work/main/.venv/bin/python -m bench.cli bench core) > /tmp/w/core/$side-$i.jsonl 2>&1
  done
done
