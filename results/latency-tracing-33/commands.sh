#!/bin/sh
# Issue 33: tracing's cost, off and on, interleaved, two rounds each (same machine, nothing else running).
for round in 1 2; do
  kvroute-dev bench latency --requests 1000 > off-$round.txt 2>&1
  kvroute-dev bench latency --requests 1000 --tracing > on-$round.txt 2>&1
done
