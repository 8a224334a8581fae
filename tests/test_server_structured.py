"""`ferrokv serve`'s structured outputs and per-token logit rules, through the official ``openai``
client and raw HTTP (httpx): ``response_format`` (json_schema, json_object), vLLM's
``structured_outputs`` and ``guided_*`` extras, ``logit_bias``, ``allowed_token_ids``,
``bad_words`` and ``prompt_logprobs`` (vLLM's response shapes), and their 400s (``param`` names
the field, the message shows the value; the server goes on serving).

The model is a tiny random one, so only constraints can make its output structured: a schema
test passes only if the grammar really drives decoding. Schemas are bounded (enums, short
strings, small integers, no extra properties), so every output ends well within ``max_tokens``.
One server for the module; requests are sequential, so greedy answers are reproducible.
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from helpers.server import assert_openai_error, serve

MODEL = "tiny-structured"
MAX_MODEL_LEN = 512
# Enough for any output of the bounded schemas: a random model likes whitespace, and JSON allows
# up to 20 whitespace characters (often one token each) between any two tokens.
MAX_TOKENS = 460  # + the chat prompt (36 tokens) fits the 512-token context
PROMPT = "The cat runs the red ball"
MESSAGES = [{"role": "user", "content": "Describe a ball as JSON."}]
TIMEOUT = httpx.Timeout(120.0, connect=30.0)

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "name": {"type": "string", "maxLength": 6},
        "size": {"type": "integer", "minimum": 0, "maximum": 9},
        "round": {"type": "boolean"},
    },
    "required": ["color", "name", "size", "round"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "ball", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with serve(tiny_model_dir("llama-serve"), "--served-model-name", MODEL, "--max-model-len",
               str(MAX_MODEL_LEN)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120.0) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
        yield c


def generate(client, endpoint: str, stream: bool, **kw: Any) -> list[tuple[str, str]]:
    """``[(text, finish_reason)]`` of every choice, by index, streamed or not."""
    if endpoint == "chat":
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=stream, **kw)
    else:
        if "response_format" in kw:  # vLLM's extra for completions (OpenAI's client has it for chat only)
            kw["extra_body"] = {**kw.get("extra_body", {}), "response_format": kw.pop("response_format")}
        r = client.completions.create(model=MODEL, prompt=PROMPT, stream=stream, **kw)
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for chunk in (r if stream else [r]):
        for c in chunk.choices:
            if endpoint == "chat":
                piece = (c.delta.content if stream else c.message.content) or ""
            else:
                piece = c.text
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason is not None:
                reasons[c.index] = c.finish_reason
    return [(texts[i], reasons.get(i)) for i in sorted(texts)]


def token_ids(http, text: str) -> list[int]:
    r = http.post("/tokenize", json={"model": MODEL, "prompt": text, "add_special_tokens": False})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def token_id(http, text: str) -> int:
    ids = token_ids(http, text)
    assert len(ids) == 1, (text, ids)
    return ids[0]


def greedy_completion(http, **kw: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            **kw}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


# ------------------------------------------------------------------------------------------------
# response_format: json_schema and json_object
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 7, "n": 2}],
                         ids=["greedy", "seeded"])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_response_format_json_schema(client, endpoint, sampling, stream):
    outs = generate(client, endpoint, stream, max_tokens=MAX_TOKENS, response_format=RESPONSE_FORMAT, **sampling)
    assert len(outs) == sampling.get("n", 1)
    for text, reason in outs:
        assert reason == "stop", (reason, text)
        jsonschema.validate(json.loads(text), SCHEMA)


def test_response_format_json_schema_stream_equals_whole(client):
    whole = generate(client, "completions", False, max_tokens=MAX_TOKENS, temperature=0,
                     response_format=RESPONSE_FORMAT)
    streamed = generate(client, "completions", True, max_tokens=MAX_TOKENS, temperature=0,
                        response_format=RESPONSE_FORMAT)
    assert streamed == whole


def test_response_format_json_object(client):
    (text, reason), = generate(client, "chat", False, max_tokens=64, temperature=0,
                               response_format={"type": "json_object"})
    assert text.lstrip().startswith("{"), text
    if reason == "stop":
        assert isinstance(json.loads(text), dict), text


def test_response_format_text_is_plain(client):
    plain = generate(client, "completions", False, max_tokens=8, temperature=0)
    text = generate(client, "completions", False, max_tokens=8, temperature=0, response_format={"type": "text"})
    assert text == plain


# ------------------------------------------------------------------------------------------------
# vLLM's structured_outputs and guided_* extras
# ------------------------------------------------------------------------------------------------

CHOICES = ["alpha", "beta", "gamma delta"]


def outside_strings(text: str) -> str:
    """JSON text with every string literal emptied."""
    return re.sub(r'"(?:\\.|[^"\\])*"', '""', text)


REGEX = r"[0-9]{3}-[a-c]{2,4}"


@pytest.mark.parametrize("extra, check", [
    ({"structured_outputs": {"choice": CHOICES}}, lambda t: t in CHOICES),
    ({"guided_choice": CHOICES}, lambda t: t in CHOICES),
    ({"structured_outputs": {"regex": REGEX}}, lambda t: re.fullmatch(REGEX, t)),
    ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
    ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"structured_outputs": {"json": json.dumps(SCHEMA), "disable_any_whitespace": True}},
     lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None and not re.search(r"\s", outside_strings(t))),
    ({"guided_grammar": 'start: "yes" | "no" | "maybe"'}, lambda t: t in ("yes", "no", "maybe")),
], ids=["so-choice", "guided_choice", "so-regex", "guided_regex", "guided_json", "so-json-compact", "guided_grammar"])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_structured_outputs_extras(client, endpoint, extra, check):
    for stream in (False, True):
        outs = generate(client, endpoint, stream, max_tokens=MAX_TOKENS, temperature=1.0, seed=3, n=2,
                        extra_body=extra)
        for text, reason in outs:
            assert reason == "stop" and check(text), (stream, text, reason)


# ------------------------------------------------------------------------------------------------
# logit_bias, allowed_token_ids, bad_words
# ------------------------------------------------------------------------------------------------

def test_logit_bias_forces_and_bans_a_token(http):
    tid = token_id(http, " cat")
    forced = greedy_completion(http, logit_bias={str(tid): 100})
    assert forced["text"] == " cat" * 8, forced["text"]
    plain = greedy_completion(http)
    assert plain["text"] != forced["text"]
    # Clamped to 100, as vLLM: a huge bias is accepted and acts the same.
    assert greedy_completion(http, logit_bias={str(tid): 1e9})["text"] == forced["text"]
    # -100 on the greedy first token: another first token.
    first = plain["logprobs"]["tokens"][0]
    banned = greedy_completion(http, logit_bias={str(token_id(http, first)): -100})
    assert banned["logprobs"]["tokens"][0] != first, (first, banned["logprobs"]["tokens"])


def test_allowed_token_ids_restrict_output(http, client):
    letters = ["1", "2", "3"]
    ids = [token_id(http, x) for x in letters]
    plain = greedy_completion(http, max_tokens=12)["text"]
    assert not set(plain) <= set(letters), plain  # without the rule the model says something else
    for endpoint in ("completions", "chat"):
        for stream in (False, True):
            (text, reason), = generate(client, endpoint, stream, max_tokens=12, temperature=1.0, seed=1,
                                       extra_body={"allowed_token_ids": ids, "ignore_eos": True})
            assert len(text) == 12 and set(text) <= set(letters), (endpoint, stream, text)


def test_bad_words_removes_a_word(http):
    plain = greedy_completion(http, max_tokens=12)
    tokens = plain["logprobs"]["tokens"]
    # A generated word that is one token with and without its leading space (so both are banned
    # at every position).
    words = [t.strip() for t in tokens if re.fullmatch(r" ?[A-Za-z]+", t)]
    word = next(w for w in words if len(token_ids(http, w)) == 1 and len(token_ids(http, " " + w)) == 1)
    banned = {word, " " + word}  # token texts (each is one token id)
    assert banned & set(tokens), (word, tokens)
    out = greedy_completion(http, max_tokens=12, bad_words=[word])
    assert not banned & set(out["logprobs"]["tokens"]), (word, out["logprobs"]["tokens"])
    assert out["text"] != plain["text"]


# ------------------------------------------------------------------------------------------------
# prompt_logprobs (vLLM's shape: per choice for completions, top level for chat)
# ------------------------------------------------------------------------------------------------

def check_prompt_logprobs(plp: Any, prompt_ids: list[int], k: int) -> None:
    assert isinstance(plp, list) and len(plp) == len(prompt_ids), plp
    assert plp[0] is None
    for tid, entry in zip(prompt_ids[1:], plp[1:]):
        assert str(tid) in entry, (tid, entry)
        assert k <= len(entry) <= k + 1, entry
        for lp in entry.values():
            assert set(lp) == {"logprob", "rank", "decoded_token"}, lp
            assert lp["logprob"] <= 0 and lp["rank"] >= 1 and isinstance(lp["decoded_token"], str), lp


def test_prompt_logprobs_completions(http):
    ids = http.post("/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()["tokens"]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "n": 2,
                                            "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == len(ids)
    for choice in body["choices"]:
        check_prompt_logprobs(choice["prompt_logprobs"], ids, 2)
    without = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3})
    assert without.json()["choices"][0]["prompt_logprobs"] is None


def test_prompt_logprobs_chat(http):
    ids = http.post("/tokenize", json={"model": MODEL, "messages": MESSAGES}).json()["tokens"]
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 3,
                                                 "prompt_logprobs": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == len(ids)
    check_prompt_logprobs(body["prompt_logprobs"], ids, 0)
    assert "prompt_logprobs" not in body["choices"][0]


def test_prompt_logprobs_zero_with_stream_is_accepted(http):
    """vLLM: prompt_logprobs=0 with stream is accepted (a stream carries none); >0 is a 400."""
    with http.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2,
                                                        "stream": True, "prompt_logprobs": 0}) as r:
        assert r.status_code == 200
        assert "data: [DONE]" in r.read().decode()


# ------------------------------------------------------------------------------------------------
# 400s: param names the field, the message shows the value; the server goes on serving
# ------------------------------------------------------------------------------------------------

_C, _CH = "/v1/completions", "/v1/chat/completions"


def nested_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


BAD = [
    # (path, extra body, param, texts the message must contain)
    (_C, {"logit_bias": {"abc": 1}}, "logit_bias", ["'abc'"]),
    (_CH, {"logit_bias": {"5": "big"}}, "logit_bias", ["'big'"]),
    (_C, {"logit_bias": [5]}, "logit_bias", ["[5]"]),
    (_C, {"logit_bias": {"1000000": 5}}, "logit_bias", ["1000000", "vocabulary"]),
    (_C, {"response_format": {"type": "xml"}}, "response_format", ["'xml'"]),
    (_CH, {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema",
     ["schema", "None"]),
    (_CH, {"response_format": {"type": "json_schema"}}, "response_format.json_schema", ["json_schema", "None"]),
    (_C, {"response_format": "json"}, "response_format", ["'json'"]),
    (_CH, {"response_format": {"type": "structural_tag", "structures": [], "triggers": []}}, "response_format",
     ["structural_tag", "not supported"]),
    (_C, {"structured_outputs": {"regex": "(ab"}}, "structured_outputs", ["structured_outputs.regex", "(ab"]),
    (_CH, {"guided_regex": "[a-"}, "guided_regex", ["guided_regex", "[a-"]),
    (_C, {"guided_grammar": "start: foo("}, "guided_grammar", ["guided_grammar", "foo("]),
    (_C, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format.json_schema", ["response_format.json_schema.schema", "foo"]),
    (_C, {"structured_outputs": {"regex": 5}}, "structured_outputs", ["structured_outputs.regex", "5"]),
    # The option's own field is at fault, not the constraint's (found by a probe).
    (_C, {"guided_json": {"type": "object"}, "guided_whitespace_pattern": "(["}, "guided_whitespace_pattern",
     ["guided_whitespace_pattern is not a valid regex"]),
    (_CH, {"response_format": {"type": "json_object"}, "guided_whitespace_pattern": "(["}, "guided_whitespace_pattern",
     ["guided_whitespace_pattern is not a valid regex"]),
    (_C, {"structured_outputs": {"colour": "red"}}, "structured_outputs", ["structured_outputs.colour"]),
    (_C, {"structured_outputs": "a+"}, "structured_outputs", ["'a+'"]),
    (_C, {"guided_choice": []}, "guided_choice", ["guided_choice", "[]"]),
    (_C, {"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice", ["guided_regex", "guided_choice"]),
    (_CH, {"response_format": RESPONSE_FORMAT, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     ["response_format", "structured_outputs"]),
    (_C, {"guided_json": nested_schema(150)}, "guided_json", ["guided_json", "recursion"]),  # llguidance's limit
    (_C, {"guided_json": nested_schema(300)}, "guided_json", ["guided_json", "deep"]),  # Python's
    (_C, {"allowed_token_ids": [5, 1000000]}, "allowed_token_ids", ["1000000", "vocabulary"]),
    (_CH, {"allowed_token_ids": []}, "allowed_token_ids", ["[]"]),
    (_C, {"allowed_token_ids": "5"}, "allowed_token_ids", ["'5'"]),
    (_C, {"bad_words": "cat"}, "bad_words", ["'cat'"]),
    (_C, {"bad_words": [""]}, "bad_words", ["''"]),
    (_C, {"bad_words": [f"w{i}" for i in range(129)]}, "bad_words", ["129 words", "at most 128"]),
    (_CH, {"bad_words": ["qz" * 30 + str(i) for i in range(40)]}, "bad_words", ["tokens in all", "at most 1024"]),
    (_C, {"prompt_logprobs": 21}, "prompt_logprobs", ["21"]),
    (_CH, {"prompt_logprobs": -1}, "prompt_logprobs", ["-1"]),
    (_C, {"prompt_logprobs": 2, "stream": True}, "prompt_logprobs", ["stream", "2"]),
]


@pytest.mark.parametrize("path,extra,param,needles", BAD, ids=[f"{'chat' if p == _CH else 'cmpl'}-{json.dumps(e)}"[:60]
                                                               for p, e, _, _ in BAD])
def test_400_names_field_and_value(http, path, extra, param, needles):
    base = {"model": MODEL, "max_tokens": 2, "temperature": 0}
    base.update({"prompt": PROMPT} if path == _C else {"messages": MESSAGES})
    r = http.post(path, json={**base, **extra})
    err = assert_openai_error(r, 400, *needles)
    assert err["param"] == param, err
    ok = http.post(_C, json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 1, ok.text


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                       response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    assert "response_format.json_schema" in str(e.value)


def test_logit_bias_clamped_to_openai_range():
    """As vLLM: each bias is clamped to [-100, 100] (a token id as a string, any number)."""
    from ferrokv.entrypoints.openai.protocol import parse_completion_request

    req = parse_completion_request({"prompt": "x", "logit_bias": {"5": 1e9, "6": -250, "7": 2.5, "8": 0}})
    assert req.params.logit_bias == {5: 100.0, 6: -100.0, 7: 2.5, 8: 0.0}
    assert parse_completion_request({"prompt": "x", "logit_bias": {}}).params.logit_bias is None


def test_logit_bias_values_are_read_as_vllms_pydantic_reads_a_float():
    """Lax mode, as for every other numeric field: a numeric string and a bool are numbers; other
    strings, NaN and an int beyond a float are refused naming the key."""
    from ferrokv.entrypoints.openai.protocol import OpenAIError, parse_completion_request

    req = parse_completion_request({"prompt": "x", "logit_bias": {"5": "1.5", "6": True, "7": "-1e9", "8": False}})
    assert req.params.logit_bias == {5: 1.5, 6: 1.0, 7: -100.0, 8: 0.0}
    for bad in ("big", "nan", float("nan"), 10 ** 400, None, [1]):
        with pytest.raises(OpenAIError) as e:
            parse_completion_request({"prompt": "x", "logit_bias": {"5": bad}})
        assert e.value.param == "logit_bias" and "logit_bias['5']" in e.value.message, bad


@pytest.mark.parametrize("field,value,kind", [
    ("length_penalty", "x", "a number"), ("early_stopping", "maybe", "a boolean"),
    ("include_reasoning", [1], "a boolean"),
    ("guided_decoding_backend", 5, "a string"), ("mm_processor_kwargs", "x", "an object"),
    ("kv_transfer_params", 3, "an object"), ("vllm_xargs", 5, "an object"),
])
def test_vllm_fields_that_change_nothing_here_are_still_type_checked(field, value, kind):
    """As vLLM's pydantic models check them: a wrong type is a 400 naming the field; a right one
    (read leniently, as every other field) is accepted."""
    from ferrokv.entrypoints.openai.protocol import OpenAIError, parse_chat_request, parse_completion_request

    with pytest.raises(OpenAIError) as e:
        parse_completion_request({"prompt": "x", field: value})
    assert e.value.param == field and e.value.message == f"{field} must be {kind}, got {value!r}"
    with pytest.raises(OpenAIError):
        parse_chat_request({"messages": [{"role": "user", "content": "x"}], field: value})
    good = {"length_penalty": "1.5", "early_stopping": "true", "include_reasoning": False,
            "guided_decoding_backend": "xgrammar", "mm_processor_kwargs": {}, "kv_transfer_params": {"a": 1},
            "vllm_xargs": {"k": "v"}}[field]
    parse_completion_request({"prompt": "x", field: good})
