"""Linear layers with their weights packed once for oneDNN, the CPU's matrix library.

A decode step multiplies a few rows (one per running sequence) by every weight matrix of the
model. A plain `F.linear` runs those skinny products well below what the CPU can do; oneDNN,
given each weight reordered once into its own blocked layout, runs them faster at the batch sizes
decode lives at (BENCHMARKS.md, "packed linear layers"). `pack` swaps every `nn.Linear` of a model
for a `PackedLinear` that holds only the reordered copy (the original is freed unless something
else, such as tied input embeddings, still holds it). Prefill runs through the same layers.

Whether it pays depends on the CPU and the dtype, so `EngineConfig(packed_linear="auto")` decides
at start-up by timing the model's own weight shapes both ways (`measure` / `hardware.pick_packing`).

torch.compile cannot take a packed (opaque oneDNN) tensor as a graph input, so the compiled decode
step calls the op `pdserve_linear::packed_linear` with a handle (a 0-d int64 buffer per layer) and
the op looks the packed weight up: every decoder layer keeps one compiled region, its handles as
inputs. Eager calls skip the op and call oneDNN directly.

CPU only (`available` says whether this torch build and CPU can pack a dtype); no Ray.
"""
from __future__ import annotations

import itertools
import logging
import time
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine import hardware
from engine.hardware import LinearChoice

log = logging.getLogger(__name__)

_PACKED: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
_HANDLES = itertools.count()
PROBE_BATCHES = (1, 4, 16)  # decode batch sizes the choice is measured at


def available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch build, on this CPU, can pack linear weights of `dtype` (oneDNN packs bf16
    only where the CPU computes in it: AVX-512 BW/VL/DQ or AVX-NE-CONVERT)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), 1)
    except RuntimeError:  # oneDNN refuses the dtype on this CPU
        return False
    return True


def _pointwise(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")
    return y.reshape(*x.shape[:-1], out_features)


@torch.library.custom_op("pdserve_linear::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, handle: torch.Tensor, bias: torch.Tensor | None,
                  out_features: int) -> torch.Tensor:
    """`x @ W.T + bias` with the packed W that `handle` names (the compiled decode step's entry)."""
    return _pointwise(x.contiguous(), _PACKED[int(handle)], bias, out_features)


@packed_linear.register_fake
def _(x: torch.Tensor, handle: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


class _Holder:
    """Keeps the packed weight alive without exposing it to torch.compile as a module tensor."""

    def __init__(self, packed: torch.Tensor) -> None:
        self.packed = packed


class PackedLinear(torch.nn.Module):
    """An `nn.Linear` (same in/out features and bias) whose weight lives packed for oneDNN."""

    def __init__(self, linear: torch.nn.Linear, batch_hint: int) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint)
        self._holder = _Holder(packed)
        handle = next(_HANDLES)
        _PACKED[handle] = packed
        self.register_buffer("handle", torch.tensor(handle, dtype=torch.int64), persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return packed_linear(x, self.handle, self.bias, self.out_features)
        return _pointwise(x.contiguous(), self._holder.packed, self.bias, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack(model: torch.nn.Module, batch_hint: int = 16) -> int:
    """Swap every `nn.Linear` of `model` (its LM head included) for a `PackedLinear`, in place.

    Args:
        model: a CPU model in its serving dtype (float32 or bfloat16), in eval mode.
        batch_hint: the row count oneDNN lays the weights out for (a typical decode batch).
    Returns:
        how many layers were packed.
    """
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if isinstance(child, torch.nn.Linear)]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child, batch_hint))
    return len(swaps)


def _best_of(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm-up: first touch of the weights, oneDNN's kernel selection
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@torch.inference_mode()
def measure(model: torch.nn.Module, reps: int = 3, layers: int = 14) -> dict[str, float]:
    """Seconds of decode-sized products (batches `PROBE_BATCHES`) through `layers` of the model's
    linear weights, plain (`F.linear`) and packed. The packed copies live only while timed."""
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)][:layers]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in weights]
    out = {"plain": 0.0, "packed": 0.0}
    for batch in PROBE_BATCHES:
        xs = {w.shape[1]: torch.randn(batch, w.shape[1], dtype=w.dtype) for w in weights}
        out["plain"] += _best_of(lambda xs=xs: [F.linear(xs[w.shape[1]], w) for w in weights], reps)
        out["packed"] += _best_of(lambda xs=xs: [_pointwise(xs[w.shape[1]], p, None, w.shape[0])
                                                 for w, p in zip(weights, packed, strict=True)], reps)
    return out


def apply(model: torch.nn.Module, setting: str, device: str) -> LinearChoice:
    """Decide packed or plain for `model` (measuring where `setting` is "auto"), pack it if packed,
    log the choice and why. Returns the choice (`EngineConfig.linear` explains the settings).

    Raises:
        ValueError: "packed" asked for where it cannot run.
    """
    dtype = next(model.parameters()).dtype
    choice = hardware.choose_linear(setting, device, device == "cpu" and available(dtype))
    if any(isinstance(m, PackedLinear) for m in model.modules()):
        return LinearChoice(True, "the given model's layers were packed already")
    if choice.packed is None:
        t0 = time.perf_counter()
        choice = hardware.pick_linear(measure(model))
        log.info("linear auto: probed plain and packed in %.2f s", time.perf_counter() - t0)
    if choice.packed:
        pack(model)
    log.info("linear layers %s, because %s", "packed" if choice.packed else "plain", choice.reason)
    return choice
