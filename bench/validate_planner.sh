#!/bin/bash
# usage: bench/validate_planner.sh RESULTS_DIR LABEL [serve flags...]: start `pdserve serve --no-lend-threads`
# with those flags, measure its serving factors on a light run, then `pdserve plan --validate` three workloads
# (decode-heavy, prompt-heavy, RESULTS_DIR/mixed.jsonl) with them; every result into RESULTS_DIR/LABEL.
# Scaled to the machine through the environment: TTFT, TPOT (the SLO, s), CALIB_RATE, DECODE_RATE,
# PROMPT_RATE (req/s), PROMPT_REQUESTS; WORKLOADS (default "decode prompt mixed") to run fewer; CALIB_TRACE
# (default fixed:256:128: at 0.5 req/s most of its prompts are prefilled while the decode worker decodes, so
# the light run measures what that costs, `ServingFactors.prefill_beside`; fixed:256:64 was the old one);
# CALIB_EACH=1: a light run right before each workload, whose factors that workload is simulated with (the
# VM's speed drifts over minutes; default: one light run for all three).
set -u
cd "$(dirname "$0")/.."  # the repository
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
calib() {  # TAG: a light run; its serving factors into F (and factors.txt)
    local c=$OUT/calib$1
    $P --trace "${CALIB_TRACE:-fixed:256:128}" --rate "${CALIB_RATE:-0.5}" --num-requests 16 --seed 5 --out "$c.json" > "$c.txt" 2>&1; get /metrics > "$c.metrics"
    F=$(.venv/bin/python -c "import json; f=json.load(open('$c.json'))['measured_factors']; print(','.join(f'{k}={v:.4g}' for k, v in f.items()))")
    echo "factors$1 $F" >> "$OUT/factors.txt"
}
: > "$OUT/factors.txt"
[ "${CALIB_EACH:-0}" = 1 ] || calib ""
workload() {  # NAME [plan flags...]: one workload validated with the light run's factors, if WORKLOADS names it
    local name=$1; shift
    case " ${WORKLOADS:-decode prompt mixed} " in *" $name "*) ;; *) return ;; esac
    [ "${CALIB_EACH:-0}" = 1 ] && calib "-$name"
    $P --factors "$F" "$@" --out "$OUT/$name.json" > "$OUT/$name.txt" 2>&1; get /metrics > "$OUT/$name.metrics"
}
workload decode --trace fixed:128:128 --rate "${DECODE_RATE:-1.0}" --num-requests 40
workload prompt --trace fixed:1024:16 --rate "${PROMPT_RATE:-0.6}" --num-requests "${PROMPT_REQUESTS:-40}"
workload mixed --trace "$DIR/mixed.jsonl"
kill -INT $SP; wait $SP
cat "$OUT/factors.txt"; tail -n 12 "$OUT"/*.txt
