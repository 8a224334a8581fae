"""Qwen3: Llama with per-head RMSNorm on q and k (``q_norm``/``k_norm`` over head_dim, before RoPE),
``attention_bias`` on all four projections, ``head_dim`` defaulting to 128, and the Qwen sliding
window rules (``use_sliding_window`` + ``layer_types``/``max_window_layers``)."""
from __future__ import annotations

from typing import Any

from .config import ModelConfig, config_flag, parse_common, qwen_sliding_windows
from .llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    architecture = "Qwen3ForCausalLM"

    @classmethod
    def parse_config(cls, d: dict[str, Any]) -> ModelConfig:
        bias = config_flag(d, "attention_bias")
        return parse_common(
            d, architecture=cls.architecture, qkv_bias=bias, o_bias=bias, qk_norm=True,
            sliding_windows=qwen_sliding_windows(d), default_head_dim=128, default_max_positions=32768,
        )
