"""A tiny checkpoint whose greedy output follows a chosen chain of tokens, for tests of what the
server reads out of a model's text (reasoning tags, tool calls) end to end.

How: the attention and MLP outputs are zeroed, so the last hidden state is the current token's
embedding (normalised); the LM head's row of each chain token's successor is that token's
embedding, scaled, and every other row is zero. Greedy decoding then maps each chain token to its
successor (random 64-dim embeddings are near-orthogonal, so the own row wins by a wide margin).
Invariants: chain tokens are distinct; the tokenizer is the tiny one plus ``added`` tokens
(not special, as Qwen's ``<think>`` tags), appended after its vocabulary. Cost: under a second.
"""

from __future__ import annotations

from pathlib import Path

import torch

from helpers.tiny_models import TINY_VOCAB, make_tiny_hf_model
from helpers.tiny_tokenizer import save_tiny_tokenizer

__all__ = ["save_chain_model"]


def save_chain_model(path: str | Path, added: list[str], chain: list[int | str]) -> dict[str, int]:
    """Saves the model and tokenizer to ``path``; ``chain`` names tokens by id or by an ``added``
    token's text. Returns the added tokens' ids."""
    from transformers import AutoTokenizer

    path = Path(path)
    tok = AutoTokenizer.from_pretrained(save_tiny_tokenizer(path))  # a copy: the cached one stays as it is
    tok.add_tokens(added)
    ids = {t: tok.convert_tokens_to_ids(t) for t in added}
    steps = [ids[t] if isinstance(t, str) else t for t in chain]
    assert len(set(steps)) == len(steps), "chain tokens must be distinct"
    model = make_tiny_hf_model("llama", vocab_size=TINY_VOCAB + len(added))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        head.zero_()
        for a, b in zip(steps, steps[1:]):
            head[b] = 10.0 * emb[a]
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return ids
