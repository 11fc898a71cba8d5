cd /work/main/bench
for spec in "kvroute:--session-capacity=100001,kvroute-authz,kvroute,sglang-router-cache_aware:e1" "kvroute,sglang-router-cache_aware,kvroute-authz,kvroute:--session-capacity=100001:e2"; do
  routers=${spec%:e*}; name=e${spec##*:e}
  KVROUTE_FLOW_CONTROL=false timeout 1800 ../.venv/bin/kvroute-dev bench compare --trace ../../shared/traces/agents/agent-check.jsonl --limit 480 --concurrency 16 --order arrival --max-input-tokens 12000 --max-output-tokens 32 --backends vllm-cpu:2 --capacity-ratio 0.5 --envoy-reset-streams --routers "$routers" --out /tmp/w/ac/$name > /tmp/w/ac/$name.log 2>&1
done
echo alldone > /tmp/w/ac/exp.done
