"""CPU kernels: one C source, compiled with the system C compiler into one build per instruction set
(`engine.hardware.KERNEL_BUILDS`: AMX + AVX-512 BF16, AVX-512 BF16, AVX2 + FMA, portable C), loaded
with ctypes.

The process uses `active()`: the best build this CPU runs (or the one `PDSERVE_KERNEL` forces),
checked once against the torch reference before any request. A build that does not compile or
load, or that gets the check wrong, is logged and the next one is tried; with none left (no C
compiler, or `PDSERVE_KERNEL=torch`), callers use torch ops. Builds are cached per source, flags
and instruction set, so a cache shared between machines never hands one a build it cannot run.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine import hardware
from engine.hardware import KernelBuild

log = logging.getLogger(__name__)
_SRC = Path(__file__).with_name("cpu_kernels.c")
_BASE_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-fno-math-errno", "-ffp-contract=fast",
               "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math")
MAX_GROUP = 64  # query heads per kv head the portable kernel's stack arrays hold
# Entry points by dtype, in the order `pdserve_bind` takes them (fp32, then bf16).
_ENTRY = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16"}
_LINEAR_ENTRY = {torch.float32: "pdserve_linear_f32", torch.bfloat16: "pdserve_linear_bf16"}
# Greedy picks (`Kernel.argmax`): the builds with AVX2 or AVX-512, both dtypes.
_ARGMAX_ENTRY = {torch.float32: "pdserve_argmax_f32", torch.bfloat16: "pdserve_argmax_bf16"}
# Linear layers on blocked weights: fp32 in the builds with AVX2 + FMA, bf16 in those with AVX-512 BF16.
_BLOCKED_ENTRY = {torch.float32: "pdserve_linear_f32_blocked", torch.bfloat16: "pdserve_linear_bf16_blocked"}
# A blocked weight's block: output columns, and elements of K per row of the block (one vector of the
# kernel: 16 bf16 pairs for a pair dot product; fp32, one lane per column for an FMA: 16 columns in the builds
# with AVX-512, 8 in the AVX2 build, as the build says (`Kernel.block_shape`)). The C++ operator is told the same.
_BF16_BLOCK = (16, 2)
# The pointwise kernels of an eager step's decoder layers (RMSNorm; a gated MLP's SiLU(gate) * up): both dtypes in
# the builds with AVX2 or AVX-512 (`engine.fused_layers`).
_NORM_ENTRY = {torch.float32: "pdserve_rms_norm_f32", torch.bfloat16: "pdserve_rms_norm_bf16"}
_SILU_MUL_ENTRY = {torch.float32: "pdserve_silu_mul_f32", torch.bfloat16: "pdserve_silu_mul_bf16"}
# Prefill attention, by dtype: bf16 in the builds with AVX-512 BF16 (AMX tiles in amx_bf16), fp32 in those with
# AVX2 + FMA (16 lanes wide with AVX-512); and whether each takes whole prompts too (the build says:
# `pdserve_prefill_attn_*whole`).
_PREFILL_ENTRY = {torch.bfloat16: "pdserve_prefill_attn_bf16", torch.float32: "pdserve_prefill_attn_f32"}
_PREFILL_WHOLE = {torch.bfloat16: "pdserve_prefill_attn_whole", torch.float32: "pdserve_prefill_attn_f32_whole"}
PREFILL_HEAD_DIMS, PREFILL_BLOCK_MULTIPLE = (64, 128), 16


def source_tag() -> str:
    """A short hash of the kernels' C source: which kernels a measurement kept on disk timed."""
    return hashlib.sha256(_SRC.read_bytes()).hexdigest()[:16]


class KernelError(RuntimeError):
    """A kernel build did not compile, load or pass its check."""


@dataclass(frozen=True)
class Kernel:
    """A loaded build: `name` is its instruction set (a KERNEL_BUILDS name)."""

    name: str
    lib: ctypes.CDLL

    def paged_decode(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, slots: torch.Tensor,
                     k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor, ctx: torch.Tensor,
                     scale: float) -> torch.Tensor:
        """One layer of a decode step over the paged pool: store the new K/V, then attend.

        Args:
            q: [B, H, D] queries.
            k_new, v_new: [KVH, B, D] this step's keys and values, written at `slots` [B] int64.
            k_pool, v_pool: [KVH, blocks, block_size, D] one layer's cache, contiguous (written in place).
            tables: [B, max_blocks] int64 block tables; ctx: [B] int64 context lengths (new token included).
            scale: softmax scale.
        Returns:
            [B, H, D] attention output in q's dtype.
        """
        assert k_pool.is_contiguous() and v_pool.is_contiguous()
        q, k_new, v_new = q.contiguous(), k_new.contiguous(), v_new.contiguous()
        slots, tables, ctx = (t.to(torch.int64).contiguous() for t in (slots, tables, ctx))
        b, h, d = q.shape
        kvh, nb, bs, _ = k_pool.shape
        out = torch.empty_like(q)
        p = ctypes.c_void_p
        getattr(self.lib, _ENTRY[q.dtype])(
            p(q.data_ptr()), p(k_new.data_ptr()), p(v_new.data_ptr()), p(slots.data_ptr()), p(k_pool.data_ptr()),
            p(v_pool.data_ptr()), p(tables.data_ptr()), p(ctx.data_ptr()), p(out.data_ptr()), b, h, kvh, d, nb, bs,
            tables.shape[1], ctypes.c_float(scale), torch.get_num_threads())
        return out

    def has_prefill(self, dtype: torch.dtype) -> bool:
        """Whether this build holds the prefill attention kernel for `dtype` (bf16: the builds with AVX-512
        BF16, on AMX tiles in the amx_bf16 build where the OS gives them; fp32: the builds with AVX2 + FMA)."""
        return dtype in _PREFILL_ENTRY and hasattr(self.lib, _PREFILL_ENTRY[dtype])

    def prefill_whole(self, dtype: torch.dtype) -> bool:
        """Whether `dtype` prompts with no cached context (first chunks) go to the prefill kernel too: where
        it beats torch's causal flash attention, as the build says (`pdserve_prefill_attn_*whole`)."""
        return self.has_prefill(dtype) and bool(getattr(self.lib, _PREFILL_WHOLE[dtype])())

    def prefill_attention(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                          start: int, scale: float) -> torch.Tensor | None:
        """One layer's attention for a prompt chunk over the paged pool: each query at positions
        [start, start + n) over the keys up to its own position, read in place (no gather).

        Args:
            q: [H, n, D] bf16 or fp32 queries (D one of `PREFILL_HEAD_DIMS`, contiguous in D), the pools' dtype.
            k_pool, v_pool: [KVH, blocks, block_size, D] one layer's cache, the chunk's own K/V already
                written (AMX tiles take block sizes that are multiples of `PREFILL_BLOCK_MULTIPLE`, the
                dot products any).
            table: [>= ceil((start + n) / block_size)] int64 block ids of the sequence.
            start: the chunk's first position (its cached context). scale: softmax scale.
        Returns:
            [H, n, D] in q's dtype (a view), or None where the kernel declined (an unsupported shape): the
            caller computes it another way.
        """
        if q.stride(-1) != 1:
            q = q.contiguous()
        h, n, d = q.shape
        kvh, _, bs, _ = k_pool.shape
        assert k_pool.stride()[1:] == v_pool.stride()[1:] == (bs * d, d, 1) and k_pool.stride(0) == v_pool.stride(0)
        table = table.to(torch.int64).contiguous()
        out = torch.empty(n, h, d, dtype=q.dtype)
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        rc = getattr(self.lib, _PREFILL_ENTRY[q.dtype])(
            p(q.data_ptr()), i64(q.stride(1)), i64(q.stride(0)), p(k_pool.data_ptr()), p(v_pool.data_ptr()),
            i64(k_pool.stride(0)), bs, p(table.data_ptr()), start, n, h, kvh, d, ctypes.c_float(scale),
            p(out.data_ptr()), i64(h * d), torch.get_num_threads())
        return out.transpose(0, 1) if rc == 0 else None

    def has_argmax(self, dtype: torch.dtype) -> bool:
        """Whether this build picks greedy tokens of `dtype` (`argmax`: the builds with AVX2 or AVX-512)."""
        return dtype in _ARGMAX_ENTRY and hasattr(self.lib, _ARGMAX_ENTRY[dtype])

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """The index of each row's first maximum, as `x.max(dim=-1).indices` gives it (a NaN, the first, wins):
        greedy decoding's pick, at vector speed where torch's reduction with indices is not (32 rows of 49,152
        logits: 0.1 ms here, 0.8-0.9 ms in torch, on a 2-core AVX-512 EPYC, bf16 and fp32).

        Args:
            x: [B, V] fp32 or bf16, unit stride along V (made so where it is not).
        Returns:
            [B] int64.
        """
        if x.stride(-1) != 1:
            x = x.contiguous()
        out = torch.empty(x.shape[0], dtype=torch.int64)
        i64 = ctypes.c_int64
        getattr(self.lib, _ARGMAX_ENTRY[x.dtype])(ctypes.c_void_p(x.data_ptr()), i64(x.shape[0]), i64(x.shape[1]),
                                                  i64(x.stride(0)), ctypes.c_void_p(out.data_ptr()))
        return out

    def has_linear(self, dtype: torch.dtype) -> bool:
        """Whether this build holds the small-batch linear kernel for `dtype` (fp32: builds with AVX2 +
        FMA; bf16: builds with AVX-512 BF16, on AMX tiles in the amx_bf16 build)."""
        return dtype in _LINEAR_ENTRY and hasattr(self.lib, _LINEAR_ENTRY[dtype])

    def linear_max_rows(self, dtype: torch.dtype) -> int:
        """Most rows this build's linear kernel computes in `dtype` (more: torch's linear); the build says,
        by what it was measured to win (`pdserve_linear_*_max_rows` in the C source). 0 where the build
        holds no linear kernel for `dtype` (the AVX2 build has no bf16 one, the portable build none)."""
        if not self.has_linear(dtype):
            return 0
        return getattr(self.lib, _LINEAR_ENTRY[dtype] + "_max_rows")()

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`x @ weight.T (+ bias)` for the few rows of a decode step, in x's dtype, fp32 accumulation
        (more than `linear_max_rows` rows: torch's linear).

        Args:
            x: [M, K]; weight: [N, K]; bias: [N] or None, all one dtype (made contiguous where they are not).
        Returns:
            [M, N].
        """
        if x.shape[0] > self.linear_max_rows(x.dtype):
            return torch.nn.functional.linear(x, weight, bias)
        x, weight = x.contiguous(), weight.contiguous()
        bias = None if bias is None else bias.contiguous()
        (m, k), n = x.shape, weight.shape[0]
        out = torch.empty(m, n, dtype=x.dtype)
        p = ctypes.c_void_p
        getattr(self.lib, _LINEAR_ENTRY[x.dtype])(p(x.data_ptr()), p(weight.data_ptr()),
                                                  None if bias is None else p(bias.data_ptr()), p(out.data_ptr()),
                                                  m, n, k, torch.get_num_threads())
        return out

    def block_shape(self, dtype: torch.dtype) -> tuple[int, int]:
        """The block of this build's blocked weights of `dtype`: (output columns, elements of K per row)."""
        if dtype == torch.float32:
            return self.lib.pdserve_linear_f32_block_cols(), 1
        return _BF16_BLOCK

    def block_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """`weight` laid out for this build's blocked kernel (`block_weight` with its `block_shape`)."""
        return block_weight(weight, self.block_shape(weight.dtype))

    def has_blocked(self, dtype: torch.dtype) -> bool:
        """Whether this build computes linear layers of `dtype` on a blocked weight (`block_weight`;
        fp32: the builds with AVX2 + FMA; bf16: those with AVX-512 BF16)."""
        return dtype in _BLOCKED_ENTRY and hasattr(self.lib, _BLOCKED_ENTRY[dtype])

    def blocked_linear(self, x: torch.Tensor, blocked: torch.Tensor, bias: torch.Tensor | None,
                       out_features: int) -> torch.Tensor:
        """`x @ weight.T (+ bias)` for any number of rows, from the weight's blocked copy, in x's dtype with
        fp32 accumulation.

        Args:
            x: [M, K]; blocked: `self.block_weight(weight)` of a weight [out_features, K]; bias:
                [out_features] or None; one dtype.
        Returns:
            [M, out_features].
        """
        if blocked.dtype != x.dtype or not self.has_blocked(x.dtype):
            raise ValueError(f"no {x.dtype} blocked linear kernel for a {blocked.dtype} blocked weight in the "
                             f"{self.name} build")
        check_blocked(blocked, out_features, x.shape[-1], self.block_shape(x.dtype))
        x = x.contiguous()
        bias = None if bias is None else bias.contiguous()
        out = torch.empty(x.shape[0], out_features, dtype=x.dtype)
        p = ctypes.c_void_p
        getattr(self.lib, _BLOCKED_ENTRY[x.dtype])(p(x.data_ptr()), p(blocked.data_ptr()),
                                                   None if bias is None else p(bias.data_ptr()), p(out.data_ptr()),
                                                   x.shape[0], out_features, x.shape[1], torch.get_num_threads())
        return out

    def has_pointwise(self, dtype: torch.dtype) -> bool:
        """Whether this build holds the pointwise kernels (RMSNorm, SiLU * up) for `dtype` (the builds with AVX2 or
        AVX-512, fp32 and bf16)."""
        return all(dtype in e and hasattr(self.lib, e[dtype]) for e in (_NORM_ENTRY, _SILU_MUL_ENTRY))

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """transformers' RMSNorm of each row of x [..., K] with weight [K] (one dtype), in one pass (the torch
        operator `pdserve_cpu::rms_norm` calls the same kernel)."""
        x, weight = x.contiguous(), weight.contiguous()
        out = torch.empty_like(x)
        getattr(self.lib, _NORM_ENTRY[x.dtype])(
            ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(weight.data_ptr()), ctypes.c_void_p(out.data_ptr()),
            ctypes.c_int64(x.numel() // x.shape[-1]), ctypes.c_int64(x.shape[-1]), ctypes.c_float(eps),
            torch.get_num_threads())
        return out

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) * up (one shape and dtype), in one pass (as the torch operator `pdserve_cpu::silu_mul`)."""
        gate, up = gate.contiguous(), up.contiguous()
        out = torch.empty_like(gate)
        getattr(self.lib, _SILU_MUL_ENTRY[gate.dtype])(
            ctypes.c_void_p(gate.data_ptr()), ctypes.c_void_p(up.data_ptr()), ctypes.c_void_p(out.data_ptr()),
            ctypes.c_int64(gate.numel()), torch.get_num_threads())
        return out


def block_weight(weight: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """A linear weight [N, K] laid out for a blocked kernel: [ceil(N / C), ceil(K / P), C, P] with (C, P) =
    `shape`, the build's `Kernel.block_shape` (bf16: 16 output columns by pairs of K, the operand order of a
    bf16 pair dot product; fp32: 16 or 8 columns by single elements), block b holding output columns
    bC..bC+C-1; zeros past N and K. A new tensor; the weight is not kept."""
    cols, per_row = shape
    n, k = weight.shape
    padded = torch.nn.functional.pad(weight.detach(), (0, -k % per_row, 0, -n % cols))
    return padded.view(-1, cols, -(-k // per_row), per_row).transpose(1, 2).contiguous()


def check_blocked(blocked: torch.Tensor, out_features: int, in_features: int, shape: tuple[int, int]) -> None:
    """Raise ValueError where `blocked` is not `block_weight(weight, shape)` of an [out_features, in_features]
    weight."""
    if blocked.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"a blocked weight is float32 or bfloat16, got {blocked.dtype}")
    cols, per_row = shape
    want = (-(-out_features // cols), -(-in_features // per_row), cols, per_row)
    if tuple(blocked.shape) != want or not blocked.is_contiguous():
        raise ValueError(f"a {blocked.dtype} blocked weight of {out_features}x{in_features} is a contiguous "
                         f"{list(want)}, got {list(blocked.shape)}")


def _compile(compiler: list[str], src: Path, flags: list[str], libs: list[str], name: str) -> Path:
    """`src` compiled into a shared library in the cache, once per source and flags."""
    from engine.model_store import cache_root

    tag = hashlib.sha256(src.read_bytes() + " ".join(compiler + flags + libs).encode()).hexdigest()[:16]
    out = cache_root() / "kernels" / f"{name}-{tag}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    log.info("building kernel %s with %s (once; cached in %s) ...", name, Path(compiler[0]).name, out.parent)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        try:
            subprocess.run([*compiler, *flags, str(src), "-o", str(tmp_out), *libs], check=True, capture_output=True,
                           text=True, timeout=300)
        except subprocess.CalledProcessError as e:
            raise KernelError(f"{compiler[0]} failed: {e.stderr.strip()[-2000:]}") from e
        except (OSError, subprocess.SubprocessError) as e:
            raise KernelError(f"{compiler[0]} failed: {e}") from e
        os.replace(tmp_out, out)  # atomic: a half-written library is never loaded
    log.info("built kernel %s in %.1f s", name, time.monotonic() - t0)
    return out


def _compiler(env: str, *names: str) -> list[str]:
    cc = os.environ.get(env) or next((shutil.which(n) for n in names if shutil.which(n)), None)
    if cc is None:
        raise KernelError(f"no {' / '.join(names)} on PATH (or ${env})")
    return [cc]


def _build(build: KernelBuild) -> Path:
    return _compile(_compiler("CC", "gcc", "cc"), _SRC, [*_BASE_FLAGS, *build.cflags], ["-lm"],
                    f"cpu_kernels-{build.name}")


def _self_check(kernel: Kernel) -> None:
    """The build against the torch reference on a small ragged GQA batch, in both dtypes."""
    from engine.attention import reference_decode

    g = torch.Generator().manual_seed(0)
    kvh, heads, d, bs, blocks = 2, 6, 64, 16, 12
    ctx = torch.tensor([1, 21, 40])
    tables = torch.randperm(blocks, generator=g)[:9].view(3, 3)
    last = ctx - 1
    slots = tables[torch.arange(3), last // bs] * bs + last % bs
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        k_pool, v_pool = (torch.randn(kvh, blocks, bs, d, generator=g).to(dtype) for _ in range(2))
        q = torch.randn(3, heads, d, generator=g).to(dtype)
        k_new, v_new = (torch.randn(kvh, 3, d, generator=g).to(dtype) for _ in range(2))
        out = kernel.paged_decode(q, k_new, v_new, slots, k_pool, v_pool, tables, ctx, d ** -0.5)
        want = reference_decode(q, k_pool, v_pool, tables, ctx, d ** -0.5)
        err = float((out.float() - want).abs().max())
        if not err <= tol:
            raise KernelError(f"differs from the reference attention in {dtype} (max error {err:.3g})")
    _check_argmax(kernel, g)
    for dtype in _PREFILL_ENTRY:  # prefill attention: partial tiles of rows and keys, a chunk starting mid-block
        if kernel.has_prefill(dtype):
            _check_prefill(kernel, g, dtype)
    # The linear kernel: every tile height, a tail of w's rows and of K, with and without bias; bf16 also
    # on AMX tiles (K a multiple of 32, rows of w past the last 32, two blocks of 16 rows of x and a part).
    for dtype, (n, k), rows, tol in ((torch.float32, (13, 20), range(1, 8), 1e-4),
                                     (torch.bfloat16, (13, 40), range(1, 8), 2e-2),
                                     (torch.bfloat16, (70, 64), (5, 16, 23, 40), 2e-2)):
        if not kernel.has_linear(dtype):
            continue
        w, bias = torch.randn(n, k, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
        for m in rows:
            x = torch.randn(m, k, generator=g).to(dtype)
            for b in (None, bias):
                want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
                err = float((kernel.linear(x, w, b).float() - want).abs().max() / want.abs().max())
                if not err <= tol:
                    raise KernelError(f"its {dtype} linear kernel differs from torch's (relative error {err:.3g})")
    # The blocked linear kernel: every tile height and more than one pass of rows, a part block of columns,
    # odd K, with and without bias, and on more threads than blocks.
    for dtype, (n, k), rows, tol in ((torch.float32, (13, 41), (1, 4, 5), 1e-4),
                                     (torch.float32, (70, 64), (3, 9, 70), 1e-4),
                                     (torch.bfloat16, (13, 41), (1, 6, 7), 2e-2),
                                     (torch.bfloat16, (70, 64), (5, 12, 70), 2e-2)):
        if not kernel.has_blocked(dtype):
            continue
        w, bias = torch.randn(n, k, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
        blocked = kernel.block_weight(w)
        for m in rows:
            x = torch.randn(m, k, generator=g).to(dtype)
            for b in (None, bias):
                want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
                err = float((kernel.blocked_linear(x, blocked, b, n).float() - want).abs().max() / want.abs().max())
                if not err <= tol:
                    raise KernelError(f"its {dtype} blocked linear kernel differs from torch's (relative error "
                                      f"{err:.3g})")
    for dtype in _NORM_ENTRY:
        if kernel.has_pointwise(dtype):
            _check_pointwise(kernel, g, dtype)


def _check_pointwise(kernel: Kernel, g: torch.Generator, dtype: torch.dtype) -> None:
    """RMSNorm over rows shorter than a vector, with and without a tail, and SiLU * up over more than one thread's
    chunk of elements with a tail, against torch's operators."""
    from engine.fused_layers import reference_rms_norm

    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for rows, cols in ((1, 5), (3, 37), (2, 576)):
        x, w = torch.randn(rows, cols, generator=g).to(dtype), torch.randn(cols, generator=g).to(dtype)
        want = reference_rms_norm(x, w, 1e-6).float()
        err = float((kernel.rms_norm(x, w, 1e-6).float() - want).abs().max() / want.abs().max())
        if not err <= tol:
            raise KernelError(f"its {dtype} RMSNorm kernel differs from torch's (relative error {err:.3g})")
    gate, up = (torch.randn(2, 4099, generator=g).mul(6).to(dtype) for _ in range(2))
    want = torch.nn.functional.silu(gate.float()).to(dtype).float() * up.float()
    err = float((kernel.silu_mul(gate, up).float() - want).abs().max() / want.abs().max())
    if not err <= tol:
        raise KernelError(f"its {dtype} SiLU * up kernel differs from torch's (relative error {err:.3g})")


def _check_argmax(kernel: Kernel, g: torch.Generator) -> None:
    """`Kernel.argmax` against torch's: ties (the first wins), a maximum in a row's tail past the last whole vector,
    NaN (the first wins), a row of -inf, and rows a stride apart."""
    for dtype in filter(kernel.has_argmax, _ARGMAX_ENTRY):
        x = torch.randn(6, 203, generator=g).to(dtype)
        x[0, 7] = x[0, 150] = x[0].max() + 1  # a tie: 7
        x[1, 201] = x[1].max() + 1  # in the tail
        x[2, 40] = x[2, 90] = float("nan")  # the first NaN: 40
        x[3] = float("-inf")
        for rows in (x, x[:, :200], x[1:, 3:]):  # whole rows, rows a stride apart, neither aligned
            want, got = rows.max(dim=-1).indices, kernel.argmax(rows)
            if not torch.equal(got, want):
                raise KernelError(f"its {dtype} argmax picks {got.tolist()} where torch picks {want.tolist()}")


def _check_prefill(kernel: Kernel, g: torch.Generator, dtype: torch.dtype) -> None:
    from engine.attention import reference_prefill

    kvh, heads, bs, blocks = 2, 6, PREFILL_BLOCK_MULTIPLE, 12
    tables = torch.randperm(blocks, generator=g)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    for d, start, n in [(d, start, n) for d in PREFILL_HEAD_DIMS for start, n in ((0, 1), (0, 37), (21, 40), (70, 3))]:
        k_pool, v_pool = (torch.randn(kvh, blocks, bs, d, generator=g).to(dtype) for _ in range(2))
        q = torch.randn(heads, n, d, generator=g).to(dtype)
        out = kernel.prefill_attention(q, k_pool, v_pool, tables, start, d ** -0.5)
        if out is None:
            raise KernelError(f"its prefill attention declined a shape it takes (head dim {d})")
        want = reference_prefill(q, k_pool, v_pool, tables, start, d ** -0.5)
        err = float((out.float() - want).abs().max())
        if not err <= tol:
            raise KernelError(f"its {dtype} prefill attention differs from the reference (max error {err:.3g})")


_loaded: dict[str, Kernel] = {}


def load(build: KernelBuild) -> Kernel:
    """Compile (once, cached on disk), load and check one build.

    Raises:
        KernelError: it does not compile, load, report its instruction set, or match the reference.
    """
    if build.name not in _loaded:
        try:
            lib = ctypes.CDLL(str(_build(build)))
        except OSError as e:
            raise KernelError(f"could not load the {build.name} build: {e}") from e
        lib.pdserve_kernel_isa.restype = ctypes.c_char_p
        isa = lib.pdserve_kernel_isa().decode()
        if isa != build.name:
            raise KernelError(f"the {build.name} build compiled without its vector path (it holds {isa!r})")
        kernel = Kernel(build.name, lib)
        _self_check(kernel)
        _loaded[build.name] = kernel
    return _loaded[build.name]


# -- the kernel as a torch operator ---------------------------------------------------------------------
_OP_SRC = Path(__file__).with_name("torch_op.cpp")


def _build_op() -> Path:
    from torch.utils.cpp_extension import include_paths, library_paths

    abi = int(torch.compiled_with_cxx11_abi())
    flags = ["-O2", "-shared", "-fPIC", "-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-w",
             *(f"-I{p}" for p in include_paths())]
    libs = [*(f"-L{p}" for p in library_paths()), "-lc10", "-ltorch_cpu"]
    return _compile(_compiler("CXX", "g++", "c++"), _OP_SRC, [*flags, f"-DPDSERVE_TORCH={torch.__version__}"], libs,
                    "paged_decode_op")


def _fake_decode(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, slots: torch.Tensor,
                 kv_layer: torch.Tensor, tables: torch.Tensor, ctx: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _fake_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _fake_blocked_linear(x: torch.Tensor, blocked: torch.Tensor, bias: torch.Tensor | None,
                         out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def _fake_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _fake_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


def _load_ops() -> Path:
    """Build (once, ~15 s, cached on disk) and load the operator library (loading it again is a no-op).
    Raises KernelError, OSError or RuntimeError where it does not build or load."""
    path = _build_op()
    torch.ops.load_library(str(path))
    return path


def _torch_op(kernel: Kernel) -> tuple[object | None, str]:
    """`torch.ops.pdserve_cpu.paged_decode` bound to `kernel`, or None and why not (the ctypes path
    then serves, a little slower per call). `torch.ops.pdserve_cpu.linear`, `blocked_linear`, `rms_norm` and
    `silu_mul` come with it where the build holds those kernels."""
    try:
        path = _load_ops()
        entry = [ctypes.cast(getattr(kernel.lib, _ENTRY[t]), ctypes.c_void_p) for t in _ENTRY]
        linear = [ctypes.cast(getattr(kernel.lib, _LINEAR_ENTRY[t]), ctypes.c_void_p) if kernel.has_linear(t) else None
                  for t in _LINEAR_ENTRY]
        rows = [ctypes.c_int64(kernel.linear_max_rows(t)) for t in _LINEAR_ENTRY]
        blocked = [ctypes.cast(getattr(kernel.lib, _BLOCKED_ENTRY[t]), ctypes.c_void_p) if kernel.has_blocked(t)
                   else None for t in _LINEAR_ENTRY]
        f32_cols = ctypes.c_int64(kernel.block_shape(torch.float32)[0] if kernel.has_blocked(torch.float32) else 0)
        pointwise = [ctypes.cast(getattr(kernel.lib, names[t]), ctypes.c_void_p) if kernel.has_pointwise(t) else None
                     for names in (_NORM_ENTRY, _SILU_MUL_ENTRY) for t in names]
        ctypes.CDLL(str(path)).pdserve_bind(*entry, *linear, *rows, *blocked, f32_cols, *pointwise)
        torch.library.register_fake("pdserve_cpu::paged_decode")(_fake_decode)
        torch.library.register_fake("pdserve_cpu::linear")(_fake_linear)
        torch.library.register_fake("pdserve_cpu::blocked_linear")(_fake_blocked_linear)
        torch.library.register_fake("pdserve_cpu::rms_norm")(_fake_rms_norm)
        torch.library.register_fake("pdserve_cpu::silu_mul")(_fake_silu_mul)
    except (KernelError, OSError, RuntimeError) as e:
        return None, f"ctypes calls: the torch operator did not build ({e})"
    return torch.ops.pdserve_cpu.paged_decode.default, "a torch operator"


@functools.cache
def packed_op() -> object | None:
    """`torch.ops.pdserve_cpu.packed_linear` (with `hold_packed` / `drop_packed` for its weights), or
    None where the operator library does not build (callers then use a Python op). Needs no kernel
    build: oneDNN computes it."""
    try:
        _load_ops()
        torch.library.register_fake("pdserve_cpu::packed_linear")(_fake_packed_linear)
    except (KernelError, OSError, RuntimeError) as e:
        log.warning("packed linear layers: the C++ operator did not build (%s); a Python operator serves", e)
        return None
    return torch.ops.pdserve_cpu.packed_linear.default


def _fake_packed_linear(x: torch.Tensor, handle: torch.Tensor, bias: torch.Tensor | None,
                        out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


@dataclass(frozen=True)
class Selection:
    """The kernel this process uses (None: torch ops) and the reason, for logs and reports; `op` is
    its torch operator (None: the Python op over ctypes) and `calls` says which."""

    kernel: Kernel | None
    reason: str
    op: object | None = None
    calls: str = ""

    def linear_op(self, dtype: torch.dtype) -> object | None:
        """The linear kernel's torch operator (None: not built, or the build holds no linear kernel for `dtype`)."""
        if self.op is None or self.kernel is None or not self.kernel.has_linear(dtype):
            return None
        return torch.ops.pdserve_cpu.linear.default

    def blocked_op(self, dtype: torch.dtype) -> object | None:
        """The blocked linear kernel's torch operator (None: not built, or none for `dtype` in the build)."""
        if self.op is None or self.kernel is None or not self.kernel.has_blocked(dtype):
            return None
        return torch.ops.pdserve_cpu.blocked_linear.default

    def pointwise_ops(self, dtype: torch.dtype) -> tuple[object, object] | None:
        """The torch operators `rms_norm` and `silu_mul` (None: not built, or none for `dtype` in the build)."""
        if self.op is None or self.kernel is None or not self.kernel.has_pointwise(dtype):
            return None
        return torch.ops.pdserve_cpu.rms_norm.default, torch.ops.pdserve_cpu.silu_mul.default

    @property
    def name(self) -> str:
        return self.kernel.name if self.kernel is not None else hardware.TORCH_KERNEL


_active: Selection | None = None


def select(cpu: hardware.CpuInfo, forced: str | None) -> Selection:
    """Load the chosen build; on failure, log it and fall back down the list of builds this CPU runs.

    Raises:
        ValueError: `forced` names no build, or one this CPU cannot run.
    """
    choice = hardware.choose_kernel(cpu, forced)
    if choice.build is None:
        return Selection(None, choice.reason)
    failures: list[str] = []
    for build in [choice.build] if forced else hardware.runnable(cpu):
        try:
            kernel = load(build)
        except KernelError as e:
            failures.append(f"the {build.name} build failed: {e}")
            log.warning("paged attention kernel: %s", failures[-1])
            continue
        return Selection(kernel, choice.reason if not failures else "fallback; " + "; ".join(failures))
    return Selection(None, "no kernel build works here, torch ops instead; " + "; ".join(failures))


def active() -> Selection:
    """This process's kernel, chosen and logged once."""
    global _active
    if _active is None:
        cpu = hardware.this_cpu()
        sel = select(cpu, hardware.forced_kernel())
        if sel.kernel is not None:
            op, calls = _torch_op(sel.kernel)
            sel = Selection(sel.kernel, sel.reason, op, calls)
        _active = sel
        log.info("paged attention kernel: %s (%s; CPU %s: %s)%s", sel.name, sel.reason, cpu.model,
                 cpu.isa_summary(), f", called as {sel.calls}" if sel.calls else "")
    return _active


def supports(dtype: torch.dtype, device: torch.device, group: int) -> bool:
    """Whether decode attention for this dtype, device and GQA group runs on this process's kernel."""
    return device.type == "cpu" and dtype in _ENTRY and group <= MAX_GROUP and active().kernel is not None


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum (`Kernel.argmax`) on this process's kernel; torch's `max` where that has none,
    or the logits [B, V] are not an fp32 / bf16 matrix in CPU memory."""
    kernel = active().kernel if logits.device.type == "cpu" else None
    if kernel is None or logits.dim() != 2 or not kernel.has_argmax(logits.dtype):
        return logits.max(dim=-1).indices
    return kernel.argmax(logits)


def supports_prefill(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
    """Whether prompt chunks over a cached context run on this process's prefill attention kernel (any block
    size: the AMX tiles take multiples of `PREFILL_BLOCK_MULTIPLE`, dot products the rest)."""
    kernel = active().kernel if device.type == "cpu" else None
    return kernel is not None and kernel.has_prefill(dtype) and head_dim in PREFILL_HEAD_DIMS


def prefill_whole(dtype: torch.dtype) -> bool:
    """Whether `dtype` prompts with no cached context run on this process's prefill kernel too
    (`Kernel.prefill_whole`)."""
    kernel = active().kernel
    return kernel is not None and kernel.prefill_whole(dtype)


def prefill_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                      start: int, scale: float) -> torch.Tensor | None:
    """`Kernel.prefill_attention` on this process's kernel (`supports_prefill` said yes)."""
    kernel = active().kernel
    assert kernel is not None
    return kernel.prefill_attention(q, k_pool, v_pool, table, start, scale)


def paged_decode(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, slots: torch.Tensor,
                 k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor, ctx: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """`Kernel.paged_decode` on this process's kernel (`supports` said yes)."""
    kernel = active().kernel
    assert kernel is not None
    return kernel.paged_decode(q, k_new, v_new, slots, k_pool, v_pool, tables, ctx, scale)
