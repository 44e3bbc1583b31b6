#!/bin/bash
# usage: bench/results/planner/avx512-bf16-2026-12-05-blocked/validate.sh LABEL [serve flags...]: calibrate serving factors on a light run, then validate 3 workloads with them
set -u
cd "$(dirname "$0")/../../../.."  # the repository
L=$1; shift
OUT=${OUT_DIR:-/tmp/pdserve-validate}/$L; mkdir -p $OUT
SLO="--ttft-target 1.2 --tpot-target 0.06"
.venv/bin/python -m pdserve serve --http-port 8011 --grpc-port 50111 --no-lend-threads $SLO "$@" > $OUT/server.log 2>&1 &
SP=$!
for i in $(seq 1 240); do grep -q READY $OUT/server.log && break; sleep 1; done
grep READY $OUT/server.log || { echo "server did not start"; tail -20 $OUT/server.log; kill $SP; exit 1; }
U=http://127.0.0.1:8011
P=".venv/bin/python -m pdserve plan --validate $U $SLO"
$P --trace fixed:256:64 --rate 0.5 --num-requests 16 --seed 5 --out $OUT/calib.json > $OUT/calib.txt 2>&1
F=$(.venv/bin/python -c "import json; f=json.load(open('$OUT/calib.json'))['measured_factors']; print(','.join(f'{k}={v:.6g}' for k, v in f.items()))")
echo "factors $F" > $OUT/factors.txt
$P --factors $F --trace fixed:128:128 --rate 1.0 --num-requests 40 --out $OUT/decode.json > $OUT/decode.txt 2>&1
$P --factors $F --trace fixed:1024:16 --rate 0.6 --num-requests 40 --out $OUT/prompt.json > $OUT/prompt.txt 2>&1
$P --factors $F --trace bench/results/planner/avx512-bf16-2026-12-05-blocked/mixed.jsonl --out $OUT/mixed.json > $OUT/mixed.txt 2>&1
kill -INT $SP; wait $SP
cat $OUT/factors.txt; tail -n 12 $OUT/*.txt
