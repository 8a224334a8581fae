"""The model creator's default sampling parameters, as vLLM applies them (its
``ModelConfig.get_diff_sampling_param``).

A model's ``generation_config.json`` may recommend a temperature, top-k/top-p/min-p, a repetition
penalty or a token limit (Qwen's instruct models do). vLLM uses them wherever a caller gives no
sampling parameters: ``LLM.generate(prompts)``, ``LLM.chat``, ``LLM.get_default_sampling_params()``,
and every server request field left out. ``EngineArgs.generation_config`` picks the source:
``"auto"`` (the model's file), ``"vllm"`` (none: the neutral defaults; the model's file still
gives its extra EOS ids, as in vLLM) or a folder holding a ``generation_config.json``;
``override_generation_config`` then sets keys on top.

Invariants: only the six keys below are read; the file is read as vLLM reads it, through the
installed transformers' ``GenerationConfig.to_diff_dict()`` (so a value equal to that version's
default is no recommendation), and the overrides are set on top as given; the result is checked
once, at load, by building a ``SamplingParams`` from it, so a bad value is a ``ValueError``
naming its source, never an error of a later request.
Costs: one JSON read per engine.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ferrokv.sampling_params import SamplingParams

__all__ = ["RECOMMENDED_FIELDS", "SOURCES", "check_generation_args", "load_generation_defaults"]

SOURCES = ("auto", "vllm")  # or a folder
# generation_config.json key -> SamplingParams field (vLLM's six).
_KEYS = {"repetition_penalty": "repetition_penalty", "temperature": "temperature", "top_k": "top_k",
         "top_p": "top_p", "min_p": "min_p", "max_new_tokens": "max_tokens"}
RECOMMENDED_FIELDS = frozenset(_KEYS.values())  # the SamplingParams fields a model can recommend
_FILE = "generation_config.json"


def check_generation_args(source: Any, overrides: Any) -> None:
    """``EngineArgs.generation_config`` and ``override_generation_config``, before anything loads."""
    if not isinstance(source, str) or not source:
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder, got {source!r}")
    if source not in SOURCES and not (Path(source).expanduser() / _FILE).is_file():
        raise ValueError(f"generation_config={source!r}: not 'auto' or 'vllm', and no folder with a {_FILE}")
    if overrides is not None:
        if not isinstance(overrides, Mapping) or not all(isinstance(k, str) for k in overrides):
            raise ValueError(f"override_generation_config must be a dict of generation_config keys, got {overrides!r}")


def generation_config_file(source: str, model_path: Path) -> Path | None:
    """The generation_config.json vLLM reads for ``source``, if it exists: the model's for
    ``"auto"`` and ``"vllm"`` (whose sampling defaults are then ignored, but not its EOS ids),
    else the named folder's."""
    path = (model_path if source in SOURCES else Path(source).expanduser()) / _FILE
    return path if path.is_file() else None


def load_generation_defaults(source: str, overrides: Mapping[str, Any] | None, model_path: Path) -> dict[str, Any]:
    """The ``SamplingParams`` fields the model recommends (empty: none), from ``source``'s file
    (``generation_config_file``) with ``overrides`` on top."""
    config: dict[str, Any] = {}
    path = None if source == "vllm" else generation_config_file(source, model_path)
    if path is not None:
        config = _read(path)
    config.update(overrides or {})
    out = {name: config[key] for key, name in _KEYS.items() if config.get(key) is not None}
    try:
        SamplingParams(**out)
    except (ValueError, TypeError) as e:
        raise ValueError(f"generation_config: {defaults_source(source, overrides, model_path)} recommends {out}, "
                         f"which is not valid: {e}") from None
    return out


def defaults_source(source: str, overrides: Mapping[str, Any] | None, model_path: Path) -> str:
    """Where ``load_generation_defaults(source, overrides, model_path)`` takes them from, in words."""
    path = None if source == "vllm" else generation_config_file(source, model_path)
    if path is None:
        return "override_generation_config"
    return f"{path} with override_generation_config" if overrides else str(path)


def _read(path: Path) -> dict[str, Any]:
    """The file's non-default values (transformers' ``to_diff_dict``, as vLLM reads it)."""
    from transformers import GenerationConfig

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"generation_config: cannot read {str(path)!r}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"generation_config: {str(path)!r} must hold a JSON object, got {type(data).__name__}")
    try:
        return GenerationConfig.from_dict(data).to_diff_dict()
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"generation_config: cannot read {str(path)!r}: {e}") from None
