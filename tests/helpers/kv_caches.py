"""Paged KV caches for tests that drive a model directly (no engine).

Invariant: allocated by ``PagedKVCache`` from the model's own config, dtype and device, so tests
use the engine's layout, never a copy of it. Cost: zeroed tensors, allocated once per call.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ferrokv.kv_cache import KVCacheSpec, PagedKVCache

__all__ = ["model_kv_spec", "paged_kv_caches"]


def model_kv_spec(model: torch.nn.Module, block_size: int) -> KVCacheSpec:
    cfg = model.config
    dtype = next(model.parameters()).dtype
    return KVCacheSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, block_size, dtype)


def paged_kv_caches(model: torch.nn.Module, num_blocks: int, block_size: int) -> list[tuple[Tensor, Tensor]]:
    """Zeroed per-layer ``(k, v)`` caches of ``num_blocks`` blocks for ``model``."""
    device = next(model.parameters()).device
    return PagedKVCache(model_kv_spec(model, block_size), num_blocks, 0, device).layers
