"""Linear layers computed the fastest way on this CPU: plain `F.linear`, packed once for oneDNN (the
CPU's matrix library), pdserve's own small-batch kernel, or its kernel on a blocked copy of the weight.

A decode step multiplies a few rows (one per running sequence) by every weight matrix of the
model. A plain `F.linear` can run those skinny products well below what the CPU does; oneDNN,
given a weight reordered once into its own blocked layout, runs them faster at the batch sizes
decode lives at, but pays a fixed cost per call that small matrices at batch 1 do not earn back
(BENCHMARKS.md, "packed linear layers"); the kernel (`engine.kernels`: fp32 with AVX2 + FMA, bf16
with AVX-512 BF16, on AMX tiles where the CPU has them) streams each weight once for all the rows
with no fixed cost to speak of; on a blocked copy (`engine.kernels.Kernel.block_weight`: bf16 with AVX-512
BF16 in blocks of 16 output columns by pairs of K, fp32 in blocks of 16 columns with AVX-512 or 8 with
AVX2 + FMA) it needs no horizontal sums, so it runs any number of rows near the CPU's vector rate, prefill's too.
So the choice is per group of layers (one name and shape: "gate_proj 1536x576", "lm_head 49152x576"):
`EngineConfig(linear="auto")` times each group's own weights every way at start-up (`measure`,
decided by `hardware.pick_linear`) the first time this machine serves the model that way, and keeps
the choice on disk for the starts after (`_measured_choice`); `pack` swaps the winners' `nn.Linear`s for
`PackedLinear`s or `BlockedLinear`s that hold only the reordered copy (the original is freed unless
something else, such as tied input embeddings, still holds it) or `KernelLinear`s. Prefill runs
through the same layers.

torch.compile cannot take a packed (opaque oneDNN) tensor as a graph input, so the compiled decode
step calls the C++ operator `pdserve_cpu::packed_linear` with a handle (a 0-d int64 buffer per
layer) and the operator looks the packed weight up: every decoder layer keeps one compiled region,
its handles as inputs, and no Python runs per layer (the Python op `pdserve_linear::packed_linear`
serves where the C++ one did not build: ~25 us more per call, ~5 ms per decode step of a 30-layer
model). Eager calls skip the op and call oneDNN directly.

Eager and compiled, a `KernelLinear` calls the kernel's C++ operator `pdserve_cpu::linear` (the
Python op `pdserve_linear::kernel_linear` over ctypes where that did not build) and a `BlockedLinear`
`pdserve_cpu::blocked_linear` (`pdserve_linear::blocked_linear`); their weights are plain graph
inputs. CPU only (`available` says whether this torch build and CPU can pack a dtype,
`kernel_available` and `blocked_available` whether the kernels run); no Ray.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import time
import weakref

import torch
import torch.nn.functional as F

from engine import hardware
from engine.hardware import ALL_LAYERS, LinearChoice

log = logging.getLogger(__name__)

_PACKED: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
_HANDLES = itertools.count()
PROBE_BATCHES = (1, 4, 16)  # decode batch sizes the choice is measured at (`hardware.pick_linear`)
BATCH_HINT = 16  # the row count oneDNN lays packed weights out for (a typical decode batch)


def available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch build, on this CPU, can pack linear weights of `dtype` (oneDNN packs bf16
    only where the CPU computes in it: AVX-512 BW/VL/DQ or AVX-NE-CONVERT)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        _packed_weight(torch.zeros(8, 8, dtype=dtype), 1)
    except RuntimeError:  # oneDNN refuses the dtype on this CPU
        return False
    return True


def _pointwise(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")
    return y.reshape(*x.shape[:-1], out_features)


@torch.library.custom_op("pdserve_linear::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, handle: torch.Tensor, bias: torch.Tensor | None,
                  out_features: int) -> torch.Tensor:
    """`x @ W.T + bias` with the packed W that `handle` names (the compiled decode step's entry where
    the C++ operator did not build)."""
    return _pointwise(x.contiguous(), _PACKED[int(handle)], bias, out_features)


@packed_linear.register_fake
def _(x: torch.Tensor, handle: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def _packed_weight(weight: torch.Tensor, batch_hint: int = BATCH_HINT) -> torch.Tensor:
    """`weight` laid out by oneDNN for products of about `batch_hint` rows (the op behind torch's own
    mkldnn linear path)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)


class _Holder:
    """Keeps the packed weight alive without exposing it to torch.compile as a module tensor."""

    def __init__(self, packed: torch.Tensor) -> None:
        self.packed = packed


class PackedLinear(torch.nn.Module):
    """An `nn.Linear` (same in/out features and bias) whose weight lives packed for oneDNN."""

    def __init__(self, linear: torch.nn.Linear, batch_hint: int = BATCH_HINT) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_dtype = linear.weight.dtype
        packed = _packed_weight(linear.weight.detach(), batch_hint)
        self._holder = _Holder(packed)
        self._op = _packed_op()
        if self._op is packed_linear:
            handle = next(_HANDLES)
            _PACKED[handle] = packed
        else:  # the C++ operator's table holds it until this layer goes
            handle = torch.ops.pdserve_cpu.hold_packed(packed)
            weakref.finalize(self, torch.ops.pdserve_cpu.drop_packed, handle)
        self.register_buffer("handle", torch.tensor(handle, dtype=torch.int64), persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return self._op(x, self.handle, self.bias, self.out_features)
        return _pointwise(x.contiguous(), self._holder.packed, self.bias, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def held() -> int:
    """How many packed weights are alive (in the C++ operator's table and the Python op's)."""
    cpp = torch.ops.pdserve_cpu.held_packed() if _packed_op() is not packed_linear else 0
    return len(_PACKED) + cpp


def _packed_op():
    """The C++ operator a compiled step calls for packed layers, or the Python one where it did not build."""
    from engine import kernels

    return kernels.packed_op() or packed_linear


def _kernel():
    from engine import kernels

    return kernels.active().kernel


def kernel_available(dtype: torch.dtype) -> bool:
    """Whether pdserve's linear kernel runs here for `dtype` (fp32: a kernel build with AVX2 + FMA
    loaded; bf16: one with AVX-512 BF16)."""
    kernel = _kernel()
    return kernel is not None and kernel.has_linear(dtype)


def _kernel_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = _kernel().linear(x.reshape(-1, x.shape[-1]), weight, bias)
    return y.reshape(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("pdserve_linear::kernel_linear", mutates_args=())
def kernel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ weight.T + bias` through pdserve's small-batch kernel over ctypes (where its C++ operator
    `pdserve_cpu::linear` did not build)."""
    return _kernel_forward(x, weight, bias)


def _kernel_op(dtype: torch.dtype):
    """The kernel's C++ operator, or the Python one over ctypes: what a `KernelLinear` of `dtype` calls."""
    from engine import kernels

    return kernels.active().linear_op(dtype) or kernel_linear


@kernel_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


class KernelLinear(torch.nn.Module):
    """An `nn.Linear` (its own weight and bias, fp32 or bf16) computed by pdserve's small-batch kernel."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_dtype = linear.weight.dtype  # as `PackedLinear` has it
        self.weight, self.bias = linear.weight, linear.bias
        self._op = _kernel_op(linear.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def blocked_available(dtype: torch.dtype) -> bool:
    """Whether pdserve's kernel computes linear layers of `dtype` from a blocked weight here (fp32: a
    kernel build with AVX2 + FMA loaded; bf16: one with AVX-512 BF16)."""
    kernel = _kernel()
    return kernel is not None and kernel.has_blocked(dtype)


def _blocked_forward(x: torch.Tensor, blocked: torch.Tensor, bias: torch.Tensor | None,
                     out_features: int) -> torch.Tensor:
    y = _kernel().blocked_linear(x.reshape(-1, x.shape[-1]), blocked, bias, out_features)
    return y.reshape(*x.shape[:-1], out_features)


@torch.library.custom_op("pdserve_linear::blocked_linear", mutates_args=())
def blocked_linear(x: torch.Tensor, blocked: torch.Tensor, bias: torch.Tensor | None,
                   out_features: int) -> torch.Tensor:
    """`x @ W.T + bias` from W's blocked copy over ctypes (where the C++ operator
    `pdserve_cpu::blocked_linear` did not build)."""
    return _blocked_forward(x, blocked, bias, out_features)


@blocked_linear.register_fake
def _(x: torch.Tensor, blocked: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def _blocked_op(dtype: torch.dtype):
    """The blocked kernel's C++ operator, or the Python one over ctypes: what a `BlockedLinear` of `dtype` calls."""
    from engine import kernels

    return kernels.active().blocked_op(dtype) or blocked_linear


class BlockedLinear(torch.nn.Module):
    """An `nn.Linear` (same in/out features and bias, fp32 or bf16) whose weight lives as a blocked copy for
    pdserve's kernel (`engine.kernels.Kernel.block_weight`), for every number of rows: decode steps and prefill."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_dtype = linear.weight.dtype
        self.register_buffer("blocked", _kernel().block_weight(linear.weight), persistent=False)
        self.bias = linear.bias
        self._op = _blocked_op(self.weight_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x, self.blocked, self.bias, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


SWAPPED = (PackedLinear, KernelLinear, BlockedLinear)  # what `pack` puts where an `nn.Linear` was


def group_of(name: str, linear: torch.nn.Linear | PackedLinear | KernelLinear | BlockedLinear) -> str:
    """A layer's group: its attribute name and weight shape, e.g. "gate_proj 1536x576"."""
    return f"{name.rsplit('.', 1)[-1]} {linear.out_features}x{linear.in_features}"


def groups(model: torch.nn.Module) -> dict[str, list[tuple[torch.nn.Module, str, torch.nn.Linear]]]:
    """Every `nn.Linear` of `model` as (parent, attribute, layer), by group (`group_of`)."""
    out: dict[str, list[tuple[torch.nn.Module, str, torch.nn.Linear]]] = {}
    for parent_name, parent in model.named_modules():
        for name, child in parent.named_children():
            if isinstance(child, torch.nn.Linear):
                out.setdefault(group_of(f"{parent_name}.{name}", child), []).append((parent, name, child))
    return out


def swapped(linear: torch.nn.Linear, group: str, choice: LinearChoice | None,
            batch_hint: int = BATCH_HINT) -> torch.nn.Module:
    """`linear` (of `group`) as `choice` computes it: a `PackedLinear`, `KernelLinear` or `BlockedLinear`
    made from it, or `linear` itself where it stays plain; None packs every layer."""
    if choice is None or choice.packs(group):
        return PackedLinear(linear, batch_hint=batch_hint)
    if choice.uses_kernel(group):
        return KernelLinear(linear)
    if choice.uses_blocked(group):
        return BlockedLinear(linear)
    return linear


def pack(model: torch.nn.Module, choice: LinearChoice | None = None, batch_hint: int = BATCH_HINT) -> int:
    """Swap the `nn.Linear` layers of `model` that `choice` packs (default: all) for `PackedLinear`s,
    those it puts on the kernel for `KernelLinear`s and those on blocked weights for `BlockedLinear`s, in
    place.

    Args:
        model: a CPU model in its serving dtype (float32 or bfloat16), in eval mode.
        choice: which groups go which way (`hardware.LinearChoice`); None packs every layer.
        batch_hint: the row count oneDNN lays the weights out for (a typical decode batch).
    Returns:
        how many layers were swapped.
    """
    swaps = 0
    for group, members in groups(model).items():
        for parent, name, child in members:
            layer = swapped(child, group, choice, batch_hint)
            if layer is not child:
                setattr(parent, name, layer)
                swaps += 1
    return swaps


@torch.inference_mode()
def measure(model: torch.nn.Module, reps: int = 3, layers: int = 4, kernel: bool = False,
            blocked: bool = False) -> dict[str, dict[str, list[float]]]:
    """Seconds of decode-sized products through up to `layers` layers of each group, plain (`F.linear`),
    packed, with `kernel` on pdserve's kernel and with `blocked` on its blocked weights, one figure per
    batch of `PROBE_BATCHES`: {group: {"plain": [s, ...], "packed": [s, ...], "kernel": [s, ...],
    "blocked": [s, ...]}}. Each way is called as its layer calls it (the kernels through the operators
    `KernelLinear` and `BlockedLinear` call: at batch 1 a call's overhead is a share of the time). The packed
    and blocked copies live only while timed."""
    out: dict[str, dict[str, list[float]]] = {}
    for group, members in groups(model).items():
        weights = [child.weight for _, _, child in members[:layers]]
        packed = [_packed_weight(w) for w in weights]
        ways = {"plain": lambda x, ws=weights: [F.linear(x, w) for w in ws],
                "packed": lambda x, ws=weights, ps=packed: [_pointwise(x, p, None, w.shape[0])
                                                            for w, p in zip(ws, ps, strict=True)]}
        dtype = weights[0].dtype
        if kernel:
            ways["kernel"] = lambda x, ws=weights, op=_kernel_op(dtype): [op(x, w, None) for w in ws]
        if blocked:
            copies = [_kernel().block_weight(w) for w in weights]
            ways["blocked"] = lambda x, ws=weights, bs=copies, op=_blocked_op(dtype): [
                op(x, b, None, w.shape[0]) for w, b in zip(ws, bs, strict=True)]
        times = out[group] = {way: [] for way in ways}
        for batch in PROBE_BATCHES:
            x = torch.randn(batch, weights[0].shape[1], dtype=weights[0].dtype)
            for way, run in ways.items():
                times[way].append(hardware.best_of(lambda x=x, run=run: run(x), reps))
    return out


def apply(model: torch.nn.Module, setting: str, device: str) -> LinearChoice:
    """Decide which linear layers of `model` to pack (measuring where `setting` is "auto"), pack
    them, log the choice and why. Returns the choice (`EngineConfig.linear` explains the settings).

    Raises:
        ValueError: "packed" asked for where it cannot run.
    """
    dtype = next(model.parameters()).dtype
    choice = hardware.choose_linear(setting, device, device == "cpu" and available(dtype))
    packed, on_kernel, on_blocked = (
        frozenset(group_of(n, m) for n, m in model.named_modules() if isinstance(m, cls)) for cls in SWAPPED)
    if packed or on_kernel or on_blocked:  # an engine built on a model another engine swapped: it runs as it is
        return LinearChoice(packed if groups(model) or on_kernel or on_blocked else ALL_LAYERS,
                            "the given model was swapped already", kernel=on_kernel, blocked=on_blocked)
    if choice.groups is None:
        choice = _measured_choice(model, dtype)
    n = pack(model, choice)
    log.info("linear layers %s (%d swapped), because %s", choice.summary(), n, choice.reason)
    return choice


def _measured_choice(model: torch.nn.Module, dtype: torch.dtype) -> LinearChoice:
    """The "auto" choice for `model`: the one this machine measured before for the same groups, dtype,
    thread count, kernel build and source, decision rule and torch, or a new measurement, kept for the
    next start.

    Groups whose ways time within noise of each other flip between starts when measured every time,
    and each flip is a different compiled decode graph: torch's compile cache misses and the start
    pays the whole compile again (minutes on a small CPU). A kept choice makes a restart the same
    engine as before. Kept under `cache_root()/linear/`, one small JSON per key; delete it to
    measure again."""
    from engine import kernels
    from engine.model_store import cache_root

    kernel, blocked = kernel_available(dtype), blocked_available(dtype)
    cpu = hardware.this_cpu()
    key = {"cpu": cpu.model, "flags": sorted(cpu.flags), "torch": torch.__version__, "dtype": str(dtype),
           "threads": torch.get_num_threads(),
           "kernel": [kernels.active().name, kernels.source_tag()] if kernel or blocked else None,
           "groups": sorted(groups(model)),
           "rule": [list(PROBE_BATCHES), BATCH_HINT, hardware.PACKED_GAIN, hardware.PACKED_BATCH1_LOSS]}
    tag = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_root() / "linear" / f"choice-{tag}.json"
    try:
        kept = json.loads(path.read_text())
        choice = LinearChoice(frozenset(kept["packed"]), kept["reason"], kernel=frozenset(kept["kernel"]),
                              blocked=frozenset(kept["blocked"]))
        log.info("linear auto: the choice this machine measured before (%s; delete it to measure again)", path)
        return choice
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as e:  # unreadable or from another version: measure again
        log.warning("linear auto: ignoring the kept choice %s (%s)", path, e)
    t0 = time.perf_counter()
    choice = hardware.pick_linear(measure(model, kernel=kernel, blocked=blocked))
    log.info("linear auto: probed plain, packed%s in %.2f s", ", kernel" * kernel + ", blocked" * blocked,
             time.perf_counter() - t0)
    kept = {"key": key, "packed": sorted(choice.groups or ()), "kernel": sorted(choice.kernel),
            "blocked": sorted(choice.blocked), "reason": choice.reason}
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # one per process: workers starting side by side
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(kept, indent=1))
        os.replace(tmp, path)  # atomic: no start reads half a file
    except OSError as e:
        tmp.unlink(missing_ok=True)
        log.warning("linear auto: could not keep the choice in %s (%s); the next start measures again", path, e)
    return choice
