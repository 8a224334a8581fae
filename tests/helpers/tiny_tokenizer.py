"""A tiny byte-level BPE tokenizer trained offline in well under a second, for tests.

Invariants: deterministic (same corpus, same trainer settings -> same vocab); vocab of
``TINY_VOCAB_SIZE`` ids including the special tokens ``<|endoftext|>`` (id 0, eos and pad),
``<|im_start|>`` (1) and ``<|im_end|>`` (2); byte-level, so *any* text round-trips, and rare
multi-byte characters (emoji, most CJK) are split into several byte tokens that are not valid
UTF-8 on their own -- exactly what incremental detokenization must cope with. It carries a ChatML
``chat_template``. Cost: ~0.1-0.3 s to train; :func:`tiny_tokenizer` caches the result in-process.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

__all__ = [
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "TINY_VOCAB_SIZE",
    "build_tiny_tokenizer",
    "save_tiny_tokenizer",
    "tiny_tokenizer",
    "training_corpus",
]

TINY_VOCAB_SIZE = 400
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_SUBJECTS = ["the cat", "a dog", "my friend", "the engine", "our model", "the café owner",
             "a small bird", "the scheduler", "this token", "every request"]
_VERBS = ["runs", "reads", "writes", "sees", "likes", "builds", "samples", "decodes", "stops",
          "prefers"]
_OBJECTS = ["the red ball", "a long story", "fresh bread", "the paged cache", "many tokens",
            "crème brûlée", "a quiet night", "the blue sky", "naïve code", "some numbers"]
_TAILS = ["today.", "again!", "in Paris.", "at night?", "with joy.", "très bien.", "中文 text.",
          "very fast 🚀.", "slowly... 😀", "for 42 days."]


def training_corpus(num_sentences: int = 400, seed: int = 0) -> list[str]:
    """A few hundred English-ish sentences, some with é/中文/emoji, from a fixed seed."""
    rng = random.Random(seed)
    return [
        f"{rng.choice(_SUBJECTS).capitalize()} {rng.choice(_VERBS)} "
        f"{rng.choice(_OBJECTS)} {rng.choice(_TAILS)}"
        for _ in range(num_sentences)
    ]


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Trains a fresh tokenizer (uncached); prefer :func:`tiny_tokenizer` in tests."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        # Every byte must be in the vocab, or unseen bytes would be unencodable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


@functools.lru_cache(maxsize=1)
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """The process-wide cached tiny tokenizer (do not mutate it)."""
    return build_tiny_tokenizer()


def save_tiny_tokenizer(directory: str | Path) -> Path:
    """Saves the tokenizer into ``directory`` (reloadable with ``AutoTokenizer.from_pretrained``)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tiny_tokenizer().save_pretrained(directory)
    return directory


if __name__ == "__main__":  # quick manual check: python tests/helpers/tiny_tokenizer.py DIR
    import sys
    import time

    t0 = time.perf_counter()
    out = save_tiny_tokenizer(sys.argv[1] if len(sys.argv) > 1 else "/tmp/tiny_tokenizer")
    reloaded = AutoTokenizer.from_pretrained(out)
    print(type(reloaded).__name__, len(reloaded), f"{time.perf_counter() - t0:.2f}s")
