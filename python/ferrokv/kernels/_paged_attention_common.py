"""The inner loop shared by the paged attention kernels: online softmax over a range of key positions.

Invariants: keys are gathered token by token through the block table (position ``p`` lives in block
``block_table[p // BLOCK_SIZE]`` at offset ``p % BLOCK_SIZE``), so any block size works and a tile of
BLOCK_N keys may span several blocks. A key at position ``k`` is visible to a query row at position
``p`` iff ``k <= p`` and, with a window ``W > 0``, ``k > p - W``. Accumulators are fp32; scores use
exp2 with the scale pre-multiplied by log2(e). Every offset is int64 (block id * block stride may
exceed 2**31). Cost per tile: two ``tl.dot`` of [R, D] x [D, BLOCK_N] and [R, BLOCK_N] x [BLOCK_N, D].
"""
from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def paged_attention_inner(
    acc,  # [R, BLOCK_D] fp32 running output (unnormalised)
    m_i,  # [R] fp32 running max (log2 domain)
    l_i,  # [R] fp32 running denominator
    q,  # [R, BLOCK_D] query rows (cache dtype)
    q_pos,  # [R] int32 absolute position of each query row
    k_cache_ptr,  # [NB, BS, Hkv, D], already offset to this kv head
    v_cache_ptr,  # [NB, BS, Hkv, D], already offset to this kv head
    bt_row_ptr,  # [MAXB] int32, this sequence's block-table row
    stride_btb,
    stride_kcb, stride_kcs, stride_kcd,
    stride_vcb, stride_vcs, stride_vcd,
    k_lo,  # first key position to visit
    k_hi,  # one past the last key position to visit
    scale_log2,  # softmax scale * log2(e)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,  # 0 = no window
    DOT_FP32: tl.constexpr,  # upcast dot operands to fp32 (interpreter: bf16 tl.dot is wrong there)
    IEEE: tl.constexpr,  # fp32 operands: ask for IEEE fp32 instead of TF32 on GPUs
):
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    d_ok = d < HEAD_DIM
    for n0 in range(k_lo, k_hi, BLOCK_N):
        k_pos = n0 + tl.arange(0, BLOCK_N)
        k_ok = k_pos < k_hi
        blk = tl.load(bt_row_ptr + (k_pos // BLOCK_SIZE).to(tl.int64) * stride_btb, mask=k_ok, other=0)
        blk = blk.to(tl.int64)
        off = (k_pos % BLOCK_SIZE).to(tl.int64)
        kv_ok = k_ok[:, None] & d_ok[None, :]
        k = tl.load(
            k_cache_ptr + blk[:, None] * stride_kcb + off[:, None] * stride_kcs + d[None, :] * stride_kcd,
            mask=kv_ok, other=0.0,
        )
        v = tl.load(
            v_cache_ptr + blk[:, None] * stride_vcb + off[:, None] * stride_vcs + d[None, :] * stride_vcd,
            mask=kv_ok, other=0.0,
        )
        if DOT_FP32:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
        elif IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale_log2
        visible = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if SLIDING_WINDOW > 0:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - SLIDING_WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no visible key yet keeps m = -inf; shift by 0 to avoid (-inf) - (-inf).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_FP32:
            pv = tl.dot(p, v.to(tl.float32))
        elif IEEE:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, m_i, l_i
