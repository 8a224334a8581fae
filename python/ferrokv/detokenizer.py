"""Incremental detokenization of one generated sequence, with stop-string detection.

Decoding token by token is not ``decode(token)`` per token: byte-level BPE tokens may hold part of
a UTF-8 character (an emoji is often 2-4 tokens), and SentencePiece-style decoders change a token's
text depending on what precedes it. So, like vLLM, we keep a small window of token strings with two
offsets: ``prefix`` (context already emitted) and ``read`` (end of what has been emitted). For a new
token we decode ``window[prefix:read]`` and ``window[prefix:]``; the new text is the difference,
held back while it ends in U+FFFD (an incomplete character), after which the window slides.

Invariants:

* The concatenation of every delta returned by :meth:`IncrementalDetokenizer.append` plus
  :meth:`~IncrementalDetokenizer.flush` equals :attr:`~IncrementalDetokenizer.text`; for a
  byte-level tokenizer and no stop strings this equals
  ``tokenizer.decode(ids, skip_special_tokens=...)`` of all appended ids, less a last character
  still incomplete when the sequence ends (vLLM drops it too: a cut never ends in U+FFFD).
* A prompt that ends inside a character: its last tokens pend, and the output token that
  completes the character emits it whole (as vLLM's DecodeStream, primed with the prompt, does);
  stray bytes before it, or all of them when the output does not complete a character with them,
  are not output text (vLLM would show them).
* No U+FFFD is emitted for a character split across tokens; at most ``_MAX_PENDING`` tokens are
  held for that (beyond that the bytes are genuinely invalid and are emitted as U+FFFD, which keeps
  the window, and so the cost, bounded).
* Stop strings: once the text contains one (searched only after more than ``min_tokens`` tokens, as
  in vLLM), :attr:`stop_reason` is that string, :attr:`text` is cut just before it (or just after
  it with ``include_stop_str_in_output``) and the detokenizer refuses further tokens. When several
  stop strings complete in one delta, the one that ends first wins, as if the delta came one
  character at a time, so the text never holds a stop string (vLLM's ``check_stop_strings`` takes
  the first of the caller's list found, which may leave an earlier-ending one in the text); the
  list's order breaks ties. A stop string may span any number of tokens.
* Emitted text is final: without ``include_stop_str_in_output`` the last ``max_stop_len - 1``
  characters are held back from deltas (a partial stop string must not be streamed and then
  retracted); :meth:`flush` releases them when the sequence ends for another reason.

Costs per token: two decoder calls over a window of at most ~``_MAX_PENDING + 5`` tokens, plus a
search over ``len(new text) + max_stop_len`` characters per stop string -- independent of how
long the output already is. :attr:`text` joins the emitted pieces (cached until the next append).

The engine should not append the token that stopped the sequence by EOS / ``stop_token_ids``
unless ``include_stop_str_in_output`` (vLLM's detokenizer does the same), and should call
:meth:`flush` when a sequence finishes for any reason other than a stop string.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

from ferrokv.sampling_params import SamplingParams

__all__ = ["IncrementalDetokenizer", "decode_token", "special_token_ids"]

# Prompt tokens used as decoding context for the first output tokens (vLLM uses 5): enough for
# SentencePiece's leading-space handling, small enough to be free.
_PROMPT_CONTEXT = 5
# vLLM holds undecodable tokens until the text completes, without a cap; this one only bounds the
# window (a character needs at most 4 byte tokens, so only a long run of garbage bytes, which a
# valid character may follow, reaches it: it is then emitted as it is).
_MAX_PENDING = 64
_REPLACEMENT = "\ufffd"

_special_cache: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()
_marker_cache: weakref.WeakKeyDictionary[Any, str | None] = weakref.WeakKeyDictionary()


def _completes(new_text: str, pending: int) -> bool:
    """Whether ``new_text``, the text ``pending`` tokens add, is emitted now: it adds a character
    and does not end mid-character (unless ``_MAX_PENDING`` tokens pend)."""
    return bool(new_text) and not (new_text.endswith(_REPLACEMENT) and pending < _MAX_PENDING)


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """The ids ``skip_special_tokens`` skips, as the tokenizer's own ``decode`` does, as a frozenset
    cached per tokenizer (the properties are slow): ``all_special_ids``, and for a fast tokenizer
    also every added token flagged special (its backend skips those; ``all_special_ids`` lists
    only the named and additional special tokens, not e.g. reserved tokens added as special)."""
    try:
        return _special_cache[tokenizer]
    except (KeyError, TypeError):
        ids = frozenset(int(i) for i in tokenizer.all_special_ids if i is not None)
        if getattr(tokenizer, "is_fast", False):
            added = getattr(tokenizer, "added_tokens_decoder", None) or {}
            ids |= {int(i) for i, t in added.items() if getattr(t, "special", False)}
        try:
            _special_cache[tokenizer] = ids
        except TypeError:  # not weak-referenceable: just don't cache
            pass
        return ids


def decode_token(tokenizer: Any, token_id: int) -> str:
    """Text of one token in isolation (as vLLM reports ``decoded_token``); '' for unknown ids. A
    SentencePiece-style piece keeps the leading spaces its markers stand for (``'▁likes'`` is
    ``' likes'``), which decoding it alone strips, as vLLM's ``convert_ids_list_to_tokens``."""
    tok = tokenizer.convert_ids_to_tokens(int(token_id))
    if tok is None:
        return ""
    text = tokenizer.convert_tokens_to_string([tok])
    marker = _space_marker(tokenizer)
    if marker and tok.startswith(marker):
        missing = (len(tok) - len(tok.lstrip(marker))) - (len(text) - len(text.lstrip(" ")))
        if missing > 0:
            text = " " * missing + text
    return text


def _space_marker(tokenizer: Any) -> str | None:
    """The character a Metaspace pre-tokenizer writes for a space (vLLM reads it there too), cached
    per tokenizer; None for any other tokenizer (byte-level pieces keep their spaces)."""
    try:
        return _marker_cache[tokenizer]
    except (KeyError, TypeError):
        pass
    marker, pre = None, getattr(getattr(tokenizer, "backend_tokenizer", None), "pre_tokenizer", None)
    try:
        state = json.loads(pre.__getstate__()) if pre is not None else {}
    except (AttributeError, TypeError, ValueError):
        state = {}
    parts = (state.get("pretokenizers") or []) if state.get("type") == "Sequence" else [state]
    for part in parts:
        if isinstance(part, dict) and part.get("type") == "Metaspace":
            marker = part.get("replacement", "\u2581")
            break
    try:
        _marker_cache[tokenizer] = marker
    except TypeError:  # not weak-referenceable: just don't cache
        pass
    return marker


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into text deltas (see module docstring)."""

    __slots__ = (
        "_tokenizer",
        "_skip_ids",
        "_stop",
        "_include_stop",
        "_min_tokens",
        "_holdback",
        "_tail_len",
        "_window",
        "_prefix",
        "_read",
        "_prompt_pending",
        "_prefix_text",
        "_tail",
        "_held",
        "_pieces",
        "_text_cache",
        "num_tokens",
        "stop_reason",
    )

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int] | None = None,
        *,
        skip_special_tokens: bool = True,
        stop: Iterable[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_ids = special_token_ids(tokenizer) if skip_special_tokens else frozenset()
        self._stop: tuple[str, ...] = tuple(s for s in stop if s)
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        max_stop = max((len(s) for s in self._stop), default=0)
        # Characters withheld from deltas: a stop string that is not yet complete is at most
        # max_stop - 1 characters long. With include_stop_str_in_output nothing is ever cut.
        self._tail_len = max(max_stop - 1, 0)
        self._holdback = 0 if include_stop_str_in_output else self._tail_len
        self._window: list[str] = []
        self._prefix = 0
        self._read = 0
        self._prompt_pending = 0  # prompt tokens in window[read:] (a character the prompt ends in)
        self._prefix_text: str | None = ""
        # Search context for stop strings spanning deltas: the last max_stop - 1 decoded chars.
        self._tail = ""
        self._held = ""  # decoded but not yet emitted (suffix of _tail)
        self._pieces: list[str] = []
        self._text_cache: str | None = ""
        self.num_tokens = 0
        self.stop_reason: str | None = None
        if prompt_token_ids is not None and len(prompt_token_ids) > 0:  # may be a numpy array
            self._init_prompt_context(prompt_token_ids)

    @classmethod
    def from_params(
        cls,
        tokenizer: Any,
        params: SamplingParams,
        prompt_token_ids: Sequence[int] | None = None,
    ) -> IncrementalDetokenizer:
        return cls(
            tokenizer,
            prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop or (),
            include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
        )

    def _init_prompt_context(self, prompt_token_ids: Sequence[int]) -> None:
        # A few extra ids in case some are skipped specials.
        ctx = self._to_tokens(prompt_token_ids[-(_PROMPT_CONTEXT + 2):])[-_PROMPT_CONTEXT:]
        start, read, text = self._clean_context(ctx)
        del ctx[:start]
        self._window = ctx
        self._prefix, self._read = 0, read
        self._prefix_text = text
        self._prompt_pending = len(ctx) - read

    def _clean_context(self, ctx: list[str]) -> tuple[int, int, str]:
        """Where the context starts, how much of it is emitted context, and that part's text: the
        first start from which some head decodes clean at both ends (no U+FFFD first or last: the
        last 5 ids may begin inside a character, and a byte-fallback decoder turns a whole invalid
        byte run into U+FFFDs, which would leave no clean head and drop the context, and with it
        the first output token's leading space), and its longest such head. The tokens after the
        head (a prompt that ends mid-character) pend: the output token that completes the
        character emits it whole, as vLLM's DecodeStream, primed with the prompt, does
        (_take_text). No start decodes clean at both ends: start 0 and its longest head that does
        not end in U+FFFD."""
        convert = self._tokenizer.convert_tokens_to_string
        for start in range(len(ctx)):
            for end in range(len(ctx), start, -1):
                text = convert(ctx[start:end])
                if text and not text.startswith(_REPLACEMENT) and not text.endswith(_REPLACEMENT):
                    return start, end - start, text
        for end in range(len(ctx), 0, -1):
            text = convert(ctx[:end])
            if not text.endswith(_REPLACEMENT):
                return 0, end, text
        return 0, 0, ""

    def _to_tokens(self, ids: Iterable[int]) -> list[str]:
        out = []
        convert = self._tokenizer.convert_ids_to_tokens
        for i in ids:
            i = int(i)
            if i in self._skip_ids:
                continue
            tok = convert(i)
            if tok is not None:  # ids past the tokenizer's vocab (padded embeddings) decode to ''
                out.append(tok)
        return out

    @property
    def stopped(self) -> bool:
        """True once a stop string was found; no more tokens may be appended."""
        return self.stop_reason is not None

    @property
    def text(self) -> str:
        """All text emitted so far (after :meth:`flush`: the complete output text)."""
        if self._text_cache is None:
            self._text_cache = "".join(self._pieces)
        return self._text_cache

    def _decode_step(self, token_id: int) -> str:
        """Adds one token to the window; returns newly completed text (maybe '')."""
        new = self._to_tokens((token_id,))
        if not new:
            return ""
        self._window.extend(new)
        if self._prompt_pending and not self._settle_prompt_tail():
            return ""
        return self._take_text()

    def _settle_prompt_tail(self) -> bool:
        """While prompt tokens pend: the shortest tail of them that the output completes a
        character with (their decode together completes text, with fewer U+FFFD than apart) stays,
        the tokens before it are dropped; none does: all are dropped once the output completes
        text alone (it broke the character), so the prompt's stray bytes are not output text (vLLM
        would show them); else False (wait for more tokens)."""
        convert, window = self._tokenizer.convert_tokens_to_string, self._window
        start, end = self._read, self._read + self._prompt_pending

        def decoded(toks: list[str]) -> tuple[bool, int]:
            text = convert(toks)
            return _completes(text, len(toks)), text.count(_REPLACEMENT)

        output_done, output_bad = decoded(window[end:])
        keep = next((j for j in range(end - 1, start - 1, -1)
                     if (d := decoded(window[j:]))[0] and d[1] < decoded(window[j:end])[1] + output_bad), None)
        if keep is None and not output_done:
            return False
        del window[start : end if keep is None else keep]
        self._prompt_pending = 0
        return True

    def _take_text(self) -> str:
        """The text the pending tokens complete, if any (then the window slides)."""
        convert = self._tokenizer.convert_tokens_to_string
        if self._prefix_text is None:
            self._prefix_text = convert(self._window[self._prefix : self._read])
        prefix_text = self._prefix_text
        delta = convert(self._window[self._prefix :])[len(prefix_text) :]
        if not _completes(delta, len(self._window) - self._read):
            return ""  # incomplete character (or nothing visible yet): wait for more tokens
        # Slide: emitted tokens become the context; drop older ones so the window stays small.
        del self._window[: self._read]
        self._prefix, self._read = 0, len(self._window)
        self._prefix_text = None  # recomputed lazily, only if another token arrives
        return delta

    def append(self, token_id: int) -> str:
        """Appends one generated token; returns the text that became final (maybe '')."""
        if self.stop_reason is not None:
            raise RuntimeError(f"sequence already stopped on {self.stop_reason!r}")
        self.num_tokens += 1
        delta = self._decode_step(token_id)
        if not delta:
            return ""
        return self._emit(delta)

    def extend(self, token_ids: Iterable[int]) -> str:
        """Appends several tokens (stopping early at a stop string); returns the joined deltas."""
        out = []
        for t in token_ids:
            out.append(self.append(t))
            if self.stop_reason is not None:
                break
        return "".join(out)

    def _emit(self, delta: str) -> str:
        if not self._stop:
            self._push(delta)
            return delta
        s = self._tail + delta
        base = len(self._tail)  # s[:base] was already searched
        if self.num_tokens > self._min_tokens:
            # Only matches that end inside the new delta are new; the one that ends first wins
            # (as if the delta came one character at a time), the list's order breaking ties.
            found = None
            for stop in self._stop:
                i = s.find(stop, max(0, base - len(stop) + 1))
                if i != -1 and (found is None or i + len(stop) < found[0] + len(found[1])):
                    found = (i, stop)
            if found is not None:
                i, stop = found
                cut = i + len(stop) if self._include_stop else i
                # s[base - len(held):] is what has not been emitted yet. Holdback guarantees the
                # cut never falls inside already-emitted text.
                out = s[base - len(self._held) : cut]
                self._held = self._tail = ""
                self.stop_reason = stop
                self._push(out)
                return out
        keep = self._holdback
        self._tail = s[-self._tail_len :] if self._tail_len else ""
        pending = self._held + delta
        if keep and len(pending) > keep:
            out, self._held = pending[:-keep], pending[-keep:]
        elif keep:
            out, self._held = "", pending
        else:
            out, self._held = pending, ""
        self._push(out)
        return out

    def _push(self, piece: str) -> None:
        if piece:
            self._pieces.append(piece)
            self._text_cache = None

    def flush(self) -> str:
        """Releases the text held back for stop strings at the end of the sequence; returns it
        (maybe ''). Tokens still pending (a character not complete yet, or tokens that added no
        character) are dropped, as vLLM's detokenizer drops them: a cut never ends in U+FFFD."""
        out = self._held
        self._held = self._tail = ""
        del self._window[self._read:]
        self._push(out)
        return out
