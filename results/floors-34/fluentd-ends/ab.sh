#!/bin/sh
# before (/tmp/ci at b2235be, gRPC access-log service) and after (/work/main, Fluentd logger), alternated
for i in 1 2; do
  (cd /tmp/ci && .venv/bin/kvroute-dev bench floors --requests 2000 --rounds 1 --transports none,ext_authz_http,kvroute_authz > /tmp/w/fl/before-$i.jsonl 2>/tmp/w/fl/before-$i.err)
  (cd /work/main && .venv/bin/kvroute-dev bench floors --requests 2000 --rounds 1 --transports none,ext_authz_http,kvroute_authz > /tmp/w/fl/after-$i.jsonl 2>/tmp/w/fl/after-$i.err)
done
echo done
