"""Triton attention backend: ``reshape_and_cache`` then the decode kernel (all sequences single-token)
or the varlen prefill kernel (any mix of prefill chunks and decodes).

Costs: two launches per layer, no host sync (grid sizes come from host ints in the metadata).
Padding rows (slot -1, past ``query_start_loc[-1]``) are skipped by the write and zero in the output.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..kernels.paged_attention_decode import paged_attention_decode
from ..kernels.paged_attention_prefill import paged_attention_prefill
from ..kernels.reshape_and_cache import reshape_and_cache
from .metadata import AttentionMetadata


class TritonAttentionBackend:
    name = "triton"

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
        reshape_and_cache(key, value, k_cache, v_cache, meta.slot_mapping)
        n = meta.num_seqs
        if meta.max_query_len == 1 and meta.num_actual_tokens == n:
            out = torch.zeros_like(query) if query.shape[0] > n else torch.empty_like(query)
            paged_attention_decode(
                query[:n], k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, sliding_window, out=out[:n]
            )
            return out
        return paged_attention_prefill(
            query, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
            meta.max_query_len, scale, sliding_window,
        )
