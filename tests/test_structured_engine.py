"""Structured outputs end to end: ``LLM.generate`` and ``LLMEngine.step`` decoding under JSON
schemas, regexes, choice lists and Lark/GBNF grammars (tests/test_structured_outputs.py tests the
module itself with random logits).

The battery holds only bounded constraints (enums, strings with ``maxLength``, arrays with
``maxItems``, integers with ``minimum``/``maximum`` -- llguidance's integer range is exact, no
leading zeros -- never ``number`` ranges, which admit unbounded decimals; JSON whitespace runs are
bounded by ``JSON_WHITESPACE`` or a narrower ``whitespace_pattern``), so every output must finish
with ``stop`` within ``max_tokens`` and must then match its constraint: JSON parsed and validated
with ``jsonschema``, regexes with Python's ``re.fullmatch`` (``[0-9]``, never ``\\d``, which is
Unicode's in llguidance), choices by membership, grammars by an equivalent Python regex. Greedy and
seeded sampling (n=2 for some), in one mixed batch with unconstrained requests, overlap on and
off, under preemption and chunked prefill, streamed, aborted, and combined with logit_bias,
min_tokens and stop strings. Tiny random llama (its tokenizer's EOS is id 0), CPU, fp32; a
smaller battery on the embedded SmolLM2 (slow).
"""

from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest

from ferrokv import LLM, SamplingParams
from ferrokv.engine import EngineArgs, LLMEngine
from ferrokv.outputs import RequestOutputKind
from ferrokv.structured_outputs import GrammarCompiler, StructuredOutputsParams as SOP
from helpers.engine_faults import RunnerHook, assert_idle, drive, raise_on

MAX_MODEL_LEN = 512
MAX_TOKENS = 256
BASE = dict(device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, block_size=16, num_kv_blocks=1024)

# --- the battery ------------------------------------------------------------------------------------
NARROW_WS = r"[ \n]{0,2}"  # a few gaps x at most 2 characters: sampled outputs stay short
SCHEMAS = [
    # 0: an enum of strings, numbers, null and a boolean
    ({"enum": ["red", "green", "blue", 3, 4.5, -7, None, True]}, {}),
    # 1: an object with required strings of bounded length
    ({"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                       "city": {"type": "string", "minLength": 1, "maxLength": 4}},
      "required": ["name", "city"], "additionalProperties": False}, {}),
    # 2: an array of enums with minItems/maxItems
    ({"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
     {"whitespace_pattern": NARROW_WS}),
    # 3: nested objects, an integer range, a boolean, a bounded array of mixed enums
    ({"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                                  "admin": {"type": "boolean"}},
                 "required": ["id", "admin"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": [1, 2, "x"]}, "maxItems": 2}},
      "required": ["user", "tags"], "additionalProperties": False}, {"disable_any_whitespace": True}),
    # 4: a boolean
    ({"type": "boolean"}, {}),
    # 5: an integer range, negative to three digits
    ({"type": "integer", "minimum": -20, "maximum": 300}, {}),
    # 6: an optional property and a nullable bounded integer
    ({"type": "object", "properties": {"ok": {"type": "boolean"},
                                       "n": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 3},
                                                       {"type": "null"}]},
                                       "note": {"type": "string", "maxLength": 3}},
      "required": ["ok", "n"], "additionalProperties": False}, {"whitespace_pattern": NARROW_WS}),
    # 7: a fixed-size array of short strings, and a const
    ({"type": "object", "properties": {"v": {"const": "x1"},
                                       "pair": {"type": "array", "items": {"type": "string", "maxLength": 3},
                                                "minItems": 2, "maxItems": 2}},
      "required": ["v", "pair"], "additionalProperties": False}, {"disable_any_whitespace": True}),
]
REGEXES = [r"[a-c]{2,5}x", r"(yes|no)!", r"[0-9]{4}-[0-9]{2}-[0-9]{2}", r"(ab|cd){1,3}e",
           r"[a-z]{1,3}( [a-z]{1,3})?\."]
CHOICES = [["yes", "no"], ["the cat", "the dog", "the cat sat"], ["α", "béta", "中文", "x\"y"]]
LARK = 'start: greeting " " NAME\ngreeting: "hi" | "hello"\nNAME: /[a-z]{1,5}/'
LARK_RE = r"(hi|hello) [a-z]{1,5}"
GBNF = 'root ::= answer "=" digit digit?\nanswer ::= "yes" | "no"\ndigit ::= [0-9]'
GBNF_RE = r"(yes|no)=[0-9]{1,2}"
GRAMMARS = [(LARK, LARK_RE), (GBNF, GBNF_RE)]

# (structured_outputs as given: a dict, or a StructuredOutputsParams for some, as callers may)
BATTERY: list[dict | SOP] = (
    [{"json": s, **opts} for s, opts in SCHEMAS[:4]] + [SOP(json=s, **opts) for s, opts in SCHEMAS[4:]]
    + [{"regex": r} for r in REGEXES] + [{"choice": c} for c in CHOICES] + [{"grammar": g} for g, _ in GRAMMARS]
)
PROMPTS = ["Answer in JSON:", "the cat sees", "Give me a date", "hello", "My friend likes the red ball",
           "a small bird", "count:", "x"]


def _params(so: dict | SOP) -> SOP:
    return so if isinstance(so, SOP) else SOP.from_dict(so)


def check_text(so: dict | SOP, text: str) -> None:
    """``text`` matches the constraint ``so`` (AssertionError, or jsonschema's error, if not)."""
    p = _params(so)
    if p.kind == "json":
        jsonschema.validate(json.loads(text), p.json if isinstance(p.json, dict) else json.loads(p.json))
    elif p.kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif p.kind == "regex":
        assert re.fullmatch(p.regex, text), (p.regex, text)
    elif p.kind == "choice":
        assert text in p.choice, (p.choice, text)
    else:
        assert re.fullmatch(dict(GRAMMARS)[p.grammar], text), (p.grammar, text)


def battery_requests() -> list[tuple[str, SamplingParams]]:
    """Every constraint greedy (n=1) and sampled (temperature 1, seeded; n=2 for every other one)."""
    reqs = []
    for i, so in enumerate(BATTERY):
        reqs.append((PROMPTS[i % len(PROMPTS)],
                     SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=so)))
        reqs.append((PROMPTS[(i + 3) % len(PROMPTS)],
                     SamplingParams(temperature=1.0, seed=100 + i, n=2 if i % 2 == 0 else 1, max_tokens=MAX_TOKENS,
                                    structured_outputs=so)))
    return reqs


UNCONSTRAINED = [("the engine", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)),
                 ("every request samples", SamplingParams(temperature=0.0, max_tokens=17))]


def records(outputs) -> list[list[tuple]]:
    return [[(c.index, list(c.token_ids), c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
            for o in outputs]


def assert_battery_valid(outputs, reqs) -> None:
    assert len(outputs) == len(reqs)
    for o, (_, params) in zip(outputs, reqs):
        assert len(o.outputs) == params.n
        for c in o.outputs:
            assert c.finish_reason == "stop", (params.structured_outputs, c.text, c.finish_reason)
            assert c.stop_reason is None  # EOS, not a stop string or stop token
            check_text(params.structured_outputs, c.text)


def assert_no_leak(engine: LLMEngine) -> None:
    assert not engine.grammar_rows.has_any()
    assert_idle(engine)


@pytest.fixture(scope="module")
def llm(llama_path):
    return LLM(str(llama_path), **BASE)


@pytest.fixture(scope="module")
def overlap_llm(llama_path):
    return LLM(str(llama_path), overlap=True, **BASE)


@pytest.fixture(scope="module")
def battery_run(llm):
    """The battery plus unconstrained greedy requests in ONE generate call (overlap off)."""
    reqs = battery_requests() + UNCONSTRAINED
    outputs = llm.generate([p for p, _ in reqs], [sp for _, sp in reqs], use_tqdm=False)
    return reqs, outputs


# --- the mixed battery --------------------------------------------------------------------------------
def test_battery_in_one_batch_finishes_and_validates(llm, battery_run):
    reqs, outputs = battery_run
    n = len(UNCONSTRAINED)
    assert_battery_valid(outputs[:-n], reqs[:-n])
    assert_no_leak(llm.llm_engine)
    # Not one matcher shared by everyone: the sampled outputs of a constraint are not all alike.
    texts = {c.text for o in outputs[:-n] for c in o.outputs}
    assert len(texts) > len(BATTERY)


def test_unconstrained_requests_unaffected_by_grammar_rows(llm, battery_run):
    """The unconstrained greedy requests of the mixed batch produce what they produce alone."""
    reqs, outputs = battery_run
    for (prompt, params), mixed in zip(UNCONSTRAINED, outputs[-len(UNCONSTRAINED):]):
        alone = llm.generate([prompt], params, use_tqdm=False)
        assert records(alone) == records([mixed])
    assert outputs[-2].outputs[0].finish_reason == "length" and len(outputs[-2].outputs[0].token_ids) == 24


@pytest.mark.parametrize("idx", range(len(BATTERY)))
def test_constraint_alone_equals_in_batch(llm, battery_run, idx):
    """A constrained request (greedy, and seeded) gives the same tokens alone as in the batch."""
    reqs, outputs = battery_run
    pair = reqs[2 * idx: 2 * idx + 2]
    alone = llm.generate([p for p, _ in pair], [sp for _, sp in pair], use_tqdm=False)
    assert records(alone) == records(outputs[2 * idx: 2 * idx + 2])


def test_overlap_on_and_off_identical(overlap_llm, battery_run):
    reqs, off = battery_run
    on_llm = overlap_llm
    assert on_llm.llm_engine.overlap is True
    on = on_llm.generate([p for p, _ in reqs], [sp for _, sp in reqs], use_tqdm=False)
    assert records(on) == records(off)
    assert_no_leak(on_llm.llm_engine)


def test_json_object(llm):
    """Any JSON object: unbounded, so only outputs that finish with stop are checked."""
    so = {"json_object": True}
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=so),
              SamplingParams(temperature=1.0, seed=3, n=4, max_tokens=MAX_TOKENS, structured_outputs=so),
              SamplingParams(temperature=1.0, seed=4, n=2, max_tokens=MAX_TOKENS,
                             structured_outputs=SOP(json_object=True, disable_any_whitespace=True))]
    outputs = llm.generate(["Answer in JSON:"] * len(params), params, use_tqdm=False)
    stopped = 0
    for o in outputs:
        for c in o.outputs:
            assert c.finish_reason in ("stop", "length")
            assert c.text.lstrip().startswith("{")
            if c.finish_reason == "stop":
                stopped += 1
                assert isinstance(json.loads(c.text), dict), c.text
    assert stopped >= 1
    assert_no_leak(llm.llm_engine)


# --- preemption and chunked prefill -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def long_prompt_run(llama_path):
    """The battery with longer prompts (so that preemption and chunking have much to redo),
    roomy cache: the reference of test_preemption_and_chunked_prefill."""
    reqs = [({"prompt_token_ids": [(7 * i + 3 * j) % 397 + 3 for j in range(20 + i % 17)]}, sp)
            for i, (_, sp) in enumerate(battery_requests())]
    llm = LLM(str(llama_path), **{**BASE, "max_model_len": 160})
    outputs = llm.generate([p for p, _ in reqs], [sp for _, sp in reqs], use_tqdm=False)
    assert_battery_valid(outputs, reqs)
    assert llm.llm_engine.stats()["preemptions"] == 0
    return reqs, outputs


@pytest.mark.parametrize("config", [
    # A request is admitted only if its samples fit unshared: 2 x 160 / 4 = 80 blocks.
    dict(block_size=4, num_kv_blocks=84, preemption_mode="recompute"),
    dict(block_size=4, num_kv_blocks=84, preemption_mode="swap", num_cpu_blocks=1024),
    dict(block_size=4, num_kv_blocks=1024, max_num_seqs=8, max_num_batched_tokens=8, enable_prefix_caching=False),
], ids=["recompute", "swap", "chunked-prefill"])
def test_preemption_and_chunked_prefill(llama_path, long_prompt_run, config):
    """A cache so small that sequences are preempted (recomputed or swapped), or a token budget so
    small that prompts are prefilled in chunks: the matchers keep their place, every output still
    validates, and equals the roomy run (greedy, and seeded sampling)."""
    reqs, ample = long_prompt_run
    small_llm = LLM(str(llama_path), **{**BASE, "max_model_len": 160, **config})
    outputs = small_llm.generate([p for p, _ in reqs], [sp for _, sp in reqs], use_tqdm=False)
    assert_battery_valid(outputs, reqs)
    assert records(outputs) == records(ample)
    st = small_llm.llm_engine.stats()
    assert st["capacity_aborts"] == 0, st
    if config.get("preemption_mode") == "recompute":
        assert st["recompute_preemptions"] > 0 and st["output_tokens_recomputed"] > 0, st
    elif config.get("preemption_mode") == "swap":
        assert st["swap_preemptions"] > 0, st
    else:
        assert st["max_step_tokens"] <= 8 and st["preemptions"] == 0, st
    assert_no_leak(small_llm.llm_engine)


# --- the engine's step loop: streaming and aborts -------------------------------------------------------
def tiny_engine(path, **kw) -> LLMEngine:
    return LLMEngine(EngineArgs(model=str(path), **{**BASE, **kw}))


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_streaming_deltas_concatenate_to_valid_json(llama_path, overlap):
    engine = tiny_engine(llama_path, overlap=overlap)
    so = {"json": SCHEMAS[3][0], **SCHEMAS[3][1]}
    kinds = {"delta-greedy": SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=so,
                                            output_kind=RequestOutputKind.DELTA),
             "delta-n2": SamplingParams(temperature=1.0, seed=9, n=2, max_tokens=MAX_TOKENS, structured_outputs=so,
                                        output_kind=RequestOutputKind.DELTA),
             "cumulative": SamplingParams(temperature=1.0, seed=10, max_tokens=MAX_TOKENS,
                                          structured_outputs={"regex": REGEXES[2]},
                                          output_kind=RequestOutputKind.CUMULATIVE),
             "final": SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=so,
                                     output_kind=RequestOutputKind.FINAL_ONLY)}
    for rid, params in kinds.items():
        engine.add_request(rid, "Answer in JSON:", params)
    texts: dict[tuple[str, int], str] = {}
    tokens: dict[tuple[str, int], list[int]] = {}
    last: dict[tuple[str, int], object] = {}
    counts: dict[str, int] = {}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        assert steps < 2000
        for o in engine.step():
            counts[o.request_id] = counts.get(o.request_id, 0) + 1
            for c in o.outputs:
                key = (o.request_id, c.index)
                if kinds[o.request_id].output_kind == RequestOutputKind.DELTA:
                    texts[key] = texts.get(key, "") + c.text
                    tokens[key] = tokens.get(key, []) + list(c.token_ids)
                else:
                    texts[key], tokens[key] = c.text, list(c.token_ids)
                last[key] = c
    assert_no_leak(engine)
    assert counts["final"] == 1 and counts["delta-greedy"] > 3
    assert set(texts) == {("delta-greedy", 0), ("delta-n2", 0), ("delta-n2", 1), ("cumulative", 0), ("final", 0)}
    for (rid, _), text in texts.items():
        assert last[(rid, _)].finish_reason == "stop"
        check_text(kinds[rid].structured_outputs, text)
    # Deltas decode to what the tokens decode to, and the greedy stream equals the final-only run.
    tok = engine.tokenizer
    for key, text in texts.items():
        assert tok.decode(tokens[key], skip_special_tokens=True) == text
    assert texts[("delta-greedy", 0)] == texts[("final", 0)]
    assert tokens[("delta-greedy", 0)] == tokens[("final", 0)]


def test_abort_mid_generation_releases_matchers_and_blocks(llama_path):
    engine = tiny_engine(llama_path, block_size=4, num_kv_blocks=256)
    # Long: a string of up to 200 characters with whitespace around it, and many samples.
    long_schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 200}},
                   "required": ["s"], "additionalProperties": False}
    engine.add_request("a", "the cat", SamplingParams(temperature=1.0, seed=1, n=3, max_tokens=MAX_TOKENS,
                                                     structured_outputs={"json": long_schema}))
    engine.add_request("b", "a dog", SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                   structured_outputs={"regex": REGEXES[0]}))
    engine.add_request("c", "my friend", SamplingParams(temperature=1.0, seed=2, max_tokens=MAX_TOKENS,
                                                       structured_outputs={"json": long_schema}))
    seen: dict[str, object] = {}
    for _ in range(4):
        for o in engine.step():
            seen[o.request_id] = o
    assert engine.grammar_rows.has_any()
    assert all(rid not in seen or not seen[rid].finished for rid in ("a", "c"))
    engine.abort_request(["a", "c"])
    last = drive(engine)
    seen.update(last)
    assert_no_leak(engine)
    assert seen["b"].finished and seen["b"].outputs[0].finish_reason == "stop"
    check_text({"regex": REGEXES[0]}, seen["b"].outputs[0].text)
    # The aborted ids are free again, and a new request under the same grammar decodes normally.
    engine.add_request("a", "the cat", SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                     structured_outputs={"json": SCHEMAS[1][0]}))
    out = drive(engine)["a"].outputs[0]
    assert out.finish_reason == "stop"
    check_text({"json": SCHEMAS[1][0]}, out.text)
    assert_no_leak(engine)


def test_abort_while_overlapped(llama_path):
    """Overlap on: an abort between steps, while a step of the request is pending."""
    engine = tiny_engine(llama_path, overlap=True)
    so = {"json": SCHEMAS[1][0]}
    for i in range(4):
        engine.add_request(str(i), PROMPTS[i], SamplingParams(temperature=1.0, seed=i, n=2, max_tokens=MAX_TOKENS,
                                                              structured_outputs=so))
    engine.step()
    engine.step()
    engine.abort_request(["1", "3"])
    last = drive(engine)
    assert_no_leak(engine)
    for rid in ("0", "2"):
        for c in last[rid].outputs:
            assert c.finish_reason == "stop"
            check_text(so, c.text)


@pytest.mark.parametrize("call", [1, 4], ids=["prefill", "decode"])
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_a_failed_step_leaves_the_matchers_in_place(llama_path, battery_run, call, overlap):
    """A step whose forward pass raises is cancelled before any matcher moved (they advance only
    after update()): a caller that keeps stepping gets the outputs of a clean run."""
    reqs, clean = battery_run
    sub = reqs[:16]
    engine = tiny_engine(llama_path, overlap=overlap)
    for i, (prompt, params) in enumerate(sub):
        engine.add_request(str(i), prompt, params)
    hook = RunnerHook(engine, raise_on(call, RuntimeError("runner failed")))
    last = drive(engine, fails=RuntimeError)
    assert hook.calls > call and engine.stats()["cancelled_steps"] == 1
    assert records([last[str(i)] for i in range(len(sub))]) == records(clean[:len(sub)])
    assert_no_leak(engine)


# --- errors and the compile cache -------------------------------------------------------------------------
@pytest.mark.parametrize("so, field", [
    ({"regex": "[a-"}, "regex"),
    ({"regex": "(ab"}, "regex"),
    ({"json": {"type": "foo"}}, "json"),
    ({"json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}, "json"),
    ({"grammar": "root ::= foo"}, "grammar"),
    ({"grammar": "start: undefined_rule"}, "grammar"),
    ({"choice": []}, "choice"),
])
def test_invalid_constraint_rejected_at_add_request(llama_path, so, field):
    engine = tiny_engine(llama_path)
    free = engine.num_free_blocks
    with pytest.raises(ValueError, match=rf"structured_outputs\.{field}"):
        engine.add_request("r", "the cat", SamplingParams(max_tokens=8, structured_outputs=so))
    assert not engine.has_unfinished_requests() and not engine.grammar_rows.has_any()
    assert engine.num_free_blocks == free
    # The engine serves the next request normally, under the same id, constrained or not.
    engine.add_request("r", "the cat", SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                     structured_outputs={"regex": REGEXES[1]}))
    engine.add_request("u", "the cat", SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    last = drive(engine)
    assert last["r"].outputs[0].finish_reason == "stop"
    check_text({"regex": REGEXES[1]}, last["r"].outputs[0].text)
    assert len(last["u"].outputs[0].token_ids) == 6
    assert_no_leak(engine)


def test_a_tokenizer_the_backend_cannot_take_is_a_clear_error(llama_path, tmp_path):
    """A tokenizer llguidance cannot wrap (here one with no decoder) refuses every constrained
    request with a ValueError naming structured_outputs, not llguidance's bare message; it is
    tried once; unconstrained requests run."""
    import shutil

    from tokenizers import Tokenizer

    model = tmp_path / "no_decoder"
    shutil.copytree(llama_path, model)
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    tok.decoder = None
    tok.save(str(model / "tokenizer.json"))
    engine = tiny_engine(model)
    for rid in ("a", "b"):
        with pytest.raises(ValueError, match=r"^structured_outputs: .*cannot use this model's tokenizer .*decoder"):
            engine.add_request(rid, "the cat", SamplingParams(max_tokens=4, structured_outputs={"regex": "a+"}))
    engine.add_request("u", "the cat", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(drive(engine)["u"].outputs[0].token_ids) == 3
    assert_no_leak(engine)


def test_a_grammar_held_until_its_add_is_not_built_again(llama_path, monkeypatch):
    """A caller (AsyncLLM, EngineLoop) compiles a request's grammar, holds it, and the engine's
    add finds it however many grammars were compiled meanwhile (the LRU cache evicted it): no
    second build, which would run on the engine loop's thread and stall every running request."""
    from ferrokv import grammar_compiler

    monkeypatch.setattr(grammar_compiler, "GRAMMAR_CACHE_SIZE", 2)
    engine = tiny_engine(llama_path)
    builds = []
    real_build = GrammarCompiler._build
    monkeypatch.setattr(GrammarCompiler, "_build", lambda self, p: builds.append(p.regex) or real_build(self, p))
    held = engine.compile_grammar(SOP(regex="(ab)+"))
    for i in range(20):  # more than any cache size
        engine.compile_grammar(SOP(regex=f"x{i}+"))
    engine.add_request("r", "the cat", SamplingParams(temperature=0.0, max_tokens=6,
                                                     structured_outputs={"regex": "(ab)+"}))
    assert builds.count("(ab)+") == 1 and held.kind == "regex"
    assert drive(engine)["r"].outputs[0].text.startswith("ab")
    assert_no_leak(engine)


def test_an_offline_batch_compiles_its_grammars_side_by_side(llama_path, monkeypatch):
    """LLM.generate starts every distinct grammar's compile at once, so the compile threads work
    side by side (each submit used to wait for its own before the next began)."""
    import time

    from helpers.engine_faults import tiny_llm

    spans: list[tuple[float, float]] = []
    real_build = GrammarCompiler._build

    def slow_build(self, p):
        t0 = time.monotonic()
        time.sleep(0.2)
        compiled = real_build(self, p)
        spans.append((t0, time.monotonic()))
        return compiled

    monkeypatch.setattr(GrammarCompiler, "_build", slow_build)
    llm = tiny_llm(llama_path)
    regexes = ["(ab)+", "(cd)+", "(ef)+", "(gh)+"]
    params = [SamplingParams(temperature=0.0, max_tokens=4, structured_outputs={"regex": r}) for r in regexes]
    outs = llm.generate(["the cat"] * len(regexes), params, use_tqdm=False)
    assert [o.outputs[0].text[:2] for o in outs] == ["ab", "cd", "ef", "gh"]
    overlapping = sum(a0 < b1 and b0 < a1 for i, (a0, a1) in enumerate(spans) for b0, b1 in spans[i + 1:])
    assert len(spans) == len(regexes) and overlapping >= 1, spans


def test_two_kinds_rejected(llm):
    with pytest.raises(ValueError, match=r"exactly one of structured_outputs\.json"):
        SamplingParams(structured_outputs={"json": {"type": "boolean"}, "regex": "a"})
    with pytest.raises(ValueError, match="got json, regex"):
        llm.generate(["x"], SamplingParams(structured_outputs={"json": {"type": "boolean"}, "regex": "a"}),
                     use_tqdm=False)
    with pytest.raises(ValueError, match=r"unknown field structured_outputs\.jsn"):
        SamplingParams(structured_outputs={"jsn": {}})


def test_params_assigned_after_construction_are_checked_again(llama_path):
    """add_request checks a request's params again (fields may have been assigned since
    construction, engine.add_request's docs): a second kind assigned to the
    StructuredOutputsParams afterwards is rejected, as at construction."""
    engine = tiny_engine(llama_path)
    p = SamplingParams(temperature=0.0, max_tokens=16, structured_outputs={"regex": "a"})
    p.structured_outputs.choice = ["b"]
    with pytest.raises(ValueError, match="exactly one of"):
        engine.add_request("r", "x", p)
    assert not engine.has_unfinished_requests() and not engine.grammar_rows.has_any()


def test_schema_assigned_after_construction_is_the_one_decoded(llama_path):
    """A schema assigned after construction is the one the request decodes under (or is
    rejected), never the schema the params were constructed with."""
    engine = tiny_engine(llama_path)
    p = SamplingParams(temperature=0.0, max_tokens=16, structured_outputs={"json": {"type": "boolean"}})
    p.structured_outputs.json = {"enum": ["abc"]}
    engine.add_request("r", "x", p)
    out = drive(engine)["r"].outputs[0]
    assert out.text == '"abc"', out.text
    assert_no_leak(engine)


def test_generate_with_an_invalid_constraint_among_valid_ones(llm):
    """One bad request in a generate call: ValueError naming the field, nothing left running,
    and the next call works."""
    good = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs={"regex": REGEXES[0]})
    bad = SamplingParams(max_tokens=8, structured_outputs={"json": {"type": "foo"}})
    with pytest.raises(ValueError, match=r"structured_outputs\.json"):
        llm.generate(["a", "b", "c"], [good, bad, good], use_tqdm=False)
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and not engine.grammar_rows.has_any()
    outs = llm.generate(["a", "c"], [good, good], use_tqdm=False)
    for o in outs:
        assert o.outputs[0].finish_reason == "stop"
        check_text(good.structured_outputs, o.outputs[0].text)
    assert_no_leak(engine)


def test_same_schema_compiles_once(llama_path, monkeypatch):
    engine = tiny_engine(llama_path)
    schema = SCHEMAS[3][0]
    reordered = json.loads(json.dumps(schema))
    reordered = {k: reordered[k] for k in reversed(list(reordered))}  # keyword order does not matter
    a = engine.compile_grammar(SOP(json=schema))
    assert engine.compile_grammar(SOP(json=schema)) is a
    assert engine.compile_grammar(SOP(json=json.dumps(reordered))) is a
    assert engine.compile_grammar(SOP(json=schema, disable_any_whitespace=True)) is not a
    r = engine.compile_grammar(SOP(regex=REGEXES[0]))
    assert engine.compile_grammar(SOP.from_dict({"regex": REGEXES[0]})) is r
    # Through add_request: requests sharing a schema share the one compiled grammar.
    builds = []
    real_build = GrammarCompiler._build

    def counting_build(self, params):
        builds.append(params.cache_key())
        return real_build(self, params)

    monkeypatch.setattr(GrammarCompiler, "_build", counting_build)
    for i in range(3):
        engine.add_request(f"s{i}", PROMPTS[i], SamplingParams(temperature=1.0, seed=i, max_tokens=MAX_TOKENS,
                                                               structured_outputs={"json": schema}))
        engine.add_request(f"c{i}", PROMPTS[i], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                               structured_outputs={"choice": CHOICES[1]}))
    assert len(builds) == 1  # the schema hit the cache; the choice list compiled once
    last = drive(engine)
    for rid, o in last.items():
        assert o.outputs[0].finish_reason == "stop"
        check_text({"json": schema} if rid.startswith("s") else {"choice": CHOICES[1]}, o.outputs[0].text)
    assert_no_leak(engine)


# --- combined with other sampling options ----------------------------------------------------------------
def test_with_logit_bias(llm):
    """A large bias cannot push a token the grammar forbids: the mask is applied too. Biasing EOS
    (id 0) does not end a constrained output early; biasing an allowed token steers within it."""
    tok = llm.get_tokenizer()
    x_id = tok.encode("x")[0]
    z_id = tok.encode("z")[0]
    params = []
    for so in ({"regex": REGEXES[0]}, {"json": SCHEMAS[2][0], **SCHEMAS[2][1]}, {"choice": CHOICES[0]},
               {"json": SCHEMAS[1][0]}):
        for bias in ({0: 100.0}, {z_id: 100.0, x_id: -100.0}, {x_id: 50.0}):
            params.append(SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logit_bias=bias,
                                         structured_outputs=so))
            params.append(SamplingParams(temperature=1.0, seed=5, max_tokens=MAX_TOKENS, logit_bias=bias,
                                         structured_outputs=so))
    outputs = llm.generate(["hello"] * len(params), params, use_tqdm=False)
    for o, p in zip(outputs, params):
        c = o.outputs[0]
        assert c.finish_reason == "stop", (p.structured_outputs, p.logit_bias, c.text)
        check_text(p.structured_outputs, c.text)
        if p.structured_outputs.kind == "regex" and p.logit_bias == {x_id: 50.0}:
            # 'x' is allowed once two of [a-c] came: a strong bias on it makes the shortest output.
            assert len(c.text) == 3, c.text
    assert_no_leak(llm.llm_engine)


def test_with_logprobs_and_prompt_logprobs(llm, battery_run):
    """Logprobs and prompt logprobs (the prompt's rows are cut from the logits before the masks)
    change no token; each sampled token has a finite logprob."""
    reqs, ample = battery_run
    idx = [0, 3, 6, 17, 26, 33]
    params = [SamplingParams(temperature=reqs[i][1].temperature, seed=reqs[i][1].seed, n=reqs[i][1].n,
                             max_tokens=MAX_TOKENS, structured_outputs=reqs[i][1].structured_outputs,
                             logprobs=2, prompt_logprobs=1) for i in idx]
    outputs = llm.generate([reqs[i][0] for i in idx], params, use_tqdm=False)
    assert records(outputs) == records([ample[i] for i in idx])
    for o in outputs:
        assert o.prompt_logprobs is not None and len(o.prompt_logprobs) == len(o.prompt_token_ids)
        for c in o.outputs:
            assert len(c.logprobs) == len(c.token_ids)
            for t, entry in zip(c.token_ids, c.logprobs):
                assert math.isfinite(entry[t].logprob), (t, entry)
    assert_no_leak(llm.llm_engine)


def test_with_min_tokens(llm):
    """min_tokens below the shortest output in tokens: EOS is blocked only where the grammar
    blocks it too, so outputs are unchanged and valid.

    (min_tokens above the longest output is inherently conflicting: the grammar then allows only
    EOS and min_tokens forbids EOS, so every token is masked; nothing about that output is
    asserted beyond the engine surviving it, see test_conflicting_options_do_not_break_the_engine.)"""
    tok = llm.get_tokenizer()
    date = REGEXES[2]  # exactly 10 characters of [0-9-]
    longest = max(len(tok.convert_tokens_to_string([t])) for t in tok.get_vocab()
                  if re.fullmatch(r"[0-9-]+", tok.convert_tokens_to_string([t])))
    min_tokens = math.ceil(10 / longest)
    assert min_tokens >= 2
    base = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs={"regex": date}),
            SamplingParams(temperature=1.0, seed=8, n=2, max_tokens=MAX_TOKENS, structured_outputs={"regex": date})]
    with_min = [SamplingParams(temperature=p.temperature, seed=p.seed, n=p.n, max_tokens=MAX_TOKENS,
                               min_tokens=min_tokens, structured_outputs={"regex": date}) for p in base]
    a = llm.generate(["Give me a date"] * 2, base, use_tqdm=False)
    b = llm.generate(["Give me a date"] * 2, with_min, use_tqdm=False)
    assert records(a) == records(b)
    for o in b:
        for c in o.outputs:
            assert c.finish_reason == "stop" and len(c.token_ids) >= min_tokens
            check_text({"regex": date}, c.text)
    assert_no_leak(llm.llm_engine)


def test_conflicting_options_do_not_break_the_engine(llm):
    """Inherently conflicting: min_tokens=8, or ignore_eos, on a two-token choice. Once the choice
    is complete the grammar allows only EOS, which min_tokens / ignore_eos forbid to end the
    sequence (min_tokens even masks it, so every logit is -inf), so the output itself is not
    checked; the request ends by EOS after min_tokens or at max_tokens, nothing leaks, and the
    next request is served."""
    for kw in (dict(min_tokens=8), dict(min_tokens=8, temperature=1.0, seed=1), dict(ignore_eos=True)):
        p = SamplingParams(**{"temperature": 0.0, "max_tokens": 16, "structured_outputs": {"choice": ["yes", "no"]},
                              **kw})
        out = llm.generate(["hello"], p, use_tqdm=False)[0].outputs[0]
        assert out.finish_reason in ("stop", "length")
        assert_no_leak(llm.llm_engine)
    good = llm.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                  structured_outputs={"choice": ["yes", "no"]}), use_tqdm=False)
    assert good[0].outputs[0].finish_reason == "stop" and good[0].outputs[0].text in ("yes", "no")


def test_a_grammar_that_fails_while_decoding_ends_its_sequence_with_a_warning(llm, caplog):
    """``(a{1000}){1000}`` compiles and validates, but llguidance's lexer gives up ("too many
    expressions") once the first token is consumed: the matcher falls into error, the sequence
    ends (only EOS is allowed), a warning says why, nothing leaks, and the grammar's cached
    template is unharmed (the same request again behaves the same)."""
    p = SamplingParams(temperature=0.0, max_tokens=16, structured_outputs={"regex": "(a{1000}){1000}"})
    runs = []
    for _ in range(2):
        caplog.clear()
        with caplog.at_level("WARNING", logger="ferrokv"):
            out = llm.generate(["hello"], p, use_tqdm=False)[0].outputs[0]
        assert "grammar matcher failed" in caplog.text and "too many expressions" in caplog.text, caplog.text
        assert out.finish_reason == "stop" and len(out.token_ids) < 16
        runs.append((out.token_ids, out.text))
        assert_no_leak(llm.llm_engine)
    assert runs[0] == runs[1] and runs[0][1].startswith("a"), runs


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_with_stop_strings(request, battery_run, overlap):
    """A stop string that no valid output contains changes nothing. One that a valid output may
    contain is inherently conflicting: the output is cut before it (not a full match), so only
    that it is a prefix of the language is asserted. With overlap on, a stop string is found a
    step late: the row the stop string ended is still in the next step."""
    llm = request.getfixturevalue("overlap_llm" if overlap else "llm")
    reqs, ample = battery_run
    n = len(UNCONSTRAINED)
    sub = reqs[:-n]
    # No output of the battery contains "@@" (no constraint admits '@'): identical outputs.
    stopped = [(p, SamplingParams(temperature=sp.temperature, seed=sp.seed, n=sp.n, max_tokens=sp.max_tokens,
                                  structured_outputs=sp.structured_outputs, stop=["@@"])) for p, sp in sub]
    outputs = llm.generate([p for p, _ in stopped], [sp for _, sp in stopped], use_tqdm=False)
    assert records(outputs) == records(ample[:-n])
    # "c" cuts "[a-c]{2,5}x" outputs: what is left is a proper prefix of the language.
    compiled = llm.llm_engine.compile_grammar(SOP(regex=REGEXES[0]))
    tok = llm.get_tokenizer()
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=MAX_TOKENS, stop=["c"],
                             structured_outputs={"regex": REGEXES[0]}) for s in range(8)]
    cut = 0
    for o in llm.generate(["hello"] * len(params), params, use_tqdm=False):
        c = o.outputs[0]
        assert c.finish_reason == "stop"
        if c.stop_reason == "c":
            cut += 1
            assert re.fullmatch(r"[ab]{0,4}", c.text), c.text
            m = compiled.new_matcher()
            assert m.consume_tokens(tok.encode(c.text + "c")) and not m.is_error()
        else:
            assert c.stop_reason is None
            check_text({"regex": REGEXES[0]}, c.text)
    assert cut > 0
    assert_no_leak(llm.llm_engine)


# --- the embedded SmolLM2 ---------------------------------------------------------------------------------
SMOL_BATTERY = [
    ({"json": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                "age": {"type": "integer", "minimum": 0, "maximum": 120}},
               "required": ["name", "age"], "additionalProperties": False}},
     "Give a person's name and age as JSON."),
    ({"json": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                                "ok": {"type": "boolean"}},
               "required": ["color", "ok"], "additionalProperties": False}},
     "Pick a color, as JSON with the keys color and ok."),
    ({"json": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3}},
     "List up to three fruits as a JSON array."),
    ({"regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"}, "What is the date of the first moon landing (YYYY-MM-DD)?"),
    ({"regex": r"(Yes|No)\. [A-Z][a-z]{1,10}\."}, "Is the sky blue? Answer yes or no, then one word."),
    ({"choice": ["Paris", "London", "Berlin"]}, "What is the capital of France?"),
]


@pytest.mark.slow
def test_smollm2_battery(smollm2_llm):
    llm = smollm2_llm
    convs = [[{"role": "user", "content": q}] for _, q in SMOL_BATTERY]
    params = [SamplingParams(temperature=0.0, max_tokens=160, structured_outputs=so) for so, _ in SMOL_BATTERY]
    params += [SamplingParams(temperature=1.0, seed=i, n=2, max_tokens=160, structured_outputs=so)
               for i, (so, _) in enumerate(SMOL_BATTERY)]
    outputs = llm.chat(convs + convs, params, use_tqdm=False)
    for o, p in zip(outputs, params):
        assert len(o.outputs) == p.n
        for c in o.outputs:
            assert c.finish_reason == "stop", (p.structured_outputs, c.text)
            check_text(p.structured_outputs, c.text)
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and not engine.grammar_rows.has_any()
    # (Only validity is asserted: greedy, the 135M model answers the capital of France "London",
    # as its first-token logits rank "L" above "Paris" -- not a masking error.)
