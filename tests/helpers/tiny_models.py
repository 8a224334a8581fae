"""Tiny random Hugging Face checkpoints for tests (2 layers, hidden 64, fp32), saved with
``save_pretrained`` so they exercise the same config.json/safetensors path as real models.

Invariants: deterministic for a given seed; weights are re-drawn with a larger spread than the HF
initialiser (norm weights around 1, not exactly 1; non-zero biases) so that every parameter
matters in a logits comparison. Cost: well under a second per model.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = ["ARCHITECTURES", "TINY_VOCAB", "make_tiny_hf_model", "save_tiny_model"]

# Matches tests/helpers/tiny_tokenizer.TINY_VOCAB_SIZE so the two can be combined.
TINY_VOCAB = 400

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")


def _config(arch: str, **kw: Any):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig}[arch]
    return cls(**kw)


def make_tiny_hf_model(
    arch: str = "llama",
    *,
    hidden_size: int = 64,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int | None = None,
    num_hidden_layers: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = TINY_VOCAB,
    sliding_window: int | None = None,
    tie_word_embeddings: bool = False,
    rope_scaling: dict[str, Any] | None = None,
    rope_theta: float = 10000.0,
    max_position_embeddings: int = 512,
    attention_bias: bool = False,
    seed: int = 0,
    **extra: Any,
):
    """A random transformers model (eval mode, fp32, eager attention)."""
    from transformers import AutoModelForCausalLM

    kw: dict[str, Any] = dict(
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        num_hidden_layers=num_hidden_layers,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=0,
        pad_token_id=0,
    )
    rope = {"rope_type": "default", "rope_theta": rope_theta}
    if rope_scaling:
        rope = {**rope, **rope_scaling}
    kw["rope_parameters"] = rope
    if head_dim is not None:
        kw["head_dim"] = head_dim
    elif arch == "qwen3":
        kw["head_dim"] = hidden_size // num_attention_heads  # Qwen3's own default (128) is far too big here
    if arch in ("llama", "qwen3"):
        kw["attention_bias"] = attention_bias
    if arch == "mistral":
        kw["sliding_window"] = sliding_window
    elif arch in ("qwen2", "qwen3"):
        kw["use_sliding_window"] = sliding_window is not None
        kw["sliding_window"] = sliding_window
    elif sliding_window is not None:
        raise ValueError("llama has no sliding window")
    kw.update(extra)
    torch.manual_seed(seed)
    cfg = _config(arch, **kw)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))
    return model.eval()


def save_tiny_model(path: str | Path, arch: str = "llama", **kw: Any) -> Path:
    """Build a tiny random model with :func:`make_tiny_hf_model` and ``save_pretrained`` it to ``path``."""
    path = Path(path)
    model = make_tiny_hf_model(arch, **kw)
    model.save_pretrained(path)
    return path
