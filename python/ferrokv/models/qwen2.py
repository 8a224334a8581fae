"""Qwen2: Llama with biases on q/k/v (never on o_proj) and an optional per-layer sliding window
(only when ``use_sliding_window`` is true; see ``config.qwen_sliding_windows``)."""
from __future__ import annotations

from typing import Any

from .config import ModelConfig, parse_common, qwen_sliding_windows
from .llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    architecture = "Qwen2ForCausalLM"

    @classmethod
    def parse_config(cls, d: dict[str, Any]) -> ModelConfig:
        return parse_common(
            d, architecture=cls.architecture, qkv_bias=True, o_bias=False, qk_norm=False,
            sliding_windows=qwen_sliding_windows(d), default_max_positions=32768,
        )
