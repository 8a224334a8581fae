"""Mistral: Llama without biases, with a ``sliding_window`` (a token at position p sees keys at
positions > p - sliding_window) on every layer, or on the layers ``layer_types`` marks
(``ferrokv.models.config.mistral_sliding_windows``)."""
from __future__ import annotations

from typing import Any

from .config import ModelConfig, mistral_sliding_windows, parse_common
from .llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    architecture = "MistralForCausalLM"

    @classmethod
    def parse_config(cls, d: dict[str, Any]) -> ModelConfig:
        return parse_common(d, architecture=cls.architecture, qkv_bias=False, o_bias=False, qk_norm=False,
                            sliding_windows=mistral_sliding_windows(d), default_max_positions=131072)


class MinistralForCausalLM(MistralForCausalLM):
    """transformers' name (``model_type`` "ministral") for a Mistral whose ``layer_types`` mark its
    sliding layers: the same model, as transformers saves it back."""

    architecture = "MinistralForCausalLM"
