"""Block copies inside and between paged KV caches.

- ``copy_blocks`` (Triton, copy-on-write): for every ``(src, dst)`` row of ``block_mapping``,
  block ``dst`` := block ``src`` in every layer's K and V cache, on the cache's own device. Pairs must
  not chain (no dst is also a src in the same call): programs run in any order.
  Cost: one launch per layer, grid (num_pairs, cdiv(block_numel, BLOCK)); offsets are int64.
- ``swap_blocks`` (plain torch, swap in/out): copies whole blocks between two caches that may live on
  different devices (GPU <-> pinned CPU). It is a gather + ``index_copy_`` on the host side: a copy
  engine transfer, not a kernel, so there is nothing for Triton to add.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..attention.torch_backend import copy_blocks_reference
from ._common import check_cache_pair, check_tensor

__all__ = ["copy_blocks", "copy_blocks_reference", "swap_blocks"]


@triton.jit
def _copy_blocks_kernel(
    k_cache_ptr,  # [NB, BS, Hkv, D], each block contiguous
    v_cache_ptr,  # [NB, BS, Hkv, D], each block contiguous
    block_mapping_ptr,  # [N, 2] int64 (src, dst)
    stride_kb,  # elements between blocks of k_cache
    stride_vb,  # elements between blocks of v_cache
    BLOCK_NUMEL: tl.constexpr,  # BS * Hkv * D
    BLOCK: tl.constexpr,  # elements per program
):
    pair = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1).to(tl.int64)
    src = tl.load(block_mapping_ptr + 2 * pair).to(tl.int64)
    dst = tl.load(block_mapping_ptr + 2 * pair + 1).to(tl.int64)
    i = chunk * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    m = i < BLOCK_NUMEL
    k = tl.load(k_cache_ptr + src * stride_kb + i, mask=m)
    tl.store(k_cache_ptr + dst * stride_kb + i, k, mask=m)
    v = tl.load(v_cache_ptr + src * stride_vb + i, mask=m)
    tl.store(v_cache_ptr + dst * stride_vb + i, v, mask=m)


def _check_block_contiguous(name: str, c: Tensor) -> None:
    _, bs, h, d = c.shape
    if c.stride(3) != 1 or c.stride(2) != d or c.stride(1) != h * d:
        raise ValueError(f"{name}: each block must be contiguous (strides {c.stride()})")


def copy_blocks(k_caches: Sequence[Tensor], v_caches: Sequence[Tensor], block_mapping: Tensor) -> None:
    """In place, every layer: block dst := block src for each row (src, dst) of ``block_mapping`` [N, 2]."""
    if len(k_caches) != len(v_caches):
        raise ValueError(f"k_caches has {len(k_caches)} layers, v_caches {len(v_caches)}")
    if not k_caches:
        return
    dev = k_caches[0].device
    check_tensor("block_mapping", block_mapping, ndim=2, dtypes=(torch.int64,), device=dev)
    if block_mapping.shape[1] != 2:
        raise ValueError(f"block_mapping must be [N, 2], got {tuple(block_mapping.shape)}")
    n = block_mapping.shape[0]
    if n == 0:
        return
    block_mapping = block_mapping.contiguous()
    for layer, (k, v) in enumerate(zip(k_caches, v_caches)):
        check_cache_pair(k, v)
        if k.device != dev:
            raise ValueError(f"k_caches[{layer}] is on {k.device}, block_mapping on {dev}")
        _check_block_contiguous(f"k_caches[{layer}]", k)
        _check_block_contiguous(f"v_caches[{layer}]", v)
        numel = k.shape[1] * k.shape[2] * k.shape[3]
        block = min(1024, triton.next_power_of_2(numel))
        _copy_blocks_kernel[(n, triton.cdiv(numel, block))](
            k, v, block_mapping, k.stride(0), v.stride(0), BLOCK_NUMEL=numel, BLOCK=block
        )


def swap_blocks(src_cache: Tensor, dst_cache: Tensor, block_mapping: Tensor) -> None:
    """In place: ``dst_cache[dst] = src_cache[src]`` for each (src, dst) row; caches may be on different
    devices (swap out GPU→CPU, swap in CPU→GPU). Host-side torch copy, see module docstring."""
    check_tensor("src_cache", src_cache, ndim=4)
    check_tensor("dst_cache", dst_cache, ndim=4, dtypes=(src_cache.dtype,))
    if src_cache.shape[1:] != dst_cache.shape[1:]:
        raise ValueError(f"dst_cache block shape {tuple(dst_cache.shape[1:])} differs from src_cache {tuple(src_cache.shape[1:])}")
    check_tensor("block_mapping", block_mapping, ndim=2, dtypes=(torch.int64,))
    if block_mapping.shape[1] != 2:
        raise ValueError(f"block_mapping must be [N, 2], got {tuple(block_mapping.shape)}")
    if block_mapping.shape[0] == 0:
        return
    mapping = block_mapping.cpu()
    src = mapping[:, 0].to(src_cache.device)
    dst = mapping[:, 1].to(dst_cache.device)
    # non_blocking lets a pinned CPU side overlap with compute; the caller syncs before reuse.
    dst_cache.index_copy_(0, dst, src_cache.index_select(0, src).to(dst_cache.device, non_blocking=True))
