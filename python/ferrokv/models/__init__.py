"""Model registry: Hugging Face ``architectures`` name -> our implementation class.

Invariant: every class here implements ``forward(input_ids, positions, kv_caches, meta)`` and
``compute_logits(hidden)`` on a paged KV cache, and loads Hugging Face weight names.
"""
from __future__ import annotations

from typing import Any

from .config import ModelConfig
from .llama import LlamaForCausalLM
from .mistral import MinistralForCausalLM, MistralForCausalLM
from .qwen2 import Qwen2ForCausalLM
from .qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    cls.architecture: cls
    for cls in (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM, MinistralForCausalLM)
}

# A config.json without ``architectures`` names its class by ``model_type``, as transformers'
# AutoModelForCausalLM reads it ("llama" -> LlamaForCausalLM).
_BY_MODEL_TYPE = {name.removesuffix("ForCausalLM").lower(): cls for name, cls in MODEL_REGISTRY.items()}

__all__ = [
    "MODEL_REGISTRY",
    "ModelConfig",
    "LlamaForCausalLM",
    "MinistralForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "resolve_model_class",
]


def resolve_model_class(config: dict[str, Any]) -> type[LlamaForCausalLM]:
    """Class for a config.json dict: the first entry of ``architectures`` we implement (vLLM tries
    each in turn), else, with no ``architectures`` at all, the one of its ``model_type`` (as
    transformers' auto class); ValueError lists the supported ones and says that remote code
    (``auto_map``, ``trust_remote_code``) is never executed."""
    archs = config.get("architectures") or []
    if not archs:
        model_type = config.get("model_type")
        if isinstance(model_type, str) and model_type in _BY_MODEL_TYPE:
            return _BY_MODEL_TYPE[model_type]
        raise ValueError(f"unsupported model: config.json names no 'architectures' and its model_type is "
                         f"{model_type!r}; supported model types: {', '.join(sorted(_BY_MODEL_TYPE))}")
    if not isinstance(archs, list):
        raise ValueError(f"config.json: field 'architectures' must be a list of class names, got {archs!r}")
    cls = next((MODEL_REGISTRY[a] for a in archs if isinstance(a, str) and a in MODEL_REGISTRY), None)
    if cls is None:
        remote = (" (its config.json has auto_map: it needs the model's own remote code, which ferrokv never "
                  "executes, whatever trust_remote_code says)") if "auto_map" in config else ""
        raise ValueError(
            f"unsupported model: config field 'architectures' is {archs!r}{remote}; "
            f"supported architectures: {', '.join(sorted(MODEL_REGISTRY))}"
        )
    return cls
