"""Llama for causal LM on a paged KV cache (base class of the Qwen2/Qwen3/Mistral variants).

Interface used by the model runner:
    forward(input_ids [T], positions [T], kv_caches, meta) -> hidden [T, hidden]
    compute_logits(hidden [R, hidden]) -> fp32 logits [R, vocab]
where T is the flattened ragged batch and ``kv_caches[i] = (k_cache, v_cache)`` of layer i, each
``[num_blocks, block_size, num_kv_heads, head_dim]`` (allocated by ``ferrokv.kv_cache.PagedKVCache``).

Invariants: parameter names are the Hugging Face ones; with ``tie_word_embeddings`` the LM head *is*
the embedding parameter. RoPE cos/sin are computed once per forward; attention metadata plans are
cached in ``meta`` so per-layer work does not grow with the number of sequences (except one SDPA per
prefill sequence in the torch backend). Subclasses override ``parse_config`` only.
"""
from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..attention import AttentionBackend, get_attention_backend
from ..attention.metadata import AttentionMetadata
from .config import ModelConfig, config_flag, parse_common
from .layers import DecoderLayer, RMSNorm
from .rope import RotaryEmbedding

# Buffers some older checkpoints carry; they are recomputed, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class _Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    architecture = "LlamaForCausalLM"

    @classmethod
    def parse_config(cls, d: dict[str, Any]) -> ModelConfig:
        bias = config_flag(d, "attention_bias")
        # Only Llama's MLP has the option; Qwen2/Qwen3/Mistral ignore the key, as transformers does.
        return parse_common(d, architecture=cls.architecture, qkv_bias=bias, o_bias=bias, qk_norm=False,
                            mlp_bias=config_flag(d, "mlp_bias"))

    def __init__(self, config: ModelConfig | dict[str, Any], attn_backend: str | AttentionBackend = "auto") -> None:
        super().__init__()
        if isinstance(config, dict):
            config = self.parse_config(config)
        self.config = config
        self.model = _Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(config.rope)
        self._backend_spec = attn_backend
        self._backend: AttentionBackend | None = None if isinstance(attn_backend, str) else attn_backend

    # ---------------------------------------------------------------------------------------------
    @property
    def attn_backend(self) -> AttentionBackend | None:
        return self._backend

    def set_attn_backend(self, backend: str | AttentionBackend) -> None:
        self._backend_spec = backend
        self._backend = None if isinstance(backend, str) else backend

    def _resolve_backend(self, device: torch.device) -> AttentionBackend:
        if self._backend is None:
            self._backend = get_attention_backend(self._backend_spec, device)
        return self._backend

    # ---------------------------------------------------------------------------------------------
    @torch.no_grad()  # not inference_mode: caches written here must stay usable outside it
    def forward(
        self,
        input_ids: Tensor,  # int64 [T]
        positions: Tensor,  # int64 [T]
        kv_caches: list[tuple[Tensor, Tensor]],
        meta: AttentionMetadata,
    ) -> Tensor:
        if len(kv_caches) != self.config.num_hidden_layers:
            raise ValueError(f"kv_caches has {len(kv_caches)} layers, the model {self.config.num_hidden_layers}")
        backend = self._resolve_backend(input_ids.device)
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, meta)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for layer, kv in zip(self.model.layers, kv_caches):
            x = layer(x, cos, sin, kv, meta, backend)
        return self.model.norm(x)

    @torch.no_grad()  # not inference_mode: caches written here must stay usable outside it
    def compute_logits(self, hidden: Tensor) -> Tensor:
        return F.linear(hidden, self.lm_head.weight).float()

    # ---------------------------------------------------------------------------------------------
    def expected_weight_names(self) -> list[str]:
        names = [n for n, _ in self.named_parameters(remove_duplicate=False)]
        if self.config.tie_word_embeddings:
            names = [n for n in names if n != "lm_head.weight"]
        return names

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Copy checkpoint tensors in by Hugging Face name (casting to the parameter dtype/device).

        Raises ValueError naming missing weights or mismatched shapes; unknown names only warn.
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        expected = set(self.expected_weight_names())
        seen: set[str] = set()
        unexpected: list[str] = []
        head_rows: Tensor | None = None  # a tied config's own lm_head, sampled rows: checked against the embedding
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                head_rows = _spread_rows(tensor).clone()
                continue  # tied: the embedding is the head (vLLM's rule)
            p = params.get(name)
            if p is None:
                unexpected.append(name)
                continue
            if tuple(tensor.shape) != tuple(p.shape):
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(p.shape)}")
            p.copy_(tensor)
            seen.add(name)
        missing = sorted(expected - seen)
        if missing:
            shown = ", ".join(missing[:8]) + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else "")
            raise ValueError(f"checkpoint is missing weight(s): {shown}")
        if unexpected:
            warnings.warn(f"ignored {len(unexpected)} unexpected checkpoint tensor(s), e.g. {unexpected[:4]}", stacklevel=2)
        embed = params["model.embed_tokens.weight"]
        if head_rows is not None and not torch.equal(head_rows.to(embed.dtype),
                                                     _spread_rows(embed).to(head_rows.device)):
            warnings.warn("config.json ties the output head to the embedding (tie_word_embeddings), but the checkpoint "
                          "has a different lm_head.weight: the embedding is the head, as in vLLM (transformers uses "
                          "the checkpoint's); set tie_word_embeddings to false to use it", stacklevel=2)


def _spread_rows(weight: Tensor) -> Tensor:
    """9 rows spread over ``weight``, its first and last included: enough to tell two heads apart."""
    return weight[torch.linspace(0, weight.shape[0] - 1, 9, device=weight.device).long()]
