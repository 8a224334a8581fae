"""Reasoning parsers (vLLM's ``--reasoning-parser``): a chat answer's text split into the model's
reasoning, written between ``<think>`` and ``</think>``, and its content, as vLLM's parsers split it.

Parsers:
- ``deepseek_r1`` (DeepSeek-R1 and its distills, whose template opens the reasoning): the text up
  to ``</think>`` is reasoning, all of it while the tag has not come (an answer cut short).
- ``qwen3`` (Qwen3 and later, thinking or not): the same, and a ``<tool_call>`` that opens a call
  (``{`` or ``<function`` follows it) also ends the reasoning: the call, tag included, is content
  (these models may call a tool without closing their thinking; one that only names the tag goes
  on reasoning); with ``enable_thinking: false`` in the chat's template keywords the answer is all
  content.

Either way a ``<think>`` the model writes first is dropped (one after other text is text: vLLM
drops the text before it), and an empty reasoning or content is none. Streamed and whole answers
split alike: a piece of a stream that may be the start of a tag waits for the next delta. Only the
content reaches a tool-call parser. Both think tags are tokens of the models these parsers are
for; the engine refuses a parser whose tags its tokenizer lacks (vLLM's check), and its
structured outputs constrain only what follows the reasoning (``structured_outputs``: a grammar
starts once the ``</think>`` token came, or at once when the prompt closed the reasoning).

Invariants: a finished choice's reasoning + content is its text without the dropped ``<think>``
and the ``</think>`` that ended the reasoning; a stream splits as the whole text, however cut.
Costs: O(delta + tag length) per delta.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["REASONING_PARSERS", "ReasoningParser", "ReasoningSplitter", "reasoning_ended_in", "split_whole"]

REASONING_PARSERS = ("deepseek_r1", "qwen3")
START, END = "<think>", "</think>"
TOOL_CALL = "<tool_call>"  # qwen3's implicit end of the reasoning (kept, in the content)
CALL_BODIES = ("{", "<function")  # what follows a tool call's tag (hermes JSON, Qwen3-Coder XML)


class ReasoningSplitter:
    """One choice's text, split into reasoning and content delta by delta."""

    __slots__ = ("thinking", "_held", "_started", "_ended", "_implicit_end")

    def __init__(self, thinking: bool = True, implicit_end: str | None = None) -> None:
        self.thinking = thinking  # the answer may hold reasoning (else it is all content)
        self._held = ""  # the end of the text so far that may be the start of a tag
        self._started = False  # past where the model's own <think> may come (a later one is text)
        self._ended = not thinking  # the reasoning ended (or there is none): the rest is content
        self._implicit_end = implicit_end  # a tag that ends the reasoning and starts the content

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and content of ``text`` (the next delta) that can be told apart now."""
        if self._ended:
            return "", text
        text, self._held = self._held + text, ""
        if not self._started:  # a <think> the model writes first (only space before it) is dropped
            rest = text.lstrip()
            if rest.startswith(START):
                text = text[:len(text) - len(rest)] + rest[len(START):]
            self._started = rest.startswith(START) or not START.startswith(rest)
        end, skip, undecided = self._end_in(text)
        if end >= 0:
            self._ended = True
            return text[:end], text[end + skip:]
        tags = [END, *([] if self._started else [START]), *([self._implicit_end] if self._implicit_end else [])]
        cut = min(len(text) - _partial_tag(text, tags), len(text) if undecided < 0 else undecided)
        self._held = text[cut:]
        return text[:cut], ""

    def close(self) -> tuple[str, str]:
        """What ``feed`` held back, once the text is complete."""
        held, self._held = self._held, ""
        return ("", held) if self._ended else (held, "")

    def _end_in(self, text: str) -> tuple[int, int, int]:
        """Where the reasoning ends in ``text`` (-1: not in it), how much of the text there is the
        tag to drop (an implicit end's tag stays, as content), and where a call tag starts that
        ends it or not by what comes next (-1: none)."""
        end = text.find(END)
        tag = self._implicit_end
        at = text.find(tag) if tag else -1
        while at >= 0 and (end < 0 or at < end):
            after = text[at + len(tag):].lstrip()
            if any(after.startswith(body) for body in CALL_BODIES):
                return at, 0, -1
            if any(body.startswith(after) for body in CALL_BODIES):  # "" or a piece of "<function"
                return -1, 0, at
            at = text.find(tag, at + 1)
        return end, len(END), -1


def _partial_tag(text: str, tags: list[str]) -> int:
    """The length of the longest end of ``text`` that begins one of ``tags`` (without being it)."""
    longest = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), longest, -1):
            if text.endswith(tag[:k]):
                longest = k
                break
    return longest


def reasoning_ended_in(prompt_ids: Sequence[int], tags: tuple[int, int]) -> bool:
    """The prompt closed the reasoning: its last think tag is ``</think>`` (as Qwen3's
    ``enable_thinking: false`` template writes it); vLLM's ``is_reasoning_end`` on the prompt."""
    start, end = tags
    for t in reversed(prompt_ids):
        if t == end:
            return True
        if t == start:
            return False
    return False


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    """The engine's ``reasoning_parser``: where its grammars start, and how the server splits
    answers."""

    name: str
    tags: tuple[int, int]  # the ids of <think> and </think>

    @classmethod
    def of(cls, name: str | None, vocab: Mapping[str, int]) -> ReasoningParser | None:
        """The engine's ``reasoning_parser`` (None: none). vLLM's check when the parser is made: a
        tokenizer without both tags as tokens is not one of the parser's models, a ValueError
        naming the argument."""
        if name is None:
            return None
        missing = [tag for tag in (START, END) if tag not in vocab]
        if missing:
            raise ValueError(f"reasoning_parser={name!r}: the tokenizer has no {' or '.join(map(repr, missing))} "
                             "token; this parser is for models that write their reasoning between them")
        return cls(name, (vocab[START], vocab[END]))

    def count_reasoning_tokens(self, token_ids: Sequence[int]) -> int:
        """How many of an answer's tokens are its reasoning: those before its first ``</think>``
        (a leading ``<think>`` not counted), all of them while none came (vLLM's count)."""
        ids = list(token_ids)
        start = 1 if ids[:1] == [self.tags[0]] else 0
        end = ids.index(self.tags[1], start) if self.tags[1] in ids[start:] else len(ids)
        return end - start

    def splitter(self, template_kwargs: Mapping[str, object] | None, prompt_ids: Sequence[int] = (),
                 constrained: bool = False) -> ReasoningSplitter:
        """A choice's splitter; ``template_kwargs``: the chat's (qwen3 reads ``enable_thinking``).
        A ``constrained`` answer (a structured output) whose prompt closed the reasoning is all
        content: the engine started its grammar at once, by the same check."""
        if constrained and reasoning_ended_in(prompt_ids, self.tags):
            return ReasoningSplitter(thinking=False)
        if self.name != "qwen3":
            return ReasoningSplitter()
        thinking = bool((template_kwargs or {}).get("enable_thinking", True))  # vLLM's: any false value
        return ReasoningSplitter(thinking, TOOL_CALL)



def split_whole(splitter: ReasoningSplitter, text: str) -> tuple[str | None, str | None]:
    """A whole answer's reasoning and content (None where there is none), by a fresh splitter."""
    reasoning, content = splitter.feed(text)
    rest = splitter.close()
    return (reasoning + rest[0]) or None, (content + rest[1]) or None
