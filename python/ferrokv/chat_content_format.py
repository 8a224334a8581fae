"""How a chat template reads a message's content (vLLM's ``chat_template_content_format``):
"string" (one text) or "openai" (a list of ``{"type": "text", "text": ...}`` parts).

"auto" reads the template itself, as vLLM does: one that loops over a message's content
(``{% for part in message['content'] %}``, ``message.content | ...``, or a variable set from it)
reads parts; any other reads a string. Messages reach the template with their text joined
(``ferrokv.inputs.message_text``) and, for "openai", wrapped back into one text part (none for
an empty text: an assistant turn that only called tools).
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
    if content_format == "string":
        return conversation
    return [{**m, "content": [{"type": "text", "text": m["content"]}] if m["content"] else []} for m in conversation]
