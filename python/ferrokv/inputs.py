"""Prompt forms: what a request's prompt may be, turned into validated token ids.

A prompt is a ``str`` (tokenized), or a dict with ``prompt_token_ids`` (a list or array of ints;
its ``prompt`` text, if any, is kept for the output) or with ``prompt`` (a str).
Invariants: every error is a ``ValueError`` naming the field and the offending value, raised
before anything reaches the engine; valid ids are non-empty, inside the vocabulary and at most
``max_model_len`` long. Costs: O(prompt length).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ferrokv.checks import check_text

__all__ = ["prompt_ids", "validate_prompt_ids"]


def prompt_ids(tokenizer: Any, prompt: Any) -> tuple[str | None, list[int]]:
    """The prompt's text (None when only ids were given) and its token ids."""
    if isinstance(prompt, str):
        return prompt, list(tokenizer.encode(check_text("prompt", prompt)))
    if isinstance(prompt, Mapping):
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if isinstance(ids, (str, bytes)) or not isinstance(ids, (Sequence, np.ndarray)):
                raise ValueError(f"prompt_token_ids must be a list of ints, got {type(ids).__name__}")
            out = []
            for i, t in enumerate(ids):
                if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                    raise ValueError(f"prompt_token_ids[{i}] must be an int, got {t!r}")
                out.append(int(t))
            return prompt.get("prompt"), out
        if "prompt" in prompt and isinstance(prompt["prompt"], str):
            return prompt["prompt"], list(tokenizer.encode(check_text("prompt", prompt["prompt"])))
    raise ValueError(
        f"prompt must be a str or a dict with 'prompt_token_ids' (or 'prompt'), got {type(prompt).__name__}"
    )


def validate_prompt_ids(ids: list[int], vocab_size: int, max_model_len: int) -> None:
    if not ids:
        raise ValueError("prompt_token_ids: the prompt is empty (at least one token is needed)")
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise ValueError(f"prompt_token_ids[{i}]={t} is outside the vocabulary [0, {vocab_size})")
    if len(ids) > max_model_len:
        raise ValueError(
            f"prompt_token_ids: the prompt has {len(ids)} tokens, more than max_model_len={max_model_len}"
        )
