#!/bin/bash
# every second: ticks and voluntary switches of the ext_proc (all threads) and of Envoy, until both exit
for i in $(seq 1 600); do
  pe=$(pgrep -f 'extproc.cli extproc' | head -1); pv=$(pgrep -x envoy | head -1)
  [ -n "$pe" ] && [ -n "$pv" ] && break; sleep 0.5
done
sw() { local s=0; for t in /proc/$1/task/*/status; do s=$((s + $(awk '/^voluntary_ctxt/{print $2}' $t 2>/dev/null || echo 0))); done; echo $s; }
while kill -0 $pe 2>/dev/null || kill -0 $pv 2>/dev/null; do
  echo "$(date +%s.%N | cut -c1-13) $(awk '{print $14+$15}' /proc/$pe/stat 2>/dev/null || echo -) $(sw $pe) $(awk '{print $14+$15}' /proc/$pv/stat 2>/dev/null || echo -) $(sw $pv)" >> /tmp/w/prof/rates.txt
  sleep 1
done
