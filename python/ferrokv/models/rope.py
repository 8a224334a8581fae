"""Rotary position embedding (rotate-half convention, as Hugging Face Llama/Qwen/Mistral).

Invariants: inverse frequencies are computed in fp32 with the same formulas and operation order as
transformers (default, linear, llama3, dynamic NTK, YaRN with its cos/sin attention factor) so
positions map to bit-identical angles; cos/sin
are computed once per forward for the step's tokens (``[T, head_dim/2]``) and shared by all layers,
then cast to the activation dtype like transformers does.

Dynamic NTK: transformers rescales the base from the largest position of the current call, and
``generate`` computes a prompt in one call, then one token per call. Here it is per token, with the
same result however a prompt is chunked or recomputed: a token at position ``p`` of a sequence whose
prompt has ``P`` tokens uses the base for ``L = max(P, p + 1)`` when ``L > max_position_embeddings``,
else the original frequencies. So a prompt token's key depends on its prompt's length, and equal
prefixes of prompts of different lengths differ: the engine turns prefix caching off when
``max_model_len`` lets a prompt be that long (``dynamic_rope_rescales``).
Cost: O(T * head_dim) per step; dynamic adds O(T * head_dim) pow ops only when a sequence is long.
"""
from __future__ import annotations

import math

import numpy as np
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
    if cfg.rope_type == "yarn":
        return _yarn_inv_freq(cfg)
    raise ValueError(f"rope_type {cfg.rope_type!r} is not supported")


def _yarn_inv_freq(cfg: RopeConfig) -> Tensor:
    """YaRN: interpolated (divided by ``factor``) below the correction range, extrapolated
    (unchanged) above it, a linear ramp between (transformers' ``_compute_yarn_parameters``)."""
    dim, base, factor = cfg.head_dim, cfg.theta, cfg.factor
    orig = cfg.original_max_position_embeddings or cfg.max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(cfg.beta_fast), correction_dim(cfg.beta_slow)
    if cfg.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # the extrapolation's share
    return interpolation * (1 - keep) + extrapolation * keep


def attention_scaling(cfg: RopeConfig) -> float:
    """The factor cos and sin are multiplied by: YaRN's attention factor, else 1."""
    if cfg.rope_type != "yarn":
        return 1.0
    if cfg.attention_factor is not None:
        return cfg.attention_factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if cfg.mscale and cfg.mscale_all_dim:
        return float(mscale(cfg.factor, cfg.mscale) / mscale(cfg.factor, cfg.mscale_all_dim))
    return mscale(cfg.factor)


class RotaryEmbedding:
    """Not an nn.Module on purpose: ``model.to(bfloat16)`` must not round the fp32 frequencies."""

    def __init__(self, cfg: RopeConfig) -> None:
        self.cfg = cfg
        self._inv_freq = compute_inv_freq(cfg)
        self._scaling = attention_scaling(cfg)
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
        if cfg.rope_type == "dynamic" and meta is not None and _longest(meta) > cfg.max_position_embeddings:
            freqs = positions[:, None].float() * self._dynamic_inv_freq(positions, meta, inv)
        else:
            freqs = positions[:, None].float() * inv[None, :]
        if self._scaling != 1.0:
            return freqs.cos() * self._scaling, freqs.sin() * self._scaling
        return freqs.cos(), freqs.sin()

    def _dynamic_inv_freq(self, positions: Tensor, meta: AttentionMetadata, inv: Tensor) -> Tensor:
        cfg = self.cfg
        dim = cfg.head_dim
        mp = cfg.max_position_embeddings
        dev = positions.device
        q_lens = torch.from_numpy(meta.query_lens_host)
        prompt = torch.from_numpy(np.asarray(meta.prompt_lens_host, dtype=np.int64))
        n = int(q_lens.sum())
        prompt_of_tok = torch.zeros(positions.shape[0], dtype=torch.int64)  # padding rows: 0
        prompt_of_tok[:n] = torch.repeat_interleave(prompt, q_lens)
        tok_len = torch.maximum(prompt_of_tok.to(dev), positions + 1)
        # Same fp32 tensor arithmetic as transformers' update path (seq_len is a tensor there).
        base = cfg.theta * ((cfg.factor * tok_len / mp) - (cfg.factor - 1)) ** (dim / (dim - 2))
        exps = torch.arange(0, dim, 2, dtype=torch.int64, device=dev).to(dtype=torch.float) / dim
        scaled = 1.0 / (base[:, None] ** exps[None, :])
        return torch.where((tok_len > mp)[:, None], scaled, inv[None, :])


def _longest(meta: AttentionMetadata) -> int:
    """The largest ``L`` of the step's tokens: its longest context or prompt."""
    prompts = meta.prompt_lens_host
    return max(meta.max_seq_len, int(prompts.max()) if prompts is not None and len(prompts) else 0)


def dynamic_rope_rescales(cfg: RopeConfig, max_model_len: int) -> bool:
    """Whether dynamic NTK RoPE can rescale a token (a context longer than the model's positions)."""
    return cfg.rope_type == "dynamic" and max_model_len > cfg.max_position_embeddings


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, heads, D]; cos/sin [T, D/2] in x's dtype. Rotate-half: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
