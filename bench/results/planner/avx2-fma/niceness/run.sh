#!/bin/bash
# usage: run.sh RESULTS_DIR LABEL [serve flags...]: bench/validate_planner.sh cut to the light run and the
# decode-heavy workload, and the workers' niceness (ps) at the end. Run with and without
# RAY_worker_niceness=0 in the environment (TTFT=10 TPOT=0.15 CALIB_RATE=0.3 DECODE_RATE=0.5).
set -u
cd "$(dirname "$0")/../../../.."  # the repository
DIR=$1; L=$2; shift 2
OUT=$DIR/$L; mkdir -p "$OUT"
SLO="--ttft-target ${TTFT:-1.2} --tpot-target ${TPOT:-0.06}"
.venv/bin/python -m pdserve serve --http-port 8011 --grpc-port 50111 --no-lend-threads $SLO "$@" > "$OUT/server.log" 2>&1 &
SP=$!
for _ in $(seq 1 400); do grep -q READY "$OUT/server.log" && break; sleep 1; done
grep READY "$OUT/server.log" || { echo "server did not start"; tail -20 "$OUT/server.log"; kill $SP; exit 1; }
P=".venv/bin/python -m pdserve plan --validate http://127.0.0.1:8011 $SLO"
# The server's calibrated cost model, and its metrics after each run (step times, the correction's factors):
# what a later simulation of the same runs needs.
get() { .venv/bin/python -c "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen('http://127.0.0.1:8011$1').read().decode())"; }
get /pdserve/cost_model > "$OUT/cost_model.json"
$P --trace fixed:256:64 --rate "${CALIB_RATE:-0.5}" --num-requests 16 --seed 5 --out "$OUT/calib.json" > "$OUT/calib.txt" 2>&1
F=$(.venv/bin/python -c "import json; f=json.load(open('$OUT/calib.json'))['measured_factors']; print(f'prefill={f[\"prefill\"]:.3f},decode={f[\"decode\"]:.3f},latency_s={f[\"latency_s\"]:.4f}')")
$P --factors "$F" --trace fixed:128:128 --rate "${DECODE_RATE:-1.0}" --num-requests 40 --out "$OUT/decode.json" > "$OUT/decode.txt" 2>&1
ps -eo pid,ni,pcpu,comm,args | grep -E "ray::|pdserve" | grep -v grep | cut -c1-120 > "$OUT/ps.txt"
kill -INT $SP; wait $SP
tail -n 12 "$OUT"/*.txt
