"""Tool calling for ``/v1/chat/completions``, as vLLM does it without a tool parser.

``tool_choice`` is ``"none"`` (the tools reach the chat template only), a named function
(``{"type": "function", "function": {"name": ...}}``: the output is that function's arguments,
decoded under its ``parameters`` JSON schema) or ``"required"`` (the output is a JSON array of
``{"name", "parameters"}`` objects, one of the tools each, at least one, at most one when
``parallel_tool_calls`` is false). ``"auto"`` (OpenAI's default with tools) needs a model-specific
parser of tool calls in free text, which this server does not have: a 400, as vLLM without
``--enable-auto-tool-choice``.

The constraint is a structured output (``ferrokv.structured_outputs``); the response carries
``message.tool_calls`` (``content`` ""), each ``{"id": "chatcmpl-tool-…", "type": "function",
"function": {"name", "arguments"}}`` with ``arguments`` a JSON string, and the engine's
``finish_reason`` (vLLM's: "stop", or "length" when cut). One ``ToolCallStream`` per choice turns
the text into calls, streamed or not: a named call's arguments stream as they are generated; a
required array's calls each come whole once its object is closed. Text that is not a complete call
(an array cut by ``max_tokens``) is returned as ``content``, so nothing generated is lost.

Conversations replay earlier calls (``ferrokv.inputs.message_tool_fields``).
Costs: O(tools) per request to check and build the schema; O(new text) per streamed delta.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ferrokv.checks import shown

__all__ = ["ToolChoice", "ToolCallStream", "ToolError", "parse_tools"]

_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class ToolError(ValueError):
    """A bad ``tools``/``tool_choice``/message field; ``param`` names it (a 400)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """A forced tool call: ``name`` set for a named function, None for ``"required"``."""

    tools: tuple[Mapping[str, Any], ...]  # the checked ``function`` objects
    name: str | None = None
    parallel: bool = True

    def schema(self) -> dict[str, Any]:
        """The JSON schema the output is decoded under (vLLM's ``get_json_schema_from_tools``)."""
        if self.name is not None:
            return dict(next(_parameters(f) for f in self.tools if f["name"] == self.name))
        defs: dict[str, Any] = {}
        for f in self.tools:
            defs.update(_parameters(f).get("$defs") or {})
        items = [{"properties": {"name": {"type": "string", "enum": [f["name"]]},
                                 "parameters": {k: v for k, v in _parameters(f).items() if k != "$defs"}},
                  "required": ["name", "parameters"]} for f in self.tools]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
        if not self.parallel:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        return schema


def _parameters(function: Mapping[str, Any]) -> dict[str, Any]:
    p = function.get("parameters")
    return dict(p) if p else dict(_EMPTY_PARAMETERS)


def _functions(tools: Any) -> tuple[Mapping[str, Any], ...]:
    """OpenAI's ``tools``: a list of ``{"type": "function", "function": {"name", "parameters"?,
    "description"?}}``, as vLLM's protocol checks them."""
    if not isinstance(tools, list):
        raise ToolError("tools", f"tools must be a list of tool objects, got {shown(tools)}")
    out = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, Mapping):
            raise ToolError(where, f"{where} must be an object {{'type': 'function', 'function': {{...}}}}, got {shown(t)}")
        if t.get("type", "function") != "function":
            raise ToolError(f"{where}.type", f"{where}.type must be 'function', got {shown(t.get('type'))}")
        f = t.get("function")
        if not isinstance(f, Mapping):
            raise ToolError(f"{where}.function", f"{where}.function must be an object with a name, got {shown(f)}")
        if not isinstance(f.get("name"), str) or not f["name"]:
            raise ToolError(f"{where}.function.name",
                            f"{where}.function.name must be a non-empty string, got {shown(f.get('name'))}")
        if f.get("parameters") is not None and not isinstance(f["parameters"], Mapping):
            raise ToolError(f"{where}.function.parameters", f"{where}.function.parameters must be a JSON schema "
                                                            f"object, got {shown(f['parameters'])}")
        out.append(f)
    return tuple(out)


def parse_tools(body: Mapping[str, Any]) -> tuple[list[Any] | None, ToolChoice | None]:
    """A chat request's ``tools`` (for the template; None when absent or empty) and the call it
    forces (None for ``"none"`` or no tools); a ``ToolError`` names a bad field (module docs)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError("parallel_tool_calls", f"parallel_tool_calls must be a boolean, got {shown(parallel)}")
    functions = _functions(tools) if tools is not None else ()
    if choice is None or choice == "none" or (choice == "auto" and not functions):
        if choice is None and functions:
            raise ToolError("tool_choice", _AUTO)
        return (list(tools) if functions else None), None
    if choice == "auto":
        raise ToolError("tool_choice", _AUTO)
    if choice == "required":
        name = None
    elif isinstance(choice, Mapping) and choice.get("type", "function") == "function" \
            and isinstance(choice.get("function"), Mapping) and isinstance(choice["function"].get("name"), str):
        name = choice["function"]["name"]
    else:
        raise ToolError("tool_choice", "tool_choice must be 'none', 'auto', 'required' or "
                                       f"{{'type': 'function', 'function': {{'name': ...}}}}, got {shown(choice)}")
    if not functions:
        raise ToolError("tools", f"tool_choice {shown(choice)} needs tools: give the functions in tools")
    if name is not None and all(f["name"] != name for f in functions):
        raise ToolError("tool_choice.function.name", f"tool_choice names the function {shown(name)}, which is not "
                                                     f"in tools ({', '.join(f['name'] for f in functions)})")
    return list(tools), ToolChoice(functions, name, parallel is not False)


_AUTO = ('tool_choice "auto" (the default with tools) is not supported: this server has no parser of tool calls '
         'in free text; use "required", a named function ({"type": "function", "function": {"name": ...}}) '
         'or "none" (the tools are given to the chat template only)')


def _call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(slots=True)
class ToolCallStream:
    """One choice's text -> its tool calls (module docs). ``feed`` takes the next text and
    returns the streamed ``tool_calls`` deltas; ``calls`` and ``leftover`` give the whole."""

    choice: ToolChoice
    calls: list[dict[str, Any]] = field(default_factory=list)
    _text: str = ""
    _scanned: int = 0  # required: chars of _text scanned so far
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False
    _start: int = -1  # required: where the open call object began
    _done: int = 0  # required: chars of _text that became calls

    def feed(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        self._text += text
        if self.choice.name is not None:
            return [self._named(text)]
        return [self._delta(len(self.calls) - 1) for _ in self._scan()]

    def close(self) -> list[dict[str, Any]]:
        """The last deltas once the text is complete: a named call with no text yet still has
        one call (empty arguments), as vLLM gives it."""
        if self.choice.name is not None and not self.calls:
            self.calls.append({"id": _call_id(), "type": "function",
                               "function": {"name": self.choice.name, "arguments": ""}})
            return [self._delta(0)]
        return []

    def _named(self, text: str) -> dict[str, Any]:
        if not self.calls:
            self.calls.append({"id": _call_id(), "type": "function",
                               "function": {"name": self.choice.name, "arguments": text}})
            return self._delta(0)
        self.calls[0]["function"]["arguments"] += text
        return {"index": 0, "function": {"arguments": text}}

    def _delta(self, index: int) -> dict[str, Any]:
        """A call's first delta: all of it so far."""
        c = self.calls[index]
        return {"index": index, "id": c["id"], "type": "function",
                "function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}}

    def _scan(self) -> Any:
        """Yields once per call object of the required array closed in the new text."""
        text = self._text
        for i in range(self._scanned, len(text)):
            ch = text[i]
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
                if self._depth == 2 and ch == "{":
                    self._start = i
            elif ch in "]}":
                self._depth -= 1
                if self._depth == 1 and ch == "}" and self._start >= 0 and self._add(text[self._start:i + 1]):
                    self._done = i + 1
                    self._start = -1
                    self._scanned = i + 1
                    yield
        self._scanned = len(text)

    def _add(self, obj: str) -> bool:
        try:
            call = json.loads(obj)
        except ValueError:
            return False
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return False
        self.calls.append({"id": _call_id(), "type": "function", "function": {
            "name": call["name"], "arguments": json.dumps(call.get("parameters", {}), ensure_ascii=False)}})
        return True

    def leftover(self) -> str:
        """Generated text no call holds: "" once a named call started or a required array
        closed; else what was not a complete call (an array cut short), whole."""
        rest = self._text[self._done:]
        closed = self._depth == 0 and rest.strip() in ("]", "")
        return "" if self.choice.name is not None or (self.calls and closed) else rest
