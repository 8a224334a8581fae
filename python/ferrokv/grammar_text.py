"""Turns a ``StructuredOutputsParams`` into llguidance's grammar text: a JSON schema made strict
as vLLM's default backend reads it, a regex, a choice list as one regex lexeme, or a grammar
(Lark, or llama.cpp's GBNF converted to Lark).

Invariants: ``grammar_text`` only builds the text (llguidance validates it when the compiler
builds the matcher); a schema is copied before it is made strict, never changed in place.
Costs: O(size of the spec).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ferrokv.structured_outputs import StructuredOutputsParams

__all__ = ["JSON_WHITESPACE", "grammar_text"]

# JSON's whitespace between tokens by default: any JSON whitespace, as in vLLM, but at most 20
# characters in a run (pretty-printing with room to spare), so a model cannot loop on whitespace
# and a bounded schema bounds the output. ``whitespace_pattern`` overrides it.
JSON_WHITESPACE = r"[ \t\n\r]{0,20}"


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (serialized) of ``params``; not yet validated."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import gbnf_to_lark, is_lark_syntax

    kind = params.kind
    if kind in ("json", "json_object"):
        schema: Any = params.schema_json if kind == "json" else '{"type": "object"}'
        # vLLM's default backend (xgrammar) compiles schemas strictly: an object takes only the
        # properties it lists, where that loses no valid object; the guidance backend's flag
        # asks for every object strict.
        schema = json.loads(schema)
        (_additional_properties_off if params.disable_additional_properties else _strict_objects)(schema)
        # oneOf as anyOf where llguidance cannot prove the branches exclusive, as xgrammar reads it.
        options: dict[str, Any] = {"whitespace_flexible": not params.disable_any_whitespace,
                                   "coerce_one_of": True}
        if params.whitespace_pattern is not None:
            options["whitespace_pattern"] = params.whitespace_pattern
        elif not params.disable_any_whitespace:
            options["whitespace_pattern"] = JSON_WHITESPACE
        return LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        # One lexeme, a regex alternation: as Lark alternatives ("a" | "b" | ...) every choice
        # is an item of the parser's row, and past the parser's row limit decoding fails.
        return LLMatcher.grammar_from_lark(
            "start: /(?:" + "|".join(_regex_literal(c) for c in params.choice) + ")/")
    text = params.grammar
    if "::=" in text and not is_lark_syntax(text):
        text = gbnf_to_lark(_gbnf_unicode_escapes(text))
    return LLMatcher.grammar_from_lark(text)


def _regex_literal(text: str) -> str:
    """``text`` as a regex (llguidance's: Rust's syntax) matching exactly it, inside a Lark
    ``/.../``: letters, digits and non-ASCII as they are, every other character as a hex escape."""
    return "".join(c if c.isalnum() or ord(c) > 127 else f"\\x{{{ord(c):x}}}" for c in text)


def _strict_objects(schema: Any) -> None:
    """vLLM's default (xgrammar's strict mode), where it cannot forbid a valid object: every
    object schema with ``properties`` and no ``additionalProperties`` takes no other keys, except
    one that requires a key it does not list, and none at all in a schema with ``allOf`` or with
    ``properties`` beside an ``anyOf``, ``oneOf`` or ``$ref`` (the parts, and what they refer to,
    each list only some of the object's keys)."""
    if not _mentions(schema, lambda d: "allOf" in d or ("properties" in d and bool(_COMPOSED & d.keys()))):
        _additional_properties_off(schema)


_COMPOSED = frozenset(("anyOf", "oneOf", "$ref"))


def _mentions(schema: Any, test: Callable[[dict[str, Any]], bool]) -> bool:
    """Whether ``test`` holds for the schema or any dict inside it."""
    if isinstance(schema, list):
        return any(_mentions(s, test) for s in schema)
    return isinstance(schema, dict) and (test(schema) or any(_mentions(v, test) for v in schema.values()))


def _additional_properties_off(schema: Any) -> None:
    """In place: every (sub)schema with ``properties``, no ``additionalProperties`` and no
    required key outside ``properties`` gets ``additionalProperties: false``."""
    if isinstance(schema, list):
        for item in schema:
            _additional_properties_off(item)
    elif isinstance(schema, dict):
        props, required = schema.get("properties"), schema.get("required")
        if isinstance(props, dict) and "additionalProperties" not in schema and \
                (not isinstance(required, list) or all(r in props for r in required)):
            schema["additionalProperties"] = False
        for key, value in schema.items():
            if key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
                if isinstance(value, dict):
                    for sub in value.values():
                        _additional_properties_off(sub)
            elif key not in ("enum", "const", "default", "examples", "required"):
                _additional_properties_off(value)


# llama.cpp GBNF's \uXXXX and \UXXXXXXXX escapes, not themselves escaped (an even run of
# backslashes before them).
_GBNF_UNICODE = re.compile(r"(?<!\\)((?:\\\\)*)\\(?:u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8}))")


def _gbnf_unicode_escapes(text: str) -> str:
    """GBNF's unicode escapes in a form llguidance's GBNF converter keeps (it drops their leading
    zeros, which its Lark lexer then refuses): the character itself, or ``\\xHH`` for a control
    character or one with a meaning in a string or a class."""
    def plain(m: re.Match[str]) -> str:
        cp = int(m[2] or m[3], 16)
        if cp > 0x10FFFF or 0xD800 <= cp <= 0xDFFF:
            return m[0]  # not a character: left for llguidance to refuse
        ch = chr(cp)
        return m[1] + (f"\\x{cp:02x}" if cp < 0x20 or cp == 0x7F or ch in '"\\[]-^' else ch)
    return _GBNF_UNICODE.sub(plain, text)
