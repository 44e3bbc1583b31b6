#!/bin/bash
# A/B: the scheduler change (new) against HEAD's scheduler (old), ratio and blind, alternating
cd /work/main
cp engine/scheduler.py /tmp/exp/scheduler.new.py
for i in 1 2; do
  for v in old new; do
    if [ $v = old ]; then git show HEAD:engine/scheduler.py > engine/scheduler.py; else cp /tmp/exp/scheduler.new.py engine/scheduler.py; fi
    .venv/bin/python -m pdserve bench turns --servers ratio,blind --out-dir /tmp/exp/turns-$v-$i > /tmp/exp/turns-$v-$i.log 2>&1
    echo "== $v $i"; cat /tmp/exp/turns-$v-$i/table.md | grep -E "^\| (pdserve|server)" 
  done
done
cp /tmp/exp/scheduler.new.py engine/scheduler.py
