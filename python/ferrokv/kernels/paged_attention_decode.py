"""Triton paged attention for decode: one new query token per sequence.

Invariant: ``query[i]`` is the token at position ``seq_lens[i]-1`` of sequence ``i``, whose K/V are
already in the cache; it attends causally (optionally within a sliding window) over positions
``[max(0, seq_lens[i]-W), seq_lens[i])`` read through ``block_tables[i]``.
Cost: grid (S, Hkv); each program handles the G query heads sharing one kv head, so K/V are read
once per kv head. Rows are padded to >= 16: triton 3.8 accepts ``tl.dot`` with M < 16 on NVIDIA, but
older releases do not, and the padding costs nothing in a memory-bound kernel. No split over the
context (flash-decoding) yet: long contexts with few sequences underuse a large GPU.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._common import check_cache_pair, check_tensor, interpreting, next_pow2
from ._paged_attention_common import LOG2E, paged_attention_inner

__all__ = ["paged_attention_decode"]


@triton.jit
def _paged_attention_decode_kernel(
    out_ptr,  # [S, H, D]
    q_ptr,  # [S, H, D]
    k_cache_ptr,  # [NB, BS, Hkv, D]
    v_cache_ptr,  # [NB, BS, Hkv, D]
    block_tables_ptr,  # [S, MAXB] int32
    seq_lens_ptr,  # [S] int32
    scale_log2,
    stride_os, stride_oh, stride_od,
    stride_qs, stride_qh, stride_qd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    stride_bts, stride_btb,
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_PAD: tl.constexpr,  # rows per program, pow2 >= max(GROUP, 16)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    DOT_FP32: tl.constexpr,
    IEEE: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)
    g = tl.arange(0, GROUP_PAD)
    row_ok = g < GROUP
    head = (kvh * GROUP + g).to(tl.int64)
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    d_ok = d < HEAD_DIM
    qo_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + seq * stride_qs + head[:, None] * stride_qh + d[None, :] * stride_qd, mask=qo_mask, other=0.0)
    q_pos = tl.zeros([GROUP_PAD], dtype=tl.int32) + (seq_len - 1)
    k_lo = 0
    if SLIDING_WINDOW > 0:
        k_lo = tl.maximum(seq_len - SLIDING_WINDOW, 0)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc, m_i, l_i = paged_attention_inner(
        acc, m_i, l_i, q, q_pos,
        k_cache_ptr + kvh * stride_kch, v_cache_ptr + kvh * stride_vch,
        block_tables_ptr + seq * stride_bts, stride_btb,
        stride_kcb, stride_kcs, stride_kcd, stride_vcb, stride_vcs, stride_vcd,
        k_lo, seq_len, scale_log2,
        HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE, SLIDING_WINDOW, DOT_FP32, IEEE,
    )
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    o_ptrs = out_ptr + seq * stride_os + head[:, None] * stride_oh + d[None, :] * stride_od
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=qo_mask)


def check_attention_args(
    query: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
    sliding_window: int | None, scale: float,
) -> tuple[int, int, int, int, int]:
    """Shared validation; returns (num_heads, num_kv_heads, head_dim, block_size, group). ``scale``
    and ``sliding_window`` are host numbers (a tensor would be a kernel argument of another kind)."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)):
        raise ValueError(f"sliding_window must be None or an int, got {sliding_window!r}")
    check_cache_pair(k_cache, v_cache)
    dev = k_cache.device
    check_tensor("query", query, ndim=3, dtypes=(k_cache.dtype,), device=dev)
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,), device=dev)
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), device=dev, contiguous=True)
    _, block_size, hkv, d = k_cache.shape
    h = query.shape[1]
    if query.shape[2] != d:
        raise ValueError(f"query head_dim {query.shape[2]} differs from the cache head_dim {d}")
    if h % hkv:
        raise ValueError(f"query has {h} heads, not a multiple of the cache's {hkv} kv heads")
    if block_tables.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {seq_lens.shape[0]} seq_lens")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be None or > 0, got {sliding_window}")
    return h, hkv, d, block_size, h // hkv


def paged_attention_decode(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
    sliding_window: int | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """``query`` [S, H, D] (one token per sequence) → output [S, H, D]; the cache already holds the
    new tokens' K/V. ``block_tables`` int32 [S, max_blocks], ``seq_lens`` int32 [S] (>= 1)."""
    h, hkv, d, block_size, group = check_attention_args(query, k_cache, v_cache, block_tables, seq_lens, sliding_window,
                                                        scale)
    S = query.shape[0]
    if seq_lens.shape[0] != S:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries for {S} query rows")
    if out is None:
        out = torch.empty_like(query)
    elif out.shape != query.shape or out.dtype != query.dtype or out.device != query.device:
        raise ValueError(f"out must match query ({tuple(query.shape)}, {query.dtype}), got {tuple(out.shape)}, {out.dtype}")
    if S == 0:
        return out
    interp = interpreting()
    _paged_attention_decode_kernel[(S, hkv)](
        out, query, k_cache, v_cache, block_tables, seq_lens, scale * LOG2E,
        *out.stride(), *query.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(),
        GROUP=group, GROUP_PAD=max(16, next_pow2(group)), HEAD_DIM=d, BLOCK_D=max(16, next_pow2(d)),
        BLOCK_N=32, BLOCK_SIZE=block_size, SLIDING_WINDOW=sliding_window or 0,
        DOT_FP32=interp, IEEE=(not interp) and query.dtype == torch.float32,
    )
    return out
