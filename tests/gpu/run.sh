#!/usr/bin/env bash
# The GPU checks, on a machine with a CUDA device: torch >= 2.11 built with CUDA, triton, transformers and
# pytest installed; no Ray, no network. Tests needing 2 GPUs (NCCL) skip on one. Usage: tests/gpu/run.sh
# [pytest args]; PYTHON picks the interpreter (default: python3), GPU_TEST_TIMEOUT the limit in seconds.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
"$PY" - <<'PYEOF'
import sys
import torch
print(f"python {sys.version.split()[0]}  torch {torch.__version__}  cuda {torch.version.cuda}")
n = torch.cuda.device_count()
if not n:
    sys.exit("no CUDA device visible to torch: nothing here for the GPU checks to run on")
print(f"gpus {n}: " + ", ".join(torch.cuda.get_device_name(i) for i in range(n)))
try:
    import triton
    print(f"triton {triton.__version__}")
except ImportError:
    print("triton: not installed (the Triton kernel tests skip)")
import transformers
print(f"transformers {transformers.__version__}")
import pytest  # noqa: F401  (fails here, clearly, when pytest is missing)
PYEOF
exec timeout -k 15 "${GPU_TEST_TIMEOUT:-420}" "$PY" -m pytest tests/gpu -m gpu -x -q -p no:cacheprovider "$@"
