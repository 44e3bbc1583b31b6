"""Pool helpers shared by backends: one layer's blocks as one contiguous buffer, and back."""
from __future__ import annotations

import hashlib

import torch


def single_threaded() -> None:
    """Call first on a transfer thread: its copies into and out of the pool run on it alone. An OpenMP
    team of its own beside the engine thread's would slow every parallel region of the engine's
    (`worker_core.base`: libgomp stops spinning between regions once it holds more threads than CPUs)."""
    torch.set_num_threads(1)


def check_pool(kv_pool: torch.Tensor) -> None:
    """Raise ValueError unless `kv_pool` is `[layers, 2, kv_heads, num_blocks, block_size, head_dim]`."""
    if kv_pool.dim() != 6 or kv_pool.shape[1] != 2:
        raise ValueError("kv_pool must be [num_layers, 2, kv_heads, num_blocks, block_size, head_dim], "
                         f"got shape {tuple(kv_pool.shape)}")


def check_blocks(kv_pool: torch.Tensor, blocks: list[int], layer: int | None = None) -> None:
    """Raise ValueError for empty or out-of-range block ids or layer."""
    if not blocks:
        raise ValueError("blocks must be a non-empty list of block ids")
    nb = kv_pool.shape[3]
    if min(blocks) < 0 or max(blocks) >= nb:
        raise ValueError(f"block ids must be in [0, {nb}), got {blocks}")
    if layer is not None and not 0 <= layer < kv_pool.shape[0]:
        raise ValueError(f"layer must be in [0, {kv_pool.shape[0]}), got {layer}")


def gather_layer(kv_pool: torch.Tensor, layer: int, blocks: list[int]) -> torch.Tensor:
    """Returns:
        `[2, kv_heads, len(blocks), block_size, head_dim]`, contiguous, a copy.
    """
    idx = torch.tensor(blocks, dtype=torch.long, device=kv_pool.device)
    return kv_pool[layer].index_select(2, idx).contiguous()


def scatter_layer(kv_pool: torch.Tensor, layer: int, blocks: list[int], buf: torch.Tensor) -> None:
    """Write a `gather_layer` buffer into `blocks` of `layer`."""
    assert buf.shape[2] == len(blocks), (tuple(buf.shape), len(blocks))
    idx = torch.tensor(blocks, dtype=torch.long, device=kv_pool.device)
    kv_pool[layer].index_copy_(2, idx, buf.to(kv_pool.device, kv_pool.dtype))


def layer_shape(kv_pool: torch.Tensor, n: int) -> tuple[int, ...]:
    """Shape of one layer's buffer of `n` blocks."""
    _, two, heads, _, bs, hd = kv_pool.shape
    return (two, heads, n, bs, hd)


def transfer_hash(transfer_id: str) -> int:
    """A stable 63-bit id for headers (Python's `hash` differs between processes)."""
    return int.from_bytes(hashlib.blake2b(transfer_id.encode(), digest_size=8).digest(), "little") >> 1
