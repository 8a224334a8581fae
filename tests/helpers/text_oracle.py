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
