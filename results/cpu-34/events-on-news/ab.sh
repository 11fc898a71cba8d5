#!/bin/bash
# old (HEAD, /tmp/old) and new (/work/main, events read on news) alternated, kvroute-authz alone, agentic
for round in 1 2 3; do
  for v in old new; do
    out=/tmp/w/ev/$v-$round; rm -rf $out /tmp/w/prof/rates.txt
    (/tmp/w/prof/rates.sh &)
    if [ $v = old ]; then cd /tmp/old/bench; export PYTHONPATH=/tmp/old; else cd /work/main/bench; unset PYTHONPATH; fi
    KVROUTE_FLOW_CONTROL=false timeout 900 /work/main/.venv/bin/python -m bench.cli bench compare --trace /tmp/w/agentic.jsonl --limit 480 --concurrency 16 --max-output-tokens 8 --backends vllm-cpu:2 --capacity-ratio 0.2 --routers kvroute-authz --out $out > $out.log 2>&1
    sleep 3; cp /tmp/w/prof/rates.txt $out.rates
    python3 - $out <<'PY'
import json,sys
out=sys.argv[1]; d=json.load(open(out+'/results.json')); r=d['routers']; r=r[0] if isinstance(r,list) else list(r.values())[0]
rows=[l.split() for l in open(out+'.rates')]
sw=int(rows[-2][2])-int(rows[1][2]) if len(rows)>3 else -1
print(out.split('/')[-1], r.get('hit_rate'), r.get('ttft_p50_ms'), r['router_cpu_by_process_s'], 'wall', r.get('wall_s'), 'extproc switches', sw, flush=True)
PY
  done
done
