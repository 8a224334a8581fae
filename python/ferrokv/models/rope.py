"""Rotary position embedding (rotate-half convention, as Hugging Face Llama/Qwen/Mistral).

Invariants: inverse frequencies are computed in fp32 with the same formulas and operation order as
transformers (default, linear, llama3, dynamic NTK) so positions map to bit-identical angles; cos/sin
are computed once per forward for the step's tokens (``[T, head_dim/2]``) and shared by all layers,
then cast to the activation dtype like transformers does.

Dynamic NTK: transformers rescales the base from the largest position seen in the current call (a
batch-wide, stateful quantity). Here it is per sequence: a token of a sequence whose context length
after this step is ``L > max_position_embeddings`` uses the base for ``L``, else the original
frequencies. For one sequence fed as one prefill and then single-token decodes this equals
transformers exactly; a chunked prefill uses each chunk's end length (as a transformers cache would).
Cost: O(T * head_dim) per step; dynamic adds O(T * head_dim) pow ops only when a sequence is long.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from ..attention.metadata import AttentionMetadata
from .config import RopeConfig


def _base_inv_freq(theta: float, dim: int) -> Tensor:
    # Explicit CPU: models are built under ``torch.device("meta")`` by the loader.
    exps = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(dtype=torch.float) / dim
    return 1.0 / (theta**exps)


def compute_inv_freq(cfg: RopeConfig) -> Tensor:
    """fp32 [dim/2] inverse frequencies for positions within ``max_position_embeddings``."""
    dim = cfg.head_dim
    if cfg.rope_type == "default":
        return _base_inv_freq(cfg.theta, dim)
    if cfg.rope_type == "linear":
        return _base_inv_freq(cfg.theta, dim) / cfg.factor
    if cfg.rope_type == "dynamic":
        # transformers' initial value: the NTK formula evaluated (in Python floats) at max_position.
        mp = cfg.max_position_embeddings
        base = cfg.theta * ((cfg.factor * mp / mp) - (cfg.factor - 1)) ** (dim / (dim - 2))
        return _base_inv_freq(base, dim)
    if cfg.rope_type == "llama3":
        inv_freq = _base_inv_freq(cfg.theta, dim)
        factor, lo, hi = cfg.factor, cfg.low_freq_factor, cfg.high_freq_factor
        old_ctx = cfg.original_max_position_embeddings
        low_freq_wavelen = old_ctx / lo
        high_freq_wavelen = old_ctx / hi
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, inv_freq_llama)
    raise ValueError(f"rope_type {cfg.rope_type!r} is not supported")


class RotaryEmbedding:
    """Not an nn.Module on purpose: ``model.to(bfloat16)`` must not round the fp32 frequencies."""

    def __init__(self, cfg: RopeConfig) -> None:
        self.cfg = cfg
        self._inv_freq = compute_inv_freq(cfg)
        self._by_device: dict[torch.device, Tensor] = {}

    def inv_freq(self, device: torch.device) -> Tensor:
        t = self._by_device.get(device)
        if t is None:
            t = self._by_device[device] = self._inv_freq.to(device)
        return t

    def cos_sin(self, positions: Tensor, meta: AttentionMetadata | None = None) -> tuple[Tensor, Tensor]:
        """fp32 cos, sin of shape [T, head_dim/2] for int positions [T]."""
        inv = self.inv_freq(positions.device)
        cfg = self.cfg
        if cfg.rope_type == "dynamic" and meta is not None and meta.max_seq_len > cfg.max_position_embeddings:
            freqs = positions[:, None].float() * self._dynamic_inv_freq(positions, meta, inv)
        else:
            freqs = positions[:, None].float() * inv[None, :]
        return freqs.cos(), freqs.sin()

    def _dynamic_inv_freq(self, positions: Tensor, meta: AttentionMetadata, inv: Tensor) -> Tensor:
        cfg = self.cfg
        dim = cfg.head_dim
        mp = cfg.max_position_embeddings
        dev = positions.device
        q_lens = torch.from_numpy(meta.query_lens_host)
        lens = torch.from_numpy(meta.seq_lens_host)
        tok_len = torch.zeros(positions.shape[0], dtype=torch.int64)
        tok_len[: int(q_lens.sum())] = torch.repeat_interleave(lens, q_lens)
        tok_len = tok_len.to(dev)
        # Same fp32 tensor arithmetic as transformers' update path (seq_len is a tensor there).
        base = cfg.theta * ((cfg.factor * tok_len / mp) - (cfg.factor - 1)) ** (dim / (dim - 2))
        exps = torch.arange(0, dim, 2, dtype=torch.int64, device=dev).to(dtype=torch.float) / dim
        scaled = 1.0 / (base[:, None] ** exps[None, :])
        return torch.where((tok_len > mp)[:, None], scaled, inv[None, :])


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, heads, D]; cos/sin [T, D/2] in x's dtype. Rotate-half: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
