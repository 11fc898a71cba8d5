#!/bin/bash
# interleaved bench core: before (14b65d6), refactor end (4bc4401), HEAD
cd /work/main
for i in 1 2 3 4 5; do
  for r in 14b65d6 4bc4401 HEAD; do
    if [ $r = HEAD ]; then d=/work/main; else d=/tmp/rev-$r; fi
    (cd $d && PYTHONPATH=$d /work/main/.venv/bin/python -m bench.cli bench core 2>/dev/null | sed "s/^/$r $i /")
  done
done
