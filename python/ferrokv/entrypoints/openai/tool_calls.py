"""Tool calling requests for ``/v1/chat/completions``: ``tools`` and ``tool_choice``, as vLLM
checks and serves them.

``tool_choice`` is ``"none"`` (the tools reach the chat template only), a named function
(``{"type": "function", "function": {"name": ...}}``: the output is that function's arguments,
decoded under its ``parameters`` JSON schema), ``"required"`` (the output is a JSON array of
``{"name", "parameters"}`` objects, one of the tools each, at least one, at most one when
``parallel_tool_calls`` is false), or ``"auto"`` (OpenAI's default with tools): the model writes
calls in its own format, found in the text by the server's ``--tool-call-parser``; a server
started without ``--enable-auto-tool-choice`` refuses it (a 400, as vLLM).

A forced call's constraint is a structured output (``ferrokv.structured_outputs``); the
calls are read out of the text by ``ferrokv.entrypoints.openai.tool_parsers``. Conversations
replay earlier calls (``ferrokv.inputs.message_tool_fields``).
Costs: O(tools) per request to check them and build the schema.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ferrokv.checks import is_text, shown

__all__ = ["TOOL_CALL_PARSERS", "ToolChoice", "ToolError", "parse_tools"]

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")
"""The formats ``--tool-call-parser`` reads (hermes: ``<tool_call>{"name", "arguments"}</tool_call>``,
as Hermes, Qwen2.5 and Qwen3 models write them; llama3_json: a reply of ``{"name", "parameters"}``
objects, as Llama 3.1+ models write them; mistral: ``[TOOL_CALLS]`` then a JSON array of
``{"name", "arguments"}``, as Mistral models write them; pythonic: a reply ``[name(key=value, ...), ...]``, as
Llama 3.2 and Llama 4 models write them)."""

_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class ToolError(ValueError):
    """A bad ``tools``/``tool_choice``/message field; ``param`` names it (a 400)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """A request's tool calling: ``parser`` set for ``"auto"`` (the format the model's calls are
    read in), else a forced call: ``name`` set for a named function, None for ``"required"``."""

    tools: tuple[Mapping[str, Any], ...]  # the checked ``function`` objects
    name: str | None = None
    parallel: bool = True
    parser: str | None = None

    @property
    def forced(self) -> bool:
        return self.parser is None

    def schema(self) -> dict[str, Any]:
        """The JSON schema the output is decoded under (vLLM's ``get_json_schema_from_tools``:
        a named function's is its parameters, the last tool of that name's; "required"'s lifts
        the tools' ``$defs`` to the top, where one name with two schemas is a ``ToolError``)."""
        if self.name is not None:
            return dict(next(_parameters(f) for f in reversed(self.tools) if f["name"] == self.name))
        defs: dict[str, Any] = {}
        for i, f in enumerate(self.tools):
            where = f"tools[{i}].function.parameters.$defs"
            these = _parameters(f).get("$defs") or {}
            if not isinstance(these, Mapping):
                raise ToolError(where, f"{where} must be an object of named schemas, got {shown(these)}")
            for name, sub in these.items():
                if defs.setdefault(name, sub) != sub:
                    raise ToolError(where, f"{where}[{name!r}] differs from another tool's {name!r}: with tool_choice "
                                           '"required" the tools share their $defs, so one name cannot have two schemas')
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
        if not isinstance(f.get("name"), str) or not f["name"] or not is_text(f["name"]):
            raise ToolError(f"{where}.function.name", f"{where}.function.name must be a non-empty string of "
                                                      f"valid Unicode, got {shown(f.get('name'))}")
        if f.get("description") is not None and not isinstance(f["description"], str):
            raise ToolError(f"{where}.function.description", f"{where}.function.description must be a string, "
                                                             f"got {shown(f['description'])}")
        if f.get("parameters") is not None and not isinstance(f["parameters"], Mapping):
            raise ToolError(f"{where}.function.parameters", f"{where}.function.parameters must be a JSON schema "
                                                            f"object, got {shown(f['parameters'])}")
        out.append(f)
    return tuple(out)


def parse_tools(body: Mapping[str, Any],
                auto_parser: str | None = None) -> tuple[list[Any] | None, ToolChoice | None]:
    """A chat request's ``tools`` (for the template; None when absent or empty) and its tool
    calling (None for ``"none"`` or no tools); ``auto_parser``: the server's
    ``--tool-call-parser`` when ``--enable-auto-tool-choice`` is on. A ``ToolError`` names a bad
    field (module docs)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError("parallel_tool_calls", f"parallel_tool_calls must be a boolean, got {shown(parallel)}")
    functions = _functions(tools) if tools is not None else ()
    if choice in (None, "auto") and functions:
        if auto_parser is None:
            raise ToolError("tool_choice", _AUTO)
        return list(tools), ToolChoice(functions, parallel=parallel is not False, parser=auto_parser)
    if choice in (None, "none") or (choice == "required" and tools == []):  # no tools to call: OpenAI's "none"
        return (list(tools) if functions else None), None
    if choice in ("required", "auto"):  # "auto" only without tools: refused below
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


_AUTO = ('tool_choice "auto" (the default with tools) needs the server started with --enable-auto-tool-choice '
         'and --tool-call-parser; use "required", a named function ({"type": "function", "function": '
         '{"name": ...}}) or "none" (the tools are given to the chat template only)')
