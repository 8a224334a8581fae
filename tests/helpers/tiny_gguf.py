"""A tiny Llama written as a GGUF file (float32 tensors, the tiny BPE tokenizer as ``gpt2`` tokenizer
metadata), for the GGUF conversion path without the ~20 s of the embedded SmolLM2.

``write_tiny_gguf(path, tokenizer=True)`` returns the transformers model whose weights it wrote
(llama.cpp's layout: q/k rows permuted for its rotary pairing, HF names mapped to GGUF's).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from helpers.tiny_models import make_tiny_hf_model
from helpers.tiny_tokenizer import build_tiny_tokenizer

_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}
_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def _llama_cpp_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (transformers' GGUF reader undoes it)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_tokenizer(writer: Any, vocab_size: int) -> None:
    spec = json.loads(build_tiny_tokenizer().backend_tokenizer.to_str())
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    for text, i in spec["model"]["vocab"].items():
        if i < vocab_size:
            tokens[i] = text
    for added in spec.get("added_tokens", []):
        tokens[added["id"]] = added["content"]
    merges = [" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i < 3 else 1 for i in range(vocab_size)])  # 3: control (the specials)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(0)


def write_tiny_gguf(path: str | Path, tokenizer: bool = True, seed: int = 0) -> Any:
    from gguf import GGUFWriter

    model = make_tiny_hf_model("llama", seed=seed)
    cfg = model.config
    w = GGUFWriter(str(path), "llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]))
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(0)  # all float32
    if tokenizer:
        _write_tokenizer(w, cfg.vocab_size)
    for name, t in model.state_dict().items():
        if name in _TOP:
            gguf_name = _TOP[name]
        else:
            parts = name.split(".")  # model.layers.<i>.<module>.<weight|bias>
            gguf_name = f"blk.{parts[2]}.{_LAYER['.'.join(parts[3:-1])]}.{parts[-1]}"
        a = t.detach().float().numpy()
        if gguf_name.endswith("attn_q.weight"):
            a = _llama_cpp_rows(a, cfg.num_attention_heads)
        elif gguf_name.endswith("attn_k.weight"):
            a = _llama_cpp_rows(a, cfg.num_key_value_heads)
        w.add_tensor(gguf_name, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model
