#!/bin/bash
# Start `pdserve serve` with test_response_format's flags (+ "$@"), time it until READY, save its cost model, stop it.
cd /work/main
t0=$(date +%s.%N)
RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1 .venv/bin/python -m pdserve serve --dtype float32 --kv-memory-gib 0.25 --http-port 18090 --grpc-port 18091 --served-model-name smollm2 --prefill 1 --decode 1 --policy round_robin --no-compile --no-lend-threads "$@" > /tmp/rf.log 2>&1 &
pid=$!
until grep -q '^READY' /tmp/rf.log; do sleep 0.2; if ! kill -0 $pid 2>/dev/null; then echo died; tail /tmp/rf.log; exit 1; fi; done
echo "READY after $(echo "$(date +%s.%N) - $t0" | bc) s $*"
curl -s http://127.0.0.1:18090/pdserve/cost_model > /tmp/rf_cost.json.new
kill -TERM $pid; wait $pid
