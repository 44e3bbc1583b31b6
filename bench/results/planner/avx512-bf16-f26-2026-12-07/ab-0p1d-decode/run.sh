#!/bin/bash
# 0P:1D decode-heavy validation, engine code at 954d446 (old) and at HEAD (new), alternating, in place
cd /work/main
export TTFT=4 TPOT=0.08 CALIB_RATE=0.5 DECODE_RATE=1.0 WORKLOADS=decode
FILES="engine/attention.py engine/kernels/__init__.py engine/kernels/cpu_kernels.c engine/model_runner.py engine/sampler.py"
for round in 1 2; do
  git checkout -q 954d446 -- $FILES
  bash bench/validate_planner.sh /tmp/pvab old-$round --prefill 0 --cpus-per-worker 2 > /tmp/pvab/old-$round.log 2>&1
  git checkout -q HEAD -- $FILES
  bash bench/validate_planner.sh /tmp/pvab new-$round --prefill 0 --cpus-per-worker 2 > /tmp/pvab/new-$round.log 2>&1
done
git checkout -q HEAD -- $FILES
echo finished > /tmp/pvab/done
