"""The final text of vLLM's incremental detokenizer, computed with one-shot decodes: the oracle the
detokenizer tests compare with (byte-level tokenizers, where the decode of a prefix of the ids is
a prefix of the decode).

vLLM's rule: a token's text is emitted once what pends adds a character and does not end in the
middle of one (U+FFFD), or, after ``MAX_PENDING`` tokens, as it is; what still pends when the
sequence ends is dropped. Skipped special tokens never pend.
"""

from __future__ import annotations

from typing import Any

from ferrokv.detokenizer import _MAX_PENDING as MAX_PENDING  # the cap on what may pend

REPLACEMENT = "\ufffd"


def final_text(tok: Any, ids: list[int], skip_special_tokens: bool = True) -> str:
    special = set(tok.all_special_ids) if skip_special_tokens else set()
    kept = [t for t in ids if t not in special]
    emitted, text = 0, ""
    for i in range(1, len(kept) + 1):
        t = tok.decode(kept[:i], skip_special_tokens=skip_special_tokens)
        if len(t) > len(text) and (not t.endswith(REPLACEMENT) or i - emitted >= MAX_PENDING):
            emitted, text = i, t
    return text


def prompt_context(tok: Any, prompt: list[int], skip_special_tokens: bool = True) -> tuple[list[int], list[int]]:
    """A detokenizer's starting window, split as (emitted context, pending ids): of the last 5
    kept ids among the last 7, from the first start whose some head decodes clean at both ends
    (no U+FFFD first or last) its longest such head, the ids after it pending; when no start
    does, from the first id its longest head not ending in U+FFFD (all pending when none)."""
    special = set(tok.all_special_ids) if skip_special_tokens else set()
    ctx = [t for t in prompt[-7:] if t not in special and tok.convert_ids_to_tokens(t) is not None][-5:]

    def decode(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    for start in range(len(ctx)):
        for end in range(len(ctx), start, -1):
            text = decode(ctx[start:end])
            if text and not text.startswith(REPLACEMENT) and not text.endswith(REPLACEMENT):
                return ctx[start:end], ctx[end:]
    for end in range(len(ctx), 0, -1):
        if not decode(ctx[:end]).endswith(REPLACEMENT):
            return ctx[:end], ctx[end:]
    return [], ctx


def pending_prompt_ids(tok: Any, prompt: list[int], skip_special_tokens: bool = True) -> list[int]:
    """The prompt ids a detokenizer starts with pending (``prompt_context``)."""
    return prompt_context(tok, prompt, skip_special_tokens)[1]


def output_text_ok(tok: Any, text: str, prompt: list[int], ids: list[int], skip_special_tokens: bool = True) -> bool:
    """``text`` is the output's own final text, or, when the prompt ends inside a character that
    the output completes (fewer U+FFFD together than apart), that of a tail of the prompt's
    pending ids and the output."""
    alone = final_text(tok, ids, skip_special_tokens)
    if text == alone:
        return True
    pending = pending_prompt_ids(tok, prompt, skip_special_tokens)
    for j in range(len(pending)):
        together = final_text(tok, pending[j:] + ids, skip_special_tokens)
        tail = tok.decode(pending[j:], skip_special_tokens=skip_special_tokens)
        if text == together and together.count(REPLACEMENT) < alone.count(REPLACEMENT) + tail.count(REPLACEMENT):
            return True
    return False
