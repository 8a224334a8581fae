"""Triton ``copy_blocks`` (copy-on-write inside a paged KV cache).

Invariant: for every ``(src, dst)`` row of ``block_mapping``, block ``dst`` := block ``src`` in every
layer's K and V cache, on the cache's own device. Pairs must not chain (no dst is also a src in the
same call): programs run in any order. Swapping blocks between devices is not a kernel (a copy
engine transfer): ``PagedKVCache`` does it with torch.
Cost: one launch per layer, grid (num_pairs, cdiv(block_numel, BLOCK)); offsets are int64.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._common import check_cache_pair, check_tensor

__all__ = ["copy_blocks"]


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
    """Each block ``c[i]`` is read as ``numel`` elements from ``i * stride(0)`` (torch's notion of
    contiguous: the strides of size-1 dimensions do not matter)."""
    if c.shape[0] and not c[0].is_contiguous():
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

