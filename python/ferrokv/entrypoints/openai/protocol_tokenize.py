"""The bodies of vLLM's ``/tokenize`` and ``/detokenize`` (the same field readers and 400s as
``protocol``'s generation requests).

Invariants: a parser returns a request whose fields have the right types or raises
``OpenAIError(400, ...)`` naming the field. Costs: O(size of the body).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ferrokv.checks import shown
from ferrokv.entrypoints.openai.protocol import _messages, _template, _tools
from ferrokv.entrypoints.openai.protocol_fields import _bool, _is_int, _object, _str, bad

__all__ = ["DetokenizeRequest", "TokenizeRequest", "parse_detokenize_request", "parse_tokenize_request"]


@dataclass(slots=True)
class TokenizeRequest:
    model: str | None
    prompt: str | None
    messages: list[dict[str, Any]] | None
    add_special_tokens: bool
    add_generation_prompt: bool
    template: dict[str, Any]  # with messages: chat_token_ids' template keywords
    return_token_strs: bool = False  # vLLM's: the tokens' strings too (the tokenizer's own spelling)


def parse_tokenize_request(body: Any) -> TokenizeRequest:
    """vLLM's ``/tokenize``: ``{model?, prompt | messages, add_special_tokens?, return_token_strs?}``."""
    body = _object(body)
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        raise bad("prompt", "give exactly one of prompt and messages")
    prompt = _str(body, "prompt")
    messages = _messages(body["messages"]) if has_messages else None
    # vLLM's /tokenize takes tools for the template, and no tool_choice.
    template = _template(body, _tools({"tools": body.get("tools"), "tool_choice": "none"})[0]) if has_messages else {}
    return TokenizeRequest(_str(body, "model"), prompt, messages,
                           _bool(body, "add_special_tokens", not has_messages),
                           _bool(body, "add_generation_prompt", True), template,
                           _bool(body, "return_token_strs", False))


@dataclass(slots=True)
class DetokenizeRequest:
    model: str | None
    tokens: list[int]


def parse_detokenize_request(body: Any, vocab_size: int) -> DetokenizeRequest:
    """vLLM's ``/detokenize``: ``{model?, tokens}``; every id inside the vocabulary."""
    body = _object(body)
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise bad("tokens", f"tokens must be a list of integers, got {shown(tokens)}")
    for i, t in enumerate(tokens):
        if not _is_int(t) or not 0 <= t < vocab_size:
            raise bad("tokens", f"tokens[{i}] must be an integer in [0, {vocab_size}), got {shown(t)}")
    return DetokenizeRequest(_str(body, "model"), tokens)
