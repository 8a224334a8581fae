"""A chat choice's text -> its tool calls, streamed or whole (``ToolChoice`` says how the
calls are written; ``ferrokv.entrypoints.openai.tool_calls``).

One parser per choice. ``feed(text)`` takes the choice's next text and returns what to send
now: ``(content, tool_call_deltas)``; ``close()`` returns the rest once the text is complete.
A response that is not streamed feeds the whole text once, so both ways give the same calls.
Each call is ``{"id": "chatcmpl-tool-…", "type": "function", "function": {"name", "arguments"}}``
with ``arguments`` a JSON string; its first delta carries all of that so far (with ``index``, the
call's position in the choice), later ones ``{"index", "function": {"arguments"}}`` only.

- a named function (forced): the text is the arguments, streamed as generated;
- ``"required"`` (forced): a JSON array of ``{"name", "parameters"}``; each call is sent whole once
  its object closes;
- ``"auto"`` with the hermes parser: ``<tool_call>{"name", "arguments"}</tool_call>`` blocks in
  free text; text outside them streams as content (holding back what could start a tag), each
  block is sent whole once closed, and an unclosed block at the end is read as a call too (vLLM's);
- ``"auto"`` with the llama3_json parser: a reply that starts with ``{`` (or ``<|python_tag|>``)
  is ``{"name", "parameters"}`` objects separated by ``;``, each sent whole once it closes; any
  other reply is content.
- ``"auto"`` with the mistral parser (vLLM's with a Hugging Face tokenizer): text before the
  ``[TOOL_CALLS]`` token is content, after it a JSON array of ``{"name", "arguments"}`` objects,
  each sent whole once it closes. Call ids are 9 letters and digits, as Mistral's chat templates
  require of replayed calls.
- ``"auto"`` with the pythonic parser: a reply that is a Python list of calls with keyword
  arguments, ``[get_weather(city="Rome", days=2), ...]`` (Llama 3.2 and 4's), is calls, their
  arguments literals (``ast.literal_eval``'s) as JSON, sent once the reply is complete; any
  other reply is content, all of it, as vLLM reads it.

Nothing generated is lost: text that is no complete call (an array cut by ``max_tokens``, a block
whose JSON does not parse) comes back as content.
Costs: O(new text) per ``feed`` (the required scanner and the closing-tag search start where they
stopped; pythonic holds the text, and parses it once, at ``close``).
"""

from __future__ import annotations

import ast
import json
import random
import re
import string
import uuid
from typing import Any

from ferrokv.checks import is_text
from ferrokv.entrypoints.openai.tool_calls import ToolChoice

__all__ = ["ToolCallParser", "check_tool_call_parser", "tool_call_parser"]

Deltas = list[dict[str, Any]]


def _call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _arguments_json(arguments: Any, allow_nan: bool) -> str:
    """A call's arguments as JSON text; a lone surrogate the model wrote as an escape (``\\ud800``)
    stays one, so that the response is UTF-8 (the rest is kept as it is, not escaped)."""
    text = json.dumps(arguments, ensure_ascii=False, allow_nan=allow_nan)
    return text if is_text(text) else text.encode("utf-8", "backslashreplace").decode("utf-8")


class ToolCallParser:
    """The calls of one choice (module docs); ``calls`` holds those found so far."""

    def __init__(self, choice: ToolChoice) -> None:
        self.choice = choice
        self.calls: list[dict[str, Any]] = []

    def feed(self, text: str) -> tuple[str, Deltas]:
        raise NotImplementedError

    def close(self) -> tuple[str, Deltas]:
        return "", []

    def _new_id(self) -> str:
        return _call_id()

    def _add(self, name: str, arguments: str) -> dict[str, Any]:
        """A new call, and its first delta."""
        call_id = self._new_id()
        self.calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
        return {"index": len(self.calls) - 1, "id": call_id, "type": "function",
                "function": {"name": name, "arguments": arguments}}

    def _add_parsed(self, obj_text: str, keys: tuple[str, ...], forced: bool = False) -> dict[str, Any] | None:
        """A call from one JSON object ``{"name": ..., <the first of keys it has>: {...}}`` (None:
        not one). 1e999 and NaN parse, but strict JSON readers refuse the Infinity and NaN they
        re-serialize to: such arguments are no call, unless the call is ``forced`` (a "required"
        answer keeps its call, as vLLM writes it)."""
        try:
            obj = json.loads(obj_text)
        except (ValueError, RecursionError):
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not is_text(obj["name"]):
            return None  # (a name with a lone surrogate, written as an escape, is no tool's)
        try:
            arguments = _arguments_json(next((obj[k] for k in keys if k in obj), {}), allow_nan=forced)
        except (ValueError, RecursionError):
            return None
        return self._add(obj["name"], arguments)


class _NamedCall(ToolCallParser):
    def feed(self, text: str) -> tuple[str, Deltas]:
        if not text:
            return "", []
        if not self.calls:
            return "", [self._add(self.choice.name or "", text)]
        self.calls[0]["function"]["arguments"] += text
        return "", [{"index": 0, "function": {"arguments": text}}]

    def close(self) -> tuple[str, Deltas]:
        # A named call with no text still is one call (empty arguments), as vLLM gives it.
        return ("", []) if self.calls else ("", [self._add(self.choice.name or "", "")])


class _JsonObjects(ToolCallParser):
    """Scans JSON text for the objects at ``depth`` (strings and escapes included), each a call
    ``{"name", <one of keys>}``."""

    depth = 2  # "required": the elements of one array
    keys = ("parameters",)
    separator = ","  # between the calls

    def __init__(self, choice: ToolChoice) -> None:
        super().__init__(choice)
        self._text = ""
        self._scanned = 0
        self._depth = 0
        self._in_string = self._escaped = False
        self._start = -1  # where the open element object began
        self._done = 0  # text up to here became calls
        self._gaps: list[str] = []  # the text before each call, after the one before it

    def feed(self, text: str) -> tuple[str, Deltas]:
        self._text += text
        deltas = []
        for i in range(self._scanned, len(self._text)):
            ch = self._text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "[{":
                self._depth += 1
                if self._depth == self.depth and ch == "{":
                    self._start = i
            elif ch in "]}":
                self._depth -= 1
                if self._depth == self.depth - 1 and ch == "}" and self._start >= 0:
                    delta = self._add_parsed(self._text[self._start:i + 1], self.keys, self.choice.parser is None)
                    if delta is not None:
                        deltas.append(delta)
                        self._gaps.append(self._text[self._done:self._start])
                        self._done = i + 1
                    self._start = -1
        self._scanned = len(self._text)
        return "", deltas

    def close(self) -> tuple[str, Deltas]:
        """Text around the calls is content, as generated, unless it is only their own syntax:
        blanks and separators, and (an array) its brackets before the first call and after the
        last (what follows that bracket is content)."""
        rest = self._text[self._done:]
        if not self.calls:
            return rest, []
        first, *between = self._gaps
        if self.depth == 2:
            first = re.sub(r"\[\s*$", "", first, count=1)
            rest = re.sub(r"^\s*,?\s*\]", "", rest, count=1)
        gaps = [first, *between, rest]
        return "".join(g for g in gaps if not self._syntax.fullmatch(g)), []

    @property
    def _syntax(self) -> re.Pattern[str]:
        return re.compile(rf"\s*{re.escape(self.separator)}?\s*")


_PYTHON_TAG = "<|python_tag|>"


class _Llama3JsonCalls(_JsonObjects):
    """vLLM's llama3_json: a reply that starts with ``{`` (or Llama 3's ``<|python_tag|>``) is
    calls, ``{"name", "parameters"}`` objects (or ``"arguments"``) separated by ``;``, each sent
    whole once it closes; any other reply is content, streamed as generated."""

    depth = 1
    keys = ("parameters", "arguments")
    separator = ";"

    def __init__(self, choice: ToolChoice) -> None:
        super().__init__(choice)
        self._head = ""  # the reply's start while it could still be either
        self._calls_mode: bool | None = None

    def feed(self, text: str) -> tuple[str, Deltas]:
        if self._calls_mode is None:
            self._head += text
            start = self._head.lstrip()
            if not start or _PYTHON_TAG.startswith(start):
                return "", []
            self._calls_mode = start.startswith(("{", _PYTHON_TAG))
            text, self._head = (start.removeprefix(_PYTHON_TAG) if self._calls_mode else self._head), ""
        return super().feed(text) if self._calls_mode else (text, [])

    def close(self) -> tuple[str, Deltas]:
        if self._calls_mode is None:
            return self._head, []
        return super().close() if self._calls_mode else ("", [])


class _PythonicCalls(ToolCallParser):
    """vLLM's pythonic parser (module docs): the reply, held from its ``[`` on, is read whole by
    Python's own parser once complete, so what Python reads is what counts (strings of any
    quoting, comments); a reply whose first element cannot start a call is content at once."""

    def __init__(self, choice: ToolChoice) -> None:
        super().__init__(choice)
        self._mode: str | None = None  # "calls" (held) or "content", once the reply's start says
        self._text = ""

    def feed(self, text: str) -> tuple[str, Deltas]:
        if self._mode == "content":
            return text, []
        self._text += text
        if self._mode is None:  # only blanks and a "[" so far: a short text to look at
            start = self._text.lstrip()
            first = start[1:].lstrip()[:1]
            if start and not start.startswith("["):
                self._mode = "content"
            elif first:  # "[1] ...", '["a"...': no call list
                self._mode = "calls" if first.isidentifier() or first == "]" else "content"
        if self._mode == "content":
            text, self._text = self._text, ""
            return text, []
        return "", []

    def close(self) -> tuple[str, Deltas]:
        text, self._text = self._text, ""
        if self._mode != "calls":
            return text, []  # held blanks, or content already handed out
        try:
            body = ast.parse(text.strip(), mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return text, []
        calls = [self._call(e) for e in body.elts] if isinstance(body, ast.List) and body.elts else [None]
        if any(c is None for c in calls):
            return text, []  # not a list of calls, all of it: content, as vLLM reads it
        return "", [self._add(name, arguments) for name, arguments in calls]  # type: ignore[misc]

    @staticmethod
    def _call(node: ast.expr) -> tuple[str, str] | None:
        """``name(key=literal, ...)`` as (name, JSON arguments); None: no such call."""
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
                and all(k.arg is not None for k in node.keywords)):
            return None
        try:
            arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            # Tuples become arrays; sets, bytes and infinities are no JSON: not a call.
            return node.func.id, _arguments_json(arguments, allow_nan=False)
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None


def _held_back(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could start ``tag`` (held back from content)."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-k:])), 0)


TOOL_CALLS_TOKEN = "[TOOL_CALLS]"
_ALPHANUMERIC = string.ascii_letters + string.digits


class _MistralCalls(_JsonObjects):
    """vLLM's mistral parser with a Hugging Face tokenizer (module docs)."""

    depth = 2
    keys = ("arguments",)

    def __init__(self, choice: ToolChoice) -> None:
        super().__init__(choice)
        self._head = ""  # content not handed out yet: a possible start of the token
        self._in_calls = False

    def _new_id(self) -> str:
        return "".join(random.choices(_ALPHANUMERIC, k=9))

    def feed(self, text: str) -> tuple[str, Deltas]:
        if self._in_calls:
            return super().feed(text)
        self._head += text
        at = self._head.find(TOOL_CALLS_TOKEN)
        if at >= 0:
            content, calls = self._head[:at], self._head[at + len(TOOL_CALLS_TOKEN):]
            self._head, self._in_calls = "", True
            return content, super().feed(calls)[1]
        keep = _held_back(self._head, TOOL_CALLS_TOKEN)
        content, self._head = self._head[:len(self._head) - keep], self._head[len(self._head) - keep:]
        return content, []

    def close(self) -> tuple[str, Deltas]:
        return super().close() if self._in_calls else (self._head, [])


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


class _HermesCalls(ToolCallParser):
    def __init__(self, choice: ToolChoice) -> None:
        super().__init__(choice)
        self._buf = ""  # text not handed out yet: a possible tag start, or an open block
        self._in_call = False
        self._after_call = False  # no content since the last call: leading whitespace is dropped
        self._searched = 0  # an open block's text before this holds no closing tag

    def feed(self, text: str) -> tuple[str, Deltas]:
        self._buf += text
        content, deltas = [], []
        while True:
            if self._in_call:
                end = self._buf.find(_CLOSE, self._searched)
                if end < 0:
                    self._searched = max(0, len(self._buf) - len(_CLOSE) + 1)
                    break
                self._searched = 0
                self._block(self._buf[:end], _CLOSE, content, deltas)
                self._buf, self._in_call = self._buf[end + len(_CLOSE):], False
                continue
            start = self._buf.find(_OPEN)
            if start >= 0:
                self._content(self._buf[:start], content)
                self._buf, self._in_call = self._buf[start + len(_OPEN):], True
                continue
            keep = _held_back(self._buf, _OPEN)
            self._content(self._buf[:len(self._buf) - keep], content)
            self._buf = self._buf[len(self._buf) - keep:]
            break
        return "".join(content), deltas

    def close(self) -> tuple[str, Deltas]:
        content: list[str] = []
        deltas: Deltas = []
        if self._in_call:
            self._block(self._buf, "", content, deltas)
        else:
            self._content(self._buf, content)
        self._buf, self._in_call = "", False
        return "".join(content), deltas

    def _content(self, text: str, out: list[str]) -> None:
        # Between and after calls, the model's separating whitespace is not content.
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        if text:
            out.append(text)

    def _block(self, body: str, closing: str, content: list[str], deltas: Deltas) -> None:
        delta = self._add_parsed(body, ("arguments",))
        if delta is None:
            self._content(_OPEN + body + closing, content)
        else:
            deltas.append(delta)
            self._after_call = True


def tool_call_parser(choice: ToolChoice) -> ToolCallParser:
    if choice.parser is not None:
        return {"hermes": _HermesCalls, "llama3_json": _Llama3JsonCalls, "mistral": _MistralCalls,
                "pythonic": _PythonicCalls}[choice.parser](choice)
    return _NamedCall(choice) if choice.name is not None else _JsonObjects(choice)


def check_tool_call_parser(parser: str | None, tokenizer: Any) -> None:
    """Refuses a parser the model's tokenizer cannot serve (at server start, as vLLM's parsers
    check their tokens): mistral's calls follow the ``[TOOL_CALLS]`` token."""
    if parser == "mistral" and tokenizer is not None and TOOL_CALLS_TOKEN not in tokenizer.get_vocab():
        raise ValueError(f"--tool-call-parser mistral needs a tokenizer with the {TOOL_CALLS_TOKEN} token "
                         "(Mistral's calls follow it); this model's has none")
