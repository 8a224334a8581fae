"""A tiny SentencePiece-style tokenizer (Llama / Mistral structure) trained offline, for tests.

Structure, as in Llama/Mistral tokenizer.json files: a BPE model with ``byte_fallback=True``
(the 256 ``<0xXX>`` byte tokens are ordinary vocab entries, ids 3..258), a ``Metaspace``
pre-tokenizer (``▁`` for spaces, prepended to the first word), and the decoder
``Sequence[Replace("▁", " "), ByteFallback, Fuse, Strip(" ", 1, 0)]`` -- so a token's text
depends on what precedes it (the very first leading space is stripped) and characters outside
the small trained alphabet (most CJK, emoji) are spelled as byte tokens, several per character.

Invariants: deterministic; special tokens ``<unk>`` (0), ``<s>`` (1, bos), ``</s>`` (2, eos),
all flagged ``special``; the byte tokens follow them. Cost: ~0.1-0.3 s to train;
:func:`sp_tokenizer` caches the result in-process.
"""

from __future__ import annotations

import functools
import json

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from helpers.tiny_tokenizer import training_corpus

__all__ = ["SP_SPECIAL_TOKENS", "build_sp_tokenizer", "sp_tokenizer"]

SP_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
_TRAINED_SIZE = 300  # trainer's vocab (specials + alphabet + merges), before the byte tokens
_BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]


def _train() -> tuple[dict[str, int], list[tuple[str, str]]]:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=_TRAINED_SIZE,
        special_tokens=SP_SPECIAL_TOKENS,
        limit_alphabet=70,  # rare characters (accents, CJK, emoji) stay out: byte fallback
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return model["vocab"], merges


def build_sp_tokenizer() -> PreTrainedTokenizerFast:
    """Trains a fresh tokenizer (uncached); prefer :func:`sp_tokenizer` in tests."""
    trained, merges = _train()
    vocab = {t: i for i, t in enumerate(SP_SPECIAL_TOKENS + _BYTE_TOKENS)}
    for t, _ in sorted(trained.items(), key=lambda kv: kv[1]):
        vocab.setdefault(t, len(vocab))
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([
        decoders.Replace("▁", " "),
        decoders.ByteFallback(),
        decoders.Fuse(),
        decoders.Strip(" ", 1, 0),
    ])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SP_SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        clean_up_tokenization_spaces=False,
    )


@functools.lru_cache(maxsize=1)
def sp_tokenizer() -> PreTrainedTokenizerFast:
    """The process-wide cached SentencePiece-style tokenizer (do not mutate it)."""
    return build_sp_tokenizer()
