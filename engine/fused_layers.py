"""Fused pointwise layers for the eager steps: RMSNorm and a gated MLP's SiLU(gate) * up in one kernel pass each.

A request's prompt runs in eager steps (its chunks, alone or next to decoding sequences); its decode steps run
in the compiled graph where the engine compiles one. In an eager step every decoder layer runs transformers'
modules operator by operator: an RMSNorm is six of them (a square, a mean, an add, a reciprocal square root, two
products) and in bf16 two copies (to fp32 and back), a gated MLP's activation two. `fuse` swaps each such module of
a known architecture for one that calls pdserve's CPU kernel (`torch.ops.pdserve_cpu.rms_norm` / `silu_mul`,
one pass over the rows): a prompt's steps take 5-10% less time on a 2-core AVX-512 BF16 EPYC (BENCHMARKS.md). Inside a
compiled graph the swapped modules compute transformers' own formula, which inductor fuses with its neighbours.

Boundary: never imports Ray; the kernels come from `engine.kernels` (the builds with AVX2 or AVX-512; elsewhere
nothing is swapped).
"""
from __future__ import annotations

import functools
import importlib
import logging

import torch
from torch import nn
from transformers.activations import SiLUActivation

from engine import kernels

log = logging.getLogger(__name__)

# The architectures whose RMSNorm is `weight * (x.float() * rsqrt(mean(x^2) + eps)).to(x.dtype)` and whose MLP is
# `down(act(gate(x)) * up(x))`: transformers' module of each, and its norm and MLP classes.
_ARCHITECTURES = {"llama": ("LlamaRMSNorm", "LlamaMLP"), "mistral": ("MistralRMSNorm", "MistralMLP"),
                  "qwen2": ("Qwen2RMSNorm", "Qwen2MLP"), "qwen3": ("Qwen3RMSNorm", "Qwen3MLP")}


@functools.cache
def _classes() -> tuple[tuple[type, ...], tuple[type, ...]]:
    """transformers' norm classes and MLP classes of `_ARCHITECTURES`."""
    norms, mlps = [], []
    for arch, (norm, mlp) in _ARCHITECTURES.items():
        module = importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")
        norms.append(getattr(module, norm))
        mlps.append(getattr(module, mlp))
    return tuple(norms), tuple(mlps)


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm, operator by operator (what a compiled graph traces)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class FusedRMSNorm(nn.Module):
    """An RMSNorm (same weight and epsilon) computed by one kernel call in eager steps."""

    def __init__(self, norm: nn.Module, op: object) -> None:
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = norm.variance_epsilon
        self._op = op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() or not _on_kernel(self.weight.dtype, x):
            return reference_rms_norm(x, self.weight, self.variance_epsilon)
        return self._op(x, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class FusedGatedMLP(nn.Module):
    """A gated SiLU MLP (the same three projections) whose SiLU(gate) * up is one kernel call in eager steps."""

    def __init__(self, mlp: nn.Module, op: object, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self._op = op
        self._dtype = dtype  # the dtype the kernel was chosen for

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if torch.compiler.is_compiling() or not _on_kernel(self._dtype, gate, up):
            return self.down_proj(nn.functional.silu(gate) * up)
        return self.down_proj(self._op(gate, up))


def _on_kernel(dtype: torch.dtype, *xs: torch.Tensor) -> bool:
    """Whether the kernel takes `xs`: on the CPU, in the dtype it was chosen for (else transformers' formula)."""
    return all(x.dtype == dtype and x.device.type == "cpu" for x in xs)


def fuse(model: nn.Module) -> int:
    """Swap the RMSNorms and gated SiLU MLPs of `model` (on the CPU, fp32 or bf16, a known architecture: its
    classes exactly, not a subclass that may compute otherwise) for fused ones, in place, where the kernel build
    holds them. Returns how many modules are fused, those a previous call swapped included (0: none, the model
    runs as transformers wrote it)."""
    param = next(model.parameters())
    ops = kernels.active().pointwise_ops(param.dtype) if param.device.type == "cpu" else None
    if ops is None:
        return 0
    norm_op, silu_mul_op = ops
    norms, mlps = _classes()
    fused = swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, (FusedRMSNorm, FusedGatedMLP)):
                fused += 1
            elif type(child) in norms and child.weight.dim() == 1 and child.weight.dtype == param.dtype:
                setattr(parent, name, FusedRMSNorm(child, norm_op))
                swapped += 1
            elif type(child) in mlps and type(child.act_fn) in (SiLUActivation, nn.SiLU):
                setattr(parent, name, FusedGatedMLP(child, silu_mul_op, param.dtype))
                swapped += 1
    if swapped:
        log.info("RMSNorm and SiLU * up of eager steps on pdserve's kernel (%d modules)", swapped)
    return fused + swapped
