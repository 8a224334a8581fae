"""Pure-torch references of the paged KV-cache kernels: the semantics the Triton kernels and the
torch attention backend are tested against, written for clarity, not speed.

Semantics:
- KV write: ``key[t]``/``value[t]`` go to slot ``slot_mapping[t]`` of ``k_cache``/``v_cache``
  (``[num_blocks, block_size, num_kv_heads, head_dim]``, slot = block * block_size + offset);
  slot -1 is skipped.
- Attention: a query token at position ``p`` of a sequence attends to every key at position
  ``k <= p`` (causal over the paged prefix plus the new tokens) and, with a sliding window ``W``,
  only to ``k > p - W`` (Hugging Face Mistral/Qwen semantics: the token itself plus ``W-1`` before
  it). Grouped-query attention: query head ``h`` reads kv head ``h // (H // H_kv)``. Output rows of
  padding tokens (past ``query_start_loc[-1]``) are zero.
- Block copy: for every ``(src, dst)`` pair, block dst := block src in every layer.

Invariants: no function mutates its inputs (each returns new tensors); attention is computed in
fp32 and returned in the query's dtype. This module imports nothing from ferrokv: it is the leaf
both the kernels and the attention backends may depend on.
Costs: one gather of every key of a sequence, token by token through its block table, and one
dense [H, Lq, L] score matrix per sequence; fine for tests, far too slow for serving.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "copy_blocks_reference",
    "paged_attention_decode_reference",
    "paged_attention_prefill_reference",
    "paged_attention_reference",
    "reshape_and_cache_reference",
]


def reshape_and_cache_reference(
    key: Tensor,  # [T, Hkv, D]
    value: Tensor,  # [T, Hkv, D]
    k_cache: Tensor,  # [NB, BS, Hkv, D]
    v_cache: Tensor,  # [NB, BS, Hkv, D]
    slot_mapping: Tensor,  # [T] int64, -1 = skip
) -> tuple[Tensor, Tensor]:
    """The KV write on copies of the caches; returns the updated copies."""
    k2, v2 = k_cache.clone(), v_cache.clone()
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            k2[slot // block_size, slot % block_size] = key[t].to(k2.dtype)
            v2[slot // block_size, slot % block_size] = value[t].to(v2.dtype)
    return k2, v2


def _sequence_attention(
    q: Tensor,  # [Lq, H, D] the sequence's new tokens, at positions L-Lq .. L-1
    k_cache: Tensor,  # [NB, BS, Hkv, D]
    v_cache: Tensor,  # [NB, BS, Hkv, D]
    table: Tensor,  # [MAXB] the sequence's block-table row
    seq_len: int,  # L
    scale: float,
    sliding_window: int | None,
) -> Tensor:
    bs = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    pos = torch.arange(seq_len, device=k_cache.device)
    blocks = table.long()[pos // bs]
    k = k_cache[blocks, pos % bs].float().repeat_interleave(group, dim=1)  # [L, H, D]
    v = v_cache[blocks, pos % bs].float().repeat_interleave(group, dim=1)
    q_pos = torch.arange(seq_len - q.shape[0], seq_len, device=k_cache.device)
    visible = pos[None, :] <= q_pos[:, None]
    if sliding_window:
        visible &= pos[None, :] > q_pos[:, None] - sliding_window
    scores = torch.einsum("qhd,khd->hqk", q.float().to(k.device), k) * scale
    probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def paged_attention_reference(
    query: Tensor,  # [T, H, D]
    k_cache: Tensor,  # [NB, BS, Hkv, D], already holding the new tokens' K/V
    v_cache: Tensor,  # [NB, BS, Hkv, D]
    block_tables: Tensor,  # [S, MAXB]
    query_start_loc: Tensor,  # [S+1]
    seq_lens: Tensor,  # [S], context length including the new tokens
    scale: float,
    sliding_window: int | None = None,
) -> Tensor:
    """Varlen causal attention of ``query`` over the paged cache; returns a new [T, H, D] tensor."""
    out = torch.zeros_like(query)
    qsl = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        qs, qe = qsl[i], qsl[i + 1]
        o = _sequence_attention(query[qs:qe], k_cache, v_cache, block_tables[i], seq_len, scale, sliding_window)
        out[qs:qe] = o.to(out.device, out.dtype)
    return out


# The prefill kernel computes exactly the varlen attention above.
paged_attention_prefill_reference = paged_attention_reference


def paged_attention_decode_reference(
    query: Tensor,  # [S, H, D], one new token per sequence, at position seq_lens[i]-1
    k_cache: Tensor,  # [NB, BS, Hkv, D]
    v_cache: Tensor,  # [NB, BS, Hkv, D]
    block_tables: Tensor,  # [S, MAXB]
    seq_lens: Tensor,  # [S]
    scale: float,
    sliding_window: int | None = None,
) -> Tensor:
    """Decode: the varlen attention with one query token per sequence."""
    qsl = torch.arange(query.shape[0] + 1, dtype=torch.int32)
    return paged_attention_reference(query, k_cache, v_cache, block_tables, qsl, seq_lens, scale, sliding_window)


def copy_blocks_reference(
    k_caches: list[Tensor],  # per layer [NB, BS, Hkv, D]
    v_caches: list[Tensor],  # per layer [NB, BS, Hkv, D]
    block_mapping: Tensor,  # [N, 2] (src, dst)
) -> tuple[list[Tensor], list[Tensor]]:
    """Copy-on-write on copies of the caches: block dst := block src in every layer. Sources are
    read before any write (pairs must not chain)."""
    src, dst = block_mapping[:, 0].long(), block_mapping[:, 1].long()
    new_k, new_v = [], []
    for k, v in zip(k_caches, v_caches):
        k2, v2 = k.clone(), v.clone()
        k2[dst] = k[src]
        v2[dst] = v[src]
        new_k.append(k2)
        new_v.append(v2)
    return new_k, new_v
