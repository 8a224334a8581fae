"""Attention metadata and backends (paged KV cache).

Backends share one interface, ``forward(query, key, value, k_cache, v_cache, meta, *, scale,
sliding_window) -> out``: write the new tokens' K/V into the cache, then attend. ``"torch"`` runs
anywhere (CPU default); ``"triton"`` needs CUDA (or ``TRITON_INTERPRET=1``). Both are tested against
``ferrokv.kernels.reference``.
"""
from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from .metadata import AttentionMetadata
from .torch_backend import TorchAttentionBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend", "get_attention_backend"]

BACKEND_NAMES = ("auto", "torch", "triton")


class AttentionBackend(Protocol):
    name: str

    def forward(
        self, query: Tensor, key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
        meta: AttentionMetadata, *, scale: float, sliding_window: int | None = None,
    ) -> Tensor: ...


def get_attention_backend(name: str = "auto", device: torch.device | str | None = None) -> AttentionBackend:
    """``auto`` picks ``triton`` for CUDA devices and ``torch`` otherwise."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention backend must be one of {BACKEND_NAMES}, got {name!r}")
    if name == "auto":
        name = "triton" if device is not None and torch.device(device).type == "cuda" else "torch"
    if name == "torch":
        return TorchAttentionBackend()
    # Imported lazily: only the triton backend needs triton at all.
    from .triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()
