"""Mistral: Llama without biases and with ``sliding_window`` on every layer when it is not null
(a token at position p sees keys at positions > p - sliding_window)."""
from __future__ import annotations

from typing import Any

from .config import ModelConfig, parse_common
from .llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    architecture = "MistralForCausalLM"

    @classmethod
    def parse_config(cls, d: dict[str, Any]) -> ModelConfig:
        window = d.get("sliding_window")
        layers = int(d.get("num_hidden_layers") or 0)
        windows = (int(window) if window else None,) * layers
        return parse_common(
            d, architecture=cls.architecture, qkv_bias=False, o_bias=False, qk_norm=False, sliding_windows=windows
        )
