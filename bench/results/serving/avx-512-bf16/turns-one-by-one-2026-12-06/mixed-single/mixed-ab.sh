#!/bin/bash
# A/B on `single` (0P:1D, both cores), mixed load: the scheduler before (045e36b) and after (a8db265), alternating
cd /work/main
cp engine/scheduler.py /tmp/exp/scheduler.new.py
for i in 1 2; do
  for v in old new; do
    if [ $v = old ]; then git show 045e36b:engine/scheduler.py > engine/scheduler.py; else cp /tmp/exp/scheduler.new.py engine/scheduler.py; fi
    .venv/bin/python -m pdserve serve --prefill 0 --cpus-per-worker 2 --http-port 8111 --grpc-port 8112 > /tmp/exp/mixed-$v-$i.server.log 2>&1 &
    until grep -q READY /tmp/exp/mixed-$v-$i.server.log; do sleep 2; done
    .venv/bin/python -m pdserve bench serve --target http://127.0.0.1:8111 --workload mixed --rate 0.8 --num-requests 32 --seed 0 --no-progress --out /tmp/exp/mixed-$v-$i.json > /tmp/exp/mixed-$v-$i.log 2>&1
    echo "== $v $i"; grep -E "TTFT|ITL|TPOT|throughput|goodput" /tmp/exp/mixed-$v-$i.log
    pkill -f "pdserve serve"; sleep 5; .venv/bin/ray stop --force > /dev/null 2>&1; sleep 3
  done
done
cp /tmp/exp/scheduler.new.py engine/scheduler.py
