"""How a chat template reads a message's content (vLLM's ``chat_template_content_format``):
"string" (one text) or "openai" (a list of ``{"type": "text", "text": ...}`` parts).

"auto" reads the template itself, as vLLM does: one that loops over a message's content
(``{% for part in message['content'] %}``, ``message.content | ...``, or a variable set from it)
reads parts; any other reads a string. A message's text parts (``ferrokv.inputs.message_text``)
reach a "string" template joined with newlines and an "openai" one as they are; a string content
is one part for an "openai" template (none if empty: an assistant turn that only called tools).
Costs: one Jinja parse per distinct template (cached); O(messages) per conversation.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["CONTENT_FORMATS", "detect_content_format", "with_content_format"]

CONTENT_FORMATS = ("auto", "string", "openai")


def _is_content(node: Any, names: set[str]) -> bool:
    """``node`` reads a message's content: ``x['content']``, ``x.content``, a filter of one, or
    a variable set from one."""
    from jinja2 import nodes

    while isinstance(node, nodes.Filter):
        node = node.node
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
    if isinstance(node, nodes.Getattr):
        return node.attr == "content"
    return isinstance(node, nodes.Name) and node.name in names


@functools.lru_cache(maxsize=32)
def detect_content_format(template: str) -> str:
    """ "openai" if ``template`` loops over a message's content, else "string" (also for a
    template that does not parse: rendering will say what is wrong with it)."""
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ast = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except Exception:  # noqa: BLE001  any template error is reported when it is rendered
        return "string"
    names: set[str] = set()
    for assign in ast.find_all(nodes.Assign):
        if isinstance(assign.target, nodes.Name) and _is_content(assign.node, set()):
            names.add(assign.target.name)
    loops = ast.find_all(nodes.For)
    return "openai" if any(_is_content(loop.iter, names) for loop in loops) else "string"


def with_content_format(conversation: list[dict[str, Any]], content_format: str,
                        template: Any) -> list[dict[str, Any]]:
    """``conversation`` (content as text) as ``template`` reads it: ``content_format`` "string",
    "openai", or "auto" (``detect_content_format``; a template that is not one string, such as
    a tokenizer's named set, reads strings)."""
    if content_format not in CONTENT_FORMATS:
        raise ValueError(f"chat_template_content_format must be one of {', '.join(map(repr, CONTENT_FORMATS))}, "
                         f"got {content_format!r}")
    if content_format == "auto":
        content_format = detect_content_format(template) if isinstance(template, str) else "string"
    if content_format == "string":  # parts joined with newlines, as vLLM joins them
        return [{**m, "content": "\n".join(m["content"])} if isinstance(m["content"], tuple) else m
                for m in conversation]
    return [{**m, "content": [{"type": "text", "text": t} for t in _texts(m["content"])]} for m in conversation]


def _texts(content: str | tuple[str, ...]) -> tuple[str, ...]:
    """A checked content's texts, one per part (none for an empty string)."""
    return content if isinstance(content, tuple) else ((content,) if content else ())
