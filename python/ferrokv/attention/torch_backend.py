"""Pure-torch paged attention: the CPU backend.

Semantics: those of ``ferrokv.kernels.reference`` (the KV write, then causal paged attention with
grouped-query heads and an optional sliding window; padding rows are zero), which tests hold this
backend to; it is the Triton kernels' semantics too.

Costs: one plan per step (index tensors + masks, cached in ``AttentionMetadata.plans``), then per layer
one block gather (``index_select`` of whole blocks into a buffer reused by all layers) + one batched
SDPA for all decode sequences together, and one SDPA per prefill sequence (a Python loop over prefill
sequences only; a prompt without cached prefix attends to its fresh K/V without any gather). With a
window, only the blocks overlapping the window are gathered. On SmolLM2-135M (fp32, 2 threads) this
is on par with transformers' own CPU forward (decode batch 32 at context 200: ~165 ms per step).
The backend writes the caches in place, by design.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from .metadata import AttentionMetadata


# --------------------------------------------------------------------------------------------------
# KV write
# --------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _WritePlan:
    rows: Tensor | None  # int64 [n] rows of key/value to write; None = all rows
    blk: Tensor  # int64 [n] physical block of each written row
    off: Tensor  # int64 [n] offset inside the block


def _write_plan(slot_mapping: Tensor, block_size: int) -> _WritePlan:
    valid = slot_mapping >= 0
    # One host sync per step (not per layer) to learn whether padding rows exist.
    if bool(valid.all()):
        slots = slot_mapping.long()
        return _WritePlan(None, slots // block_size, slots % block_size)
    rows = valid.nonzero().squeeze(1)
    slots = slot_mapping[rows].long()
    return _WritePlan(rows, slots // block_size, slots % block_size)


def _apply_write(plan: _WritePlan, key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor) -> None:
    k = key if plan.rows is None else key[plan.rows]
    v = value if plan.rows is None else value[plan.rows]
    # Two-index advanced assignment works for any cache strides (no flattening view needed).
    k_cache[plan.blk, plan.off] = k.to(k_cache.dtype)
    v_cache[plan.blk, plan.off] = v.to(v_cache.dtype)


# --------------------------------------------------------------------------------------------------
# Attention plan
# --------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _DecodeBatch:
    rows: Tensor  # int64 [Sd] batch rows of the single-token sequences
    blocks: Tensor  # int64 [Sd * nb] physical blocks to gather, nb per sequence (padded with block 0)
    num_keys: int  # nb * block_size gathered key slots per sequence
    mask: Tensor | None  # bool [Sd, 1, 1, num_keys], True = attend; None when every slot is visible
    # Gather destinations reused by every layer of the step: a fresh multi-MB tensor per layer costs
    # more in page faults than the copy itself on CPU.
    k_buf: Tensor | None = None
    v_buf: Tensor | None = None


@dataclass(slots=True)
class _SeqPrefill:
    q_start: int
    q_end: int
    blocks: Tensor | None  # int64 [nb] blocks to gather; None = keys are exactly the new tokens
    mask: Tensor | None  # bool [Lq, nb * block_size]; None = plain causal over the new tokens


@dataclass(slots=True)
class TorchAttentionPlan:
    decode: _DecodeBatch | None
    prefills: list[_SeqPrefill]
    num_actual_tokens: int


def build_attention_plan(
    query_start_loc_host: np.ndarray,
    seq_lens_host: np.ndarray,
    block_tables: Tensor,
    block_size: int,
    sliding_window: int | None,
) -> TorchAttentionPlan:
    """Index tensors and masks for one step; O(S + total keys) work, done once per step.

    Keys are gathered by whole blocks (one ``index_select`` of contiguous block rows, much faster
    than a per-token gather); slots outside ``[first visible key, seq_len)`` are masked out.
    A prefill chunk without cached prefix attends to the K/V just computed instead of re-reading
    them from the cache (same values, one gather less).
    """
    device = block_tables.device
    qsl = np.asarray(query_start_loc_host, dtype=np.int64)
    seq_lens = np.asarray(seq_lens_host, dtype=np.int64)
    q_lens = np.diff(qsl)
    window = sliding_window if sliding_window else None
    bs = block_size

    decode = None
    dec = np.nonzero(q_lens == 1)[0]
    if dec.size:
        lens = seq_lens[dec]
        # With a window, only the last W keys can be seen by the single query token.
        start = np.maximum(lens - window, 0) if window else np.zeros_like(lens)
        first_blk = start // bs
        nblk = (lens + bs - 1) // bs - first_blk
        nb = int(nblk.max())
        j = np.arange(nb)
        blk_idx = np.minimum(first_blk[:, None] + j[None, :], block_tables.shape[1] - 1)
        blk_ok = j[None, :] < nblk[:, None]
        rows_bt = block_tables[torch.from_numpy(dec).to(device)]
        blocks = rows_bt.gather(1, torch.from_numpy(blk_idx).to(device)).long()
        blocks = torch.where(torch.from_numpy(blk_ok).to(device), blocks, 0).reshape(-1)
        k_pos = first_blk[:, None] * bs + np.arange(nb * bs)[None, :]
        visible = (k_pos >= start[:, None]) & (k_pos < lens[:, None])
        mask = None if visible.all() else torch.from_numpy(visible).to(device)[:, None, None, :]
        decode = _DecodeBatch(torch.from_numpy(qsl[dec]).to(device), blocks, nb * bs, mask)

    prefills: list[_SeqPrefill] = []
    for i in np.nonzero(q_lens > 1)[0]:
        qs, qe, L = int(qsl[i]), int(qsl[i + 1]), int(seq_lens[i])
        ctx = L - (qe - qs)  # cached prefix length = position of the first new token
        q_pos = np.arange(ctx, L)
        if ctx == 0:
            # Keys are the new tokens: plain causal unless the window cuts something off.
            mask = None
            if window is not None and (qe - qs) > window:
                k_pos = np.arange(L)
                m = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - window)
                mask = torch.from_numpy(m).to(device)
            prefills.append(_SeqPrefill(qs, qe, None, mask))
            continue
        k_start = max(0, ctx - window + 1) if window else 0
        first_blk, last_blk = k_start // bs, (L - 1) // bs
        blocks = block_tables[int(i), first_blk : last_blk + 1].long()
        k_pos = first_blk * bs + np.arange((last_blk + 1 - first_blk) * bs)
        m = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] >= k_start)
        if window:
            m &= k_pos[None, :] > q_pos[:, None] - window
        prefills.append(_SeqPrefill(qs, qe, blocks, torch.from_numpy(m).to(device)))
    return TorchAttentionPlan(decode, prefills, int(qsl[-1]))


def _gather_blocks(cache: Tensor, blocks: Tensor, dtype: torch.dtype, out: Tensor | None = None) -> Tensor:
    """[n, block_size, Hkv, D] copy of the given blocks (any cache strides), into ``out`` if given."""
    if cache.dtype != dtype:
        return cache.index_select(0, blocks).to(dtype)
    if out is None:
        return cache.index_select(0, blocks)
    return torch.index_select(cache, 0, blocks, out=out)


def _attend(
    plan: TorchAttentionPlan,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    scale: float,
) -> Tensor:
    T, H, D = query.shape
    Hkv = k_cache.shape[2]
    G = H // Hkv
    out = torch.empty_like(query)
    if plan.num_actual_tokens < T:
        out[plan.num_actual_tokens :] = 0
    d = plan.decode
    if d is not None:
        sd = d.rows.shape[0]
        # Fold the G query heads of a kv head into SDPA's query axis: one batched matmul per kv head,
        # K/V never repeated per query head.
        qd = query[d.rows].view(sd, Hkv, G, D)
        shape = (d.blocks.shape[0], *k_cache.shape[1:])
        if d.k_buf is None or d.k_buf.shape != shape or d.k_buf.dtype != query.dtype:
            d.k_buf = torch.empty(shape, dtype=query.dtype, device=query.device)
            d.v_buf = torch.empty_like(d.k_buf)
        kd = _gather_blocks(k_cache, d.blocks, query.dtype, d.k_buf).view(sd, d.num_keys, Hkv, D).transpose(1, 2)
        vd = _gather_blocks(v_cache, d.blocks, query.dtype, d.v_buf).view(sd, d.num_keys, Hkv, D).transpose(1, 2)
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=d.mask, scale=scale)
        out[d.rows] = o.reshape(sd, H, D)
    for p in plan.prefills:
        qs = query[p.q_start : p.q_end].transpose(0, 1).unsqueeze(0)  # [1, H, Lq, D]
        if p.blocks is None:
            ks, vs = key[p.q_start : p.q_end], value[p.q_start : p.q_end]
        else:
            ks = _gather_blocks(k_cache, p.blocks, query.dtype).flatten(0, 1)
            vs = _gather_blocks(v_cache, p.blocks, query.dtype).flatten(0, 1)
        ks = ks.transpose(0, 1).unsqueeze(0)  # [1, Hkv, Lk, D]
        vs = vs.transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=p.mask, is_causal=p.mask is None, scale=scale, enable_gqa=G > 1
        )
        out[p.q_start : p.q_end] = o[0].transpose(0, 1)
    return out


# --------------------------------------------------------------------------------------------------
# Backend
# --------------------------------------------------------------------------------------------------


class TorchAttentionBackend:
    """Writes the new K/V into the paged cache, then attends (see module docstring)."""

    name = "torch"

    def forward(
        self,
        query: Tensor,  # [T, H, D]
        key: Tensor,  # [T, Hkv, D]
        value: Tensor,  # [T, Hkv, D]
        k_cache: Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: Tensor,
        meta: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
    ) -> Tensor:
        block_size = k_cache.shape[1]
        wkey = ("torch-write", block_size)
        wplan = meta.plans.get(wkey)
        if wplan is None:
            wplan = meta.plans[wkey] = _write_plan(meta.slot_mapping, block_size)
        _apply_write(wplan, key, value, k_cache, v_cache)
        akey = ("torch-attn", block_size, sliding_window or 0)
        aplan = meta.plans.get(akey)
        if aplan is None:
            aplan = meta.plans[akey] = build_attention_plan(
                meta.query_start_loc_host, meta.seq_lens_host, meta.block_tables, block_size,
                sliding_window,
            )
        return _attend(aplan, query, key, value, k_cache, v_cache, scale)
