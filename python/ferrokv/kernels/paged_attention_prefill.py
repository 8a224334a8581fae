"""Triton varlen paged attention for prefill and chunked prefill (mixed batches with decodes work too).

Invariant: the new tokens of sequence ``i`` are rows ``query_start_loc[i]:query_start_loc[i+1]`` of
``query`` and sit at positions ``seq_lens[i]-q_len_i ... seq_lens[i]-1``; their K/V are already in
the cache (``reshape_and_cache`` ran first). Each attends causally to its whole paged prefix plus
the new tokens before it, optionally within a sliding window. Rows past ``query_start_loc[S]``
(padding) are left as they are in ``out`` (zero when ``out`` is allocated here).
Cost: grid (cdiv(max_query_len, BLOCK_Q) * S, Hkv) (the tiles ride on axis 0, the one CUDA lets past
65,535, so a long prefill budget launches); a program takes BLOCK_Q query tokens times the G
query heads of one kv head as R = BLOCK_Q * pow2(G) rows (>= 16 for ``tl.dot``), and visits only the
keys its rows can see (causal upper bound, window lower bound).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._common import check_tensor, interpreting, next_pow2
from ._paged_attention_common import LOG2E, paged_attention_inner
from .paged_attention_decode import check_attention_args

__all__ = ["paged_attention_prefill"]


@triton.jit(do_not_specialize=["num_seqs"])  # one compile whatever the step's sequence count
def _paged_attention_prefill_kernel(
    out_ptr,  # [T, H, D]
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [NB, BS, Hkv, D]
    v_cache_ptr,  # [NB, BS, Hkv, D]
    block_tables_ptr,  # [S, MAXB] int32
    query_start_loc_ptr,  # [S+1] int32
    seq_lens_ptr,  # [S] int32
    num_seqs,  # S
    scale_log2,
    stride_ot, stride_oh, stride_od,
    stride_qt, stride_qh, stride_qd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    stride_bts, stride_btb,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,  # pow2 >= GROUP
    BLOCK_Q: tl.constexpr,  # query tokens per program; BLOCK_Q * GROUP_PAD >= 16
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    DOT_FP32: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    seq = pid % num_seqs
    tile = pid // num_seqs
    kvh = tl.program_id(1).to(tl.int64)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len  # position of the sequence's first new token
    r = tl.arange(0, BLOCK_Q * GROUP_PAD)
    qi = tile * BLOCK_Q + r // GROUP_PAD  # query index inside the sequence
    g = r % GROUP_PAD
    row_ok = (qi < q_len) & (g < GROUP)
    q_pos = ctx + qi
    tok = (q_start + qi).to(tl.int64)
    head = (kvh * GROUP + g).to(tl.int64)
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    qo_mask = row_ok[:, None] & (d[None, :] < HEAD_DIM)
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=qo_mask, other=0.0,
    )
    # Keys this tile can see: up to its last query position, from the window start of its first.
    k_hi = tl.minimum(seq_len, ctx + (tile + 1) * BLOCK_Q)
    k_lo = 0
    if SLIDING_WINDOW > 0:
        k_lo = tl.maximum(ctx + tile * BLOCK_Q - SLIDING_WINDOW + 1, 0)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], dtype=tl.float32)
    acc, m_i, l_i = paged_attention_inner(
        acc, m_i, l_i, q, q_pos,
        k_cache_ptr + kvh * stride_kch, v_cache_ptr + kvh * stride_vch,
        block_tables_ptr + seq * stride_bts, stride_btb,
        stride_kcb, stride_kcs, stride_kcd, stride_vcb, stride_vcs, stride_vcd,
        k_lo, k_hi, scale_log2,
        HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE, SLIDING_WINDOW, DOT_FP32, IEEE,
    )
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    o_ptrs = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :] * stride_od
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=qo_mask)


def paged_attention_prefill(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """``query`` [T, H, D] (ragged, sequences back to back) → output [T, H, D].

    ``query_start_loc`` int32 [S+1], ``seq_lens`` int32 [S], ``block_tables`` int32 [S, max_blocks];
    ``max_query_len`` (host int) sizes the grid, so no device sync happens here; it must be at least the
    longest query (rows past it are left unwritten: the caller, AttentionMetadata.build, computes it).
    """
    h, hkv, d, block_size, group = check_attention_args(query, k_cache, v_cache, block_tables, seq_lens, sliding_window,
                                                        scale)
    check_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=(torch.int32,), device=query.device,
                 contiguous=True)
    S = seq_lens.shape[0]
    if query_start_loc.shape[0] != S + 1:
        raise ValueError(f"query_start_loc must have {S + 1} entries for {S} sequences, got {query_start_loc.shape[0]}")
    if isinstance(max_query_len, bool) or not isinstance(max_query_len, int) or max_query_len < 0:
        raise ValueError(f"max_query_len must be an int >= 0 (a host int: no device sync), got {max_query_len!r}")
    if out is None:
        out = torch.zeros_like(query)
    elif out.shape != query.shape or out.dtype != query.dtype or out.device != query.device:
        raise ValueError(f"out must match query ({tuple(query.shape)}, {query.dtype}), got {tuple(out.shape)}, {out.dtype}")
    if S == 0 or max_query_len == 0:
        return out
    group_pad = next_pow2(group)
    # ~64 rows per program on GPUs (good occupancy), >= 16 rows for tl.dot, never more tokens than needed.
    block_q = max(1, min(64 // group_pad, next_pow2(max_query_len)))
    block_q = max(block_q, 16 // group_pad if group_pad < 16 else 1)
    interp = interpreting()
    grid = (triton.cdiv(max_query_len, block_q) * S, hkv)
    _paged_attention_prefill_kernel[grid](
        out, query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, S, scale * LOG2E,
        *out.stride(), *query.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, HEAD_DIM=d, BLOCK_D=max(16, next_pow2(d)),
        BLOCK_N=32, BLOCK_SIZE=block_size, SLIDING_WINDOW=sliding_window or 0,
        DOT_FP32=interp, IEEE=(not interp) and query.dtype == torch.float32,
    )
    return out
