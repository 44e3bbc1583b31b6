#!/bin/bash
# A/B: queued local prompts priced one by one (new) against HEAD's pricing (old), `ratio`, alternating;
# then `blind` and vLLM-CPU at the new code, in the same window.
cd /work/main
swap() { for f in router/book.py router/policy.py router/cost_model.py; do
  if [ $1 = old ]; then git show HEAD:$f > $f; else cp /tmp/exp/$(basename $f).new $f; fi; done; }
for i in 1 2 3; do
  for v in old new; do
    swap $v
    .venv/bin/python -m pdserve bench turns --servers ratio --out-dir /tmp/exp/turns-$v-$i > /tmp/exp/turns-$v-$i.log 2>&1
    echo "== $v $i"; grep -E "^\| pdserve" /tmp/exp/turns-$v-$i/table.md; grep "^pdserve_placement_decisions_total" /tmp/exp/turns-$v-$i/ratio.metrics
  done
done
swap new
.venv/bin/python -m pdserve bench turns --servers blind,vllm --out-dir /tmp/exp/turns-peers > /tmp/exp/turns-peers.log 2>&1
echo "== peers"; grep -E "^\| " /tmp/exp/turns-peers/table.md
