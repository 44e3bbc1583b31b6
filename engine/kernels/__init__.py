"""CPU kernels compiled once with the system C compiler and loaded with ctypes.

`paged_decode` runs decode attention in place over the paged KV pool. When no compiler
is available (or PDSERVE_NO_KERNELS=1) `load()` returns None and callers use torch ops.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)
_SRC = Path(__file__).with_name("paged_attention.c")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-fno-math-errno", "-ffp-contract=fast",
          "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]
MAX_GROUP = 64  # query heads per kv head the kernel's stack arrays hold
_lib: ctypes.CDLL | None | bool = False  # False: not tried yet


def _build() -> Path:
    from engine.model_store import cache_root

    src = _SRC.read_bytes()
    tag = hashlib.sha256(src + " ".join(_FLAGS).encode()).hexdigest()[:16]
    out = cache_root() / "kernels" / f"paged_attention-{tag}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise OSError("no C compiler (gcc/cc) on PATH")
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        subprocess.run([cc, *_FLAGS, str(_SRC), "-o", str(tmp_out), "-lm"], check=True, capture_output=True,
                       text=True, timeout=120)
        os.replace(tmp_out, out)  # atomic: a half-written library is never loaded
    return out


def load() -> ctypes.CDLL | None:
    """The compiled kernels, or None when they cannot be built here."""
    global _lib
    if _lib is False:
        _lib = None
        if os.environ.get("PDSERVE_NO_KERNELS") != "1":
            try:
                _lib = ctypes.CDLL(str(_build()))
            except (OSError, subprocess.SubprocessError) as e:
                detail = getattr(e, "stderr", "") or e
                log.warning("paged attention kernel unavailable, using torch ops: %s", detail)
    return _lib or None


_DTYPES = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16"}


def supports(dtype: torch.dtype, device: torch.device, group: int) -> bool:
    return device.type == "cpu" and dtype in _DTYPES and group <= MAX_GROUP and load() is not None


def paged_decode(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, slots: torch.Tensor,
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
    lib = load()
    assert lib is not None and k_pool.is_contiguous() and v_pool.is_contiguous()
    q, k_new, v_new = q.contiguous(), k_new.contiguous(), v_new.contiguous()
    b, h, d = q.shape
    kvh, nb, bs, _ = k_pool.shape
    out = torch.empty_like(q)
    p = ctypes.c_void_p
    getattr(lib, _DTYPES[q.dtype])(
        p(q.data_ptr()), p(k_new.data_ptr()), p(v_new.data_ptr()), p(slots.data_ptr()), p(k_pool.data_ptr()),
        p(v_pool.data_ptr()), p(tables.data_ptr()), p(ctx.data_ptr()), p(out.data_ptr()), b, h, kvh, d, nb, bs,
        tables.shape[1], ctypes.c_float(scale), torch.get_num_threads())
    return out
