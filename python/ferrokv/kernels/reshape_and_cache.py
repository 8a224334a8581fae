"""Triton ``reshape_and_cache``: scatter the new tokens' K/V into the paged cache.

Invariant: for each token t with ``slot_mapping[t] >= 0``,
``k_cache[slot // block_size, slot % block_size] = key[t]`` (same for values); slot -1 rows are
skipped. Slots must be distinct (two tokens writing one slot race).
Cost: one program per token, ``num_kv_heads * head_dim`` elements read and written each; offsets are
int64 so caches with more than 2**31 elements are addressed correctly.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._common import FLOAT_DTYPES, check_cache_pair, check_tensor, next_pow2

__all__ = ["reshape_and_cache"]


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [T, Hkv, D]
    value_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [NB, BS, Hkv, D]
    v_cache_ptr,  # [NB, BS, Hkv, D]
    slot_mapping_ptr,  # [T] int64, -1 = skip
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,  # next pow2 of NUM_KV_HEADS
    BLOCK_D: tl.constexpr,  # next pow2 of HEAD_DIM
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H).to(tl.int64)
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    m = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)
    k = tl.load(key_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :] * stride_kd, mask=m)
    v = tl.load(value_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :] * stride_vd, mask=m)
    kc = k_cache_ptr + blk * stride_kcb + off * stride_kcs + h[:, None] * stride_kch + d[None, :] * stride_kcd
    vc = v_cache_ptr + blk * stride_vcb + off * stride_vcs + h[:, None] * stride_vch + d[None, :] * stride_vcd
    tl.store(kc, k.to(kc.dtype.element_ty), mask=m)
    tl.store(vc, v.to(vc.dtype.element_ty), mask=m)


def reshape_and_cache(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """In place: write ``key``/``value`` [T, Hkv, D] into the caches at ``slot_mapping`` [T] (int64)."""
    check_cache_pair(k_cache, v_cache)
    dev = k_cache.device
    check_tensor("key", key, ndim=3, dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("value", value, ndim=3, dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int64, torch.int32), device=dev, contiguous=True)
    _, block_size, hkv, d = k_cache.shape
    if tuple(key.shape[1:]) != (hkv, d):
        raise ValueError(f"key must be [T, {hkv}, {d}] to match k_cache, got {tuple(key.shape)}")
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} differs from key shape {tuple(key.shape)}")
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens")
    T = key.shape[0]
    if T == 0:
        return
    _reshape_and_cache_kernel[(T,)](
        key, value, k_cache, v_cache, slot_mapping,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        NUM_KV_HEADS=hkv, HEAD_DIM=d, BLOCK_H=next_pow2(hkv), BLOCK_D=next_pow2(d), BLOCK_SIZE=block_size,
    )
