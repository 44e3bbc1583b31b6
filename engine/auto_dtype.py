"""`dtype="auto"`: load the model in the dtype that serves fastest on this machine.

1. `engine.hardware.choose_dtype` decides from the CPU flags or the CUDA device where they are
   decisive; the model is then loaded in that dtype.
2. Where they are not, the model is loaded in float32 and `measure` times its own linear layers in
   float32 and in bfloat16 for the shapes serving runs (a decode step at batch 1 and 16, a prefill
   chunk); the faster total wins and the model is cast to it (the cast rounds as loading in bf16
   would).
Explicit dtypes skip all of this.
"""
from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from engine import hardware
from engine.hardware import AUTO, CpuInfo, DtypeChoice
from engine.model_loader import TORCH_DTYPES, load_model

log = logging.getLogger(__name__)
_PROBE_TOKENS = (1, 16, 128)  # decode at batch 1 and 16, a prefill chunk
_PREFILL_SHARE = 8  # the prefill probe runs over 1/8 of the layers (its FLOPs dominate otherwise)


def cuda_bf16(device: str) -> bool:
    """Whether this CUDA device computes in bf16 natively (compute capability 8.0 or later)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability(torch.device(device))[0] >= 8


@torch.inference_mode()
def measure(model: PreTrainedModel, reps: int = 2) -> dict[str, float]:
    """Seconds of the probe shapes through the model's linear layers, per dtype (float32, bfloat16).
    The bf16 copy of the weights lives only while it is timed."""
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    out: dict[str, float] = {}
    for name in ("float32", "bfloat16"):
        dtype = TORCH_DTYPES[name]
        ws = [w.to(dtype) for w in weights]
        total = 0.0
        for n in _PROBE_TOKENS:
            subset = ws if n < 64 else ws[:max(1, len(ws) // _PREFILL_SHARE)]
            xs = {w.shape[1]: torch.randn(n, w.shape[1], dtype=dtype, device=w.device) for w in subset}

            def run(subset: list[torch.Tensor] = subset, xs: dict = xs) -> None:
                for w in subset:
                    F.linear(xs[w.shape[1]], w)
            total += hardware.best_of(run, reps)
        out[name] = total
        del ws
    return out


def load_auto(model: str | None, device: str,
              cpu: CpuInfo | None = None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None, DtypeChoice]:
    """Load `model` in the dtype that serves fastest here. Returns (model, tokenizer, the choice and why).

    Args:
        model: model directory (None: the embedded default).
        device: "cpu" or "cuda[:N]".
        cpu: the CPU to decide for (default: this machine's; tests pass others).
    """
    cpu = cpu or hardware.this_cpu()
    choice = hardware.choose_dtype(device, cpu, cuda_bf16(device) if device.startswith("cuda") else False)
    if choice.dtype is not None:
        hf, tok = load_model(model, choice.dtype, device)
        return hf, tok, choice
    hf, tok = load_model(model, "float32", device)
    t0 = time.perf_counter()
    choice = hardware.pick_measured(measure(hf))
    log.info("dtype auto: probed both dtypes in %.1f s (%s: %s)", time.perf_counter() - t0, cpu.model,
             cpu.isa_summary())
    if choice.dtype != "float32":
        hf = hf.to(TORCH_DTYPES[choice.dtype])
    return hf, tok, choice


def load_for(dtype: str, model: str | None, device: str,
             cpu: CpuInfo | None = None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None, DtypeChoice]:
    """The engine's loader: `dtype` as given, or "auto" resolved by `load_auto`."""
    if dtype == AUTO:
        hf, tok, choice = load_auto(model, device, cpu)
        log.info("dtype auto: %s, because %s", choice.dtype, choice.reason)
        return hf, tok, choice
    hf, tok = load_model(model, dtype, device)
    return hf, tok, DtypeChoice(dtype, "set explicitly")
