"""Model hyper-parameters parsed from a Hugging Face ``config.json`` dict (no transformers objects).

Invariants: every field the model needs is resolved here once (per-architecture defaults, both the
transformers 4.x layout ``rope_theta`` + ``rope_scaling`` and the 5.x layout ``rope_parameters``),
so model code never looks at the raw dict. Per-layer sliding windows are explicit (None = full
attention). Unsupported settings raise ``ValueError`` naming the field instead of silently
computing something else.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from ferrokv.checks import shown

logger = logging.getLogger("ferrokv")

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
# hidden_act names (transformers' ACT2FN names; "swish" is its other name for silu): the one list
# the loader checks and ``layers`` implements.
ACTIVATIONS = ("silu", "swish", "gelu", "gelu_pytorch_tanh", "relu")


@dataclass(slots=True, frozen=True)
class RopeConfig:
    rope_type: str  # one of SUPPORTED_ROPE_TYPES
    theta: float
    head_dim: int  # rotary dimension (= head_dim; partial rotary is not supported)
    max_position_embeddings: int
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int | None = None  # llama3, yarn
    # yarn (transformers' names and defaults; attention_factor None: derived from factor and mscale*)
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


@dataclass(slots=True, frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    sliding_windows: tuple[int | None, ...]  # per layer
    rope: RopeConfig
    # vLLM's default context, and how config.json gives it (for messages): ``default_context``
    default_max_model_len: int
    default_max_model_len_rule: str
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None


def _req(d: dict[str, Any], key: str) -> Any:
    if d.get(key) is None:
        raise ValueError(f"config.json: required field {key!r} is missing")
    return d[key]


def _count(d: dict[str, Any], key: str, default: int | None = None) -> int:
    """A positive integer field (``default`` when absent; required when there is none). A JSON
    null is a value here, and a wrong one: transformers would keep it and fail later."""
    if key not in d and default is not None:
        return default
    v = _req(d, key) if default is None else d[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v) or v < 1:
        raise ValueError(f"config.json: {key} must be a positive integer, got {v!r}")
    return int(v)


def parse_rope(d: dict[str, Any], head_dim: int, max_pos: int) -> RopeConfig:
    """Read RoPE settings from either layout: 5.x ``rope_parameters`` (holds rope_theta too) or 4.x
    ``rope_theta`` + ``rope_scaling`` (``type`` or ``rope_type`` key). Both present (a 4.x-style
    ``rope_scaling`` given as an override to a 5.x config): the scaling's keys win. ``max_pos``: the
    model's resolved ``max_position_embeddings``."""
    params, scaling = d.get("rope_parameters") or {}, d.get("rope_scaling") or {}
    for name, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if not isinstance(value, dict):
            raise ValueError(f"config.json: {name} must be a dict, got {value!r}")
    if scaling and "rope_theta" in params and "rope_theta" not in scaling and d.get("rope_theta") is None:
        # transformers drops rope_parameters for rope_scaling here, and its rope_theta with it.
        logger.warning("config.json has rope_scaling beside rope_parameters: ferrokv keeps rope_parameters' "
                       "rope_theta=%s under rope_scaling's keys; transformers (and vLLM through it) would take the "
                       "default rope_theta instead", params["rope_theta"])
    if scaling:
        params = {k: v for k, v in params.items() if not ("type" in scaling and k == "rope_type")} | scaling
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError("config.json: per-layer-type rope_parameters are not supported")
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"config.json: rope_type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    prf = params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if prf not in (None, 1, 1.0):
        raise ValueError(f"config.json: partial_rotary_factor={prf} is not supported")
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    if rope_type != "default" and "factor" not in params:  # as transformers and vLLM require it
        raise ValueError(f"config.json: rope_type {rope_type!r} needs a 'factor'")
    orig = params.get("original_max_position_embeddings")
    if rope_type in ("llama3", "yarn"):  # transformers: a top-level value wins; default: the model's positions
        orig = d.get("original_max_position_embeddings") or orig or max_pos
    factor = _positive(params.get("factor", 1.0), "rope factor")
    theta = _positive(theta, "rope_theta")
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor"):
            if key not in params:
                raise ValueError(f"config.json: rope_type 'llama3' needs {key!r}")
    return RopeConfig(
        rope_type=rope_type,
        theta=theta,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        factor=factor,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(orig) if orig is not None else None,
        **(_yarn(params) if rope_type == "yarn" else {}),
    )


def _positive(value: Any, name: str) -> float:
    """A real number of config.json: finite and > 0 (a numeric string is read as its number)."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        v = math.nan
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"config.json: {name} must be a number > 0, got {value!r}")
    return v


def _yarn(params: dict[str, Any]) -> dict[str, Any]:
    def opt(key: str) -> float | None:
        return None if params.get(key) is None else float(params[key])

    return dict(attention_factor=opt("attention_factor"), beta_fast=opt("beta_fast") or 32.0,
                beta_slow=opt("beta_slow") or 1.0, mscale=opt("mscale"), mscale_all_dim=opt("mscale_all_dim"),
                truncate=config_flag(params, "truncate", True, "rope truncate"))


def config_flag(d: dict[str, Any], key: str, default: bool = False, name: str | None = None) -> bool:
    """A true/false field; absent or null is ``default``, as transformers reads it. Anything else
    (the string "false" is truthy) is refused, as transformers' strict config validation does."""
    v = d.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ValueError(f"config.json: {name or key} must be true or false, got {v!r}")
    return v


def parse_common(
    d: dict[str, Any],
    *,
    architecture: str,
    qkv_bias: bool,
    o_bias: bool,
    qk_norm: bool,
    sliding_windows: tuple[int | None, ...] | None = None,
    default_head_dim: int | None = None,
    default_max_positions: int = 2048,
    mlp_bias: bool = False,
) -> ModelConfig:
    """The fields every architecture shares; ``default_max_positions`` is the transformers config
    class's ``max_position_embeddings`` (vLLM's default context when config.json has none)."""
    hidden = _count(d, "hidden_size")
    heads = _count(d, "num_attention_heads")
    layers = _count(d, "num_hidden_layers")
    # Absent means multi-head attention here; some transformers classes default differently (Qwen2: 32,
    # Mistral: 8), which no smaller model's weights match, and every real checkpoint states it.
    kv_heads = heads if d.get("num_key_value_heads") is None else _count(d, "num_key_value_heads")
    if heads % kv_heads:
        raise ValueError(f"config.json: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    head_dim = _count(d, "head_dim") if d.get("head_dim") is not None else default_head_dim or hidden // heads
    if head_dim % 2:  # RoPE rotates pairs of dimensions (transformers refuses it too)
        raise ValueError(f"config.json: head_dim must be even for rotary embeddings, got {head_dim}")
    act = d.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise ValueError(f"config.json: hidden_act {act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    if sliding_windows is None:
        sliding_windows = (None,) * layers
    max_pos = _count(d, "max_position_embeddings", default_max_positions)
    rope = parse_rope(d, head_dim, max_pos)
    context, rule = default_context(d, rope)
    return ModelConfig(
        architecture=architecture,
        vocab_size=_count(d, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_count(d, "intermediate_size"),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_positive(d.get("rms_norm_eps", 1e-6), "rms_norm_eps"),
        hidden_act=act,
        max_position_embeddings=max_pos,
        tie_word_embeddings=config_flag(d, "tie_word_embeddings"),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=mlp_bias,
        qk_norm=qk_norm,
        sliding_windows=tuple(sliding_windows),
        rope=rope,
        default_max_model_len=context,
        default_max_model_len_rule=rule,
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=d.get("eos_token_id"),
    )


# The keys vLLM reads a model's context from: the smallest one given wins (a Command-R style
# ``model_max_length`` overrides them), before a RoPE scaling factor counts.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_target_positions",
                "max_sequence_length", "max_seq_length", "seq_len")


def default_context(d: dict[str, Any], rope: RopeConfig) -> tuple[int, str]:
    """vLLM's default ``max_model_len`` and the rule that gives it: the context keys' smallest
    (``max_position_embeddings`` resolved with its class default), times a linear or dynamic
    factor; yarn: the original positions times its factor; llama3 counts it in its positions."""
    given = {key: _count(d, key) for key in CONTEXT_KEYS[1:] if d.get(key) is not None}
    given["max_position_embeddings"] = rope.max_position_embeddings
    key = min(given, key=lambda k: (given[k], k != "max_position_embeddings"))
    if d.get("model_max_length") is not None:
        key, given["model_max_length"] = "model_max_length", _count(d, "model_max_length")
    if rope.rope_type in ("linear", "dynamic"):
        return int(given[key] * rope.factor), f"config.json's {key} times its RoPE factor {rope.factor:g}"
    if rope.rope_type == "yarn":
        orig = rope.original_max_position_embeddings or rope.max_position_embeddings
        return int(orig * rope.factor), f"the RoPE's original_max_position_embeddings times its factor {rope.factor:g}"
    return given[key], f"config.json's {key}"


def qwen_sliding_windows(d: dict[str, Any]) -> tuple[int | None, ...]:
    """Qwen2/Qwen3: a window (``sliding_window``, 4096 when the key is absent, none when null)
    applies only when ``use_sliding_window`` is true, and then only on the layers ``layer_types``
    marks ``sliding_attention`` (default: layers >= ``max_window_layers``), exactly as
    transformers resolves it."""
    layers = _count(d, "num_hidden_layers")
    # An absent sliding_window is Qwen2Config's and Qwen3Config's 4096.
    if not config_flag(d, "use_sliding_window") or d.get("sliding_window", 4096) is None:
        return (None,) * layers
    first = _count(d, "max_window_layers", 28) if d.get("max_window_layers") != 0 else 0
    return _windows_by_layer_type(d, _count(d, "sliding_window", 4096),
                                  ["sliding_attention" if i >= first else "full_attention" for i in range(layers)])


def mistral_sliding_windows(d: dict[str, Any]) -> tuple[int | None, ...]:
    """Mistral: ``sliding_window`` (transformers' default 4096 when the key is absent; null: none)
    on every layer, or only on those ``layer_types`` marks ``sliding_attention`` (Ministral's
    alternating layers, as transformers and vLLM read them)."""
    layers = _count(d, "num_hidden_layers")
    if d.get("sliding_window", 4096) is None:
        return (None,) * layers
    return _windows_by_layer_type(d, _count(d, "sliding_window", 4096), ["sliding_attention"] * layers)


def _windows_by_layer_type(d: dict[str, Any], window: int, default: list[str]) -> tuple[int | None, ...]:
    layer_types = d.get("layer_types")
    if layer_types is None:
        layer_types = default
    if not isinstance(layer_types, list) or len(layer_types) != len(default):
        raise ValueError(f"config.json: layer_types must list one entry per layer ({len(default)}), "
                         f"got {shown(layer_types)}")
    unknown = set(layer_types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ValueError(f"config.json: layer_types entries must be 'full_attention' or 'sliding_attention', "
                         f"got {sorted(map(str, unknown))}")
    return tuple(window if t == "sliding_attention" else None for t in layer_types)
