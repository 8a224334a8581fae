"""Reasoning parsers (vLLM's ``--reasoning-parser``): a chat answer's text split into the model's
reasoning, written between ``<think>`` and ``</think>``, and its content.

Parsers:
- ``deepseek_r1`` (DeepSeek-R1 and its distills, whose template opens the reasoning): the text up
  to ``</think>`` is reasoning, all of it while the tag has not come.
- ``qwen3`` (Qwen3, thinking or not): the same, except that a whole answer without ``</think>``
  is content (an ``enable_thinking: false`` template leaves no tags to find), as vLLM's; a stream
  cannot wait for the end, so it calls the text reasoning until the tag comes, as vLLM's does.

A prompt whose template already closed the reasoning (its last ``<think>`` token followed by a
``</think>``, as Qwen3's ``enable_thinking: false`` writes it) gets an answer that is all content.
Either way a ``<think>`` the model writes itself, before ``</think>``, is dropped. A stream is split
as its text comes: a piece that may be the start of a tag waits for the next delta. Only the
content reaches a tool-call parser. Both tags are tokens of the models these parsers are for; the
server refuses a parser whose tags its tokenizer lacks (vLLM's check), so the text never holds a
tag spelled in pieces that the model never meant as one.

Invariants: a finished choice's reasoning + content is its text without the first ``<think>``
(when it comes before the first ``</think>``) and that ``</think>``, except for ``qwen3``'s whole
answer without the end tag. Costs: O(delta + tag length) per delta.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["REASONING_PARSERS", "ReasoningParser", "ReasoningSplitter"]

REASONING_PARSERS = ("deepseek_r1", "qwen3")
START, END = "<think>", "</think>"


class ReasoningSplitter:
    """One streamed choice's text, split into reasoning and content delta by delta."""

    __slots__ = ("_held", "_started", "_ended")

    def __init__(self, ended: bool = False) -> None:
        self._held = ""  # the end of the text so far that may be the start of a tag
        self._started = False  # the model's own <think> was dropped (or can no longer come)
        self._ended = ended  # </think> came (or the prompt closed the reasoning): the rest is content

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and content of ``text`` (the next delta) that can be told apart now."""
        if self._ended:
            return "", text
        text, self._held = self._held + text, ""
        end = text.find(END)
        if not self._started:
            start = text.find(START)
            if start >= 0 and (end < 0 or start < end):
                text, self._started = text[:start] + text[start + len(START):], True
                end = text.find(END)
        if end >= 0:
            self._ended = True
            return text[:end], text[end + len(END):]
        cut = len(text) - _partial_tag(text, (END,) if self._started else (END, START))
        self._held = text[cut:]
        return text[:cut], ""

    def close(self) -> tuple[str, str]:
        """What ``feed`` held back, once the text is complete."""
        held, self._held = self._held, ""
        return ("", held) if self._ended else (held, "")


def _partial_tag(text: str, tags: tuple[str, ...]) -> int:
    """The length of the longest end of ``text`` that begins one of ``tags`` (without being it)."""
    longest = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), longest, -1):
            if text.endswith(tag[:k]):
                longest = k
                break
    return longest


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    """The server's ``--reasoning-parser``: its name and the ids of its two tags."""

    name: str
    start_id: int
    end_id: int

    @classmethod
    def for_vocab(cls, name: str, vocab: Mapping[str, int]) -> ReasoningParser:
        """vLLM's startup check: the tokenizer has both tags as tokens (else the parser is not
        the model's), a ValueError naming the flag."""
        if name not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser {name!r} is not supported "
                             f"(supported: {', '.join(REASONING_PARSERS)})")
        missing = [tag for tag in (START, END) if tag not in vocab]
        if missing:
            raise ValueError(f"--reasoning-parser {name}: the tokenizer has no {' or '.join(map(repr, missing))} "
                             "token; this parser is for models that write their reasoning between them")
        return cls(name, vocab[START], vocab[END])

    def ended_in(self, prompt_ids: Sequence[int]) -> bool:
        """The prompt closed the reasoning: its last ``<think>`` is followed by a ``</think>``."""
        for t in reversed(prompt_ids):
            if t == self.end_id:
                return True
            if t == self.start_id:
                return False
        return False

    def split(self, text: str, ended: bool = False) -> tuple[str | None, str | None]:
        """A whole answer's reasoning and content (None where there is none), as vLLM reads
        them; ``ended``: the prompt closed the reasoning (``ended_in``)."""
        if ended or (self.name == "qwen3" and END not in text):
            return None, text
        splitter = ReasoningSplitter()
        reasoning, content = splitter.feed(text)
        rest = splitter.close()
        return reasoning + rest[0], (content + rest[1]) or None
