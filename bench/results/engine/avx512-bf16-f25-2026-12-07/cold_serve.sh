#!/bin/bash
# one cold `pdserve serve` start (empty inductor cache) from the tree $1; prints seconds to "serving"
tree=$1; d=$(mktemp -d); log=$(mktemp)
cd $tree; t0=$(date +%s.%N)
TORCHINDUCTOR_CACHE_DIR=$d /work/main/.venv/bin/python -m pdserve serve --http-port 18090 --grpc-port 18091 > $log 2>&1 &
pid=$!
while ! grep -q '^\[pdserve\] serving' $log; do sleep 0.5; if ! kill -0 $pid 2>/dev/null; then echo "died"; tail -5 $log; break; fi; done
t1=$(date +%s.%N)
echo "$tree: serving after $(echo "$t1 - $t0" | bc) s; $(grep -o 'workers up in [0-9.]* s' $log); $(grep -o 'calibrated in [0-9.]* s' $log)"
kill -INT $pid; wait $pid 2>/dev/null; rm -rf $d $log
