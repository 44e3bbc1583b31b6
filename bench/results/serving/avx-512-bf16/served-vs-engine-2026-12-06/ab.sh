#!/bin/bash
# served (single: one decode worker on both cores) vs the engine alone, alternating
cd /work/main
for i in 1 2 3; do
  .venv/bin/python -m pdserve serve --prefill 0 --cpus-per-worker 2 --http-port 8111 --grpc-port 8112 > /tmp/exp/single-$i.log 2>&1 &
  until grep -q READY /tmp/exp/single-$i.log; do sleep 2; done
  .venv/bin/python -m pdserve bench serve --target http://127.0.0.1:8111 --workload fixed:128:128 --concurrency 12 --num-requests 60 --num-warmups 12 --no-progress --out /tmp/exp/ab-serve-$i.json 2>&1 | grep -E "throughput" | sed "s/^/serve $i: /"
  curl -s http://127.0.0.1:8111/metrics | grep -E "^pdserve_engine_(decode|prefill|mixed)" > /tmp/exp/ab-metrics-$i.txt
  pkill -f "pdserve serve"; sleep 5; .venv/bin/ray stop --force > /dev/null 2>&1; sleep 3
  .venv/bin/python /tmp/exp/loop.py 12 60 12 2>&1 | tail -2 | sed "s/^/engine $i: /"
done
