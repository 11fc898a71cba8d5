#!/bin/sh
# before (/tmp/ab at 54af11a, aiohttp serving the calls) and after (/work/main, calls.py), alternated
for i in 1 2 3; do
  (cd /tmp/ab && .venv/bin/kvroute-dev bench floors --requests 2000 --rounds 1 --transports none,ext_authz_http,kvroute_authz > results/floors-34/lean-calls/before-$i.jsonl 2>results/floors-34/lean-calls/before-$i.err)
  (cd /work/main && .venv/bin/kvroute-dev bench floors --requests 2000 --rounds 1 --transports none,ext_authz_http,kvroute_authz > results/floors-34/lean-calls/after-$i.jsonl 2>results/floors-34/lean-calls/after-$i.err)
done
echo done
