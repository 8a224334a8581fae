"""`ferrokv serve`'s ``/v1/responses`` (``ferrokv.entrypoints.openai.serving_responses``) through
the official ``openai`` client and raw HTTP: the answer equals the chat completion of the same
conversation at temperature 0; the stream's events come in the Responses API's order with rising
sequence numbers and add up to the non-streamed answer; input items, ``text.format``, function
tools, logprobs and a length finish take their OpenAI shapes; what this server cannot do (stored
responses, background mode, built-in tools) and bad fields are errors naming the field.

One server per module; requests are greedy and sequential, so the chat reference holds exactly.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from helpers.server import assert_openai_error, serve

MODEL = "tiny-responses"
SYSTEM = "You are terse."
USER = "A dog sees the blue sky."
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with serve(tiny_model_dir("llama-serve"), "--served-model-name", MODEL, "--max-model-len", "512",
               "--trust-request-chat-template") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120.0) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=httpx.Timeout(120.0, connect=30.0)) as c:
        yield c


def chat_text(client, max_tokens: int) -> tuple[str, str, object]:
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": SYSTEM},
                                                              {"role": "user", "content": USER}],
                                       temperature=0.0, max_tokens=max_tokens)
    return r.choices[0].message.content, r.choices[0].finish_reason, r.usage


def respond(client, **kw):
    return client.responses.create(model=MODEL, temperature=0.0, **kw)


@pytest.mark.parametrize("max_tokens", [5, 40])
def test_answer_equals_the_chat_completion_of_the_conversation(client, max_tokens):
    text, finish, usage = chat_text(client, max_tokens)
    r = respond(client, instructions=SYSTEM, input=USER, max_output_tokens=max_tokens)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.output_text == text
    (item,) = r.output
    assert (item.type, item.role, item.status, item.content[0].type) == ("message", "assistant", r.status,
                                                                          "output_text")
    assert (r.usage.input_tokens, r.usage.output_tokens) == (usage.prompt_tokens, usage.completion_tokens)
    assert r.usage.total_tokens == usage.total_tokens
    # A finish by length is OpenAI's incomplete response.
    if finish == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed" and r.incomplete_details is None
    assert (r.instructions, r.max_output_tokens, r.temperature, r.store) == (SYSTEM, max_tokens, 0.0, False)


def test_input_items_are_the_same_conversation(client):
    text, _, _ = chat_text(client, 12)
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": SYSTEM}]},
             {"role": "user", "content": USER}]
    assert respond(client, input=items, max_output_tokens=12).output_text == text


def test_stream_events_in_order_and_adding_up(client):
    whole = respond(client, instructions=SYSTEM, input=USER, max_output_tokens=30)
    events = list(respond(client, instructions=SYSTEM, input=USER, max_output_tokens=30, stream=True))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    # vLLM's: the last event is response.completed, an incomplete response's too (the openai
    # client's stream helper waits for it).
    tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done",
            "response.completed"]
    assert kinds[-4:] == tail and set(kinds[4:-4]) == {"response.output_text.delta"}
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-4].text == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens
    assert final.status == whole.status and final.output[0].status == whole.output[0].status
    assert events[0].response.status == "in_progress" and events[0].response.output == []


@pytest.mark.parametrize("tools", [None, []])
@pytest.mark.parametrize("choice", ["auto", "none"])
def test_tool_choice_auto_or_none_without_tools_is_plain_text(client, tools, choice):
    """vLLM's: with no tools, ``auto`` (what clients send by default) and ``none`` answer text."""
    kw = {} if tools is None else {"tools": tools}
    r = client.responses.create(model=MODEL, input=USER, max_output_tokens=3, tool_choice=choice, **kw)
    assert [item.type for item in r.output] == ["message"] and r.output_text


def test_structured_outputs_and_include_stop_str_are_passed_on(client):
    """vLLM's ResponsesRequest takes ``structured_outputs`` and ``include_stop_str_in_output``."""
    r = client.responses.create(model=MODEL, input=USER, max_output_tokens=20, temperature=0.0,
                                extra_body={"structured_outputs": {"regex": "ab{3}!"}})
    assert r.output_text == "abbb!"
    r = client.responses.create(model=MODEL, input=USER, max_output_tokens=20, temperature=0.0,
                                extra_body={"structured_outputs": {"regex": "ab{3}!"}, "stop": ["b!"],
                                            "include_stop_str_in_output": True})
    assert r.output_text == "abbb!"


def test_text_format_json_schema_constrains_the_answer(client):
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
              "additionalProperties": False}
    r = respond(client, input=USER, max_output_tokens=60,
                text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_function_call_is_a_function_call_item(client, stream):
    kw = dict(input="Weather in Paris?", tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"},
              max_output_tokens=200)
    if stream:
        events = list(respond(client, stream=True, **kw))
        kinds = [e.type for e in events]
        assert "response.output_text.delta" not in kinds
        assert kinds[-5:] == ["response.output_item.added", "response.function_call_arguments.delta",
                              "response.function_call_arguments.done", "response.output_item.done",
                              "response.completed"]
        assert events[-3].arguments == events[-4].delta
        output = events[-1].response.output
    else:
        output = respond(client, **kw).output
    (call,) = output
    assert (call.type, call.name, call.status) == ("function_call", "get_weather", "completed")
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")  # vLLM's prefixes
    jsonschema.validate(json.loads(call.arguments), WEATHER)


def test_a_replayed_call_and_its_output_reach_the_conversation(client):
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Paris", "days": 1}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    with_output = respond(client, input=items, tools=[TOOL], tool_choice="none", max_output_tokens=8)
    without = respond(client, input=items[:1], tools=[TOOL], tool_choice="none", max_output_tokens=8)
    assert with_output.usage.input_tokens > without.usage.input_tokens


def test_a_cut_response_and_its_items_are_incomplete(client):
    r = respond(client, input="Weather in Paris?", tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"},
                max_output_tokens=3)
    assert r.status == "incomplete" and [item.status for item in r.output] == ["incomplete"]
    r = respond(client, input=USER, max_output_tokens=1)
    assert r.status == "incomplete" and r.output[0].status == "incomplete"


def test_streamed_logprobs_are_every_tokens(client):
    kw = dict(input=USER, max_output_tokens=12, top_logprobs=1, include=["message.output_text.logprobs"])
    events = list(respond(client, stream=True, **kw))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    final = events[-1].response
    assert len(streamed) == final.usage.output_tokens == len(final.output[0].content[0].logprobs)
    assert [lp.token for lp in streamed] == [lp.token for lp in final.output[0].content[0].logprobs]


def test_logprobs_when_included(client):
    r = respond(client, input=USER, max_output_tokens=6, top_logprobs=2, include=["message.output_text.logprobs"])
    lps = r.output[0].content[0].logprobs
    assert len(lps) == r.usage.output_tokens
    assert all(len(lp.top_logprobs) == 2 and lp.top_logprobs[0].logprob >= lp.top_logprobs[1].logprob for lp in lps)
    assert all(lp.logprob <= 0.0 for lp in lps)
    plain = respond(client, input=USER, max_output_tokens=6, top_logprobs=2)
    assert plain.output[0].content[0].logprobs is None  # vLLM's: only when included


@pytest.mark.parametrize("body, status, param", [
    ({"input": USER, "background": True}, 400, "background"),
    ({"input": USER, "previous_response_id": "resp_123"}, 404, "previous_response_id"),
    ({}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": [{"role": "robot", "content": "hi"}]}, 400, "input[0].role"),
    ({"input": [{"role": ["user"], "content": "hi"}]}, 400, "input[0].role"),
    ({"input": [{"type": "reasoning", "summary": []}]}, 400, "input"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]}, 400, "input[0].arguments"),
    ({"input": USER, "metadata": 5}, 400, "metadata"),
    ({"input": USER, "metadata": {"k": "\ud800"}}, 400, "metadata"),
    ({"input": USER, "reasoning": "junk"}, 400, "reasoning"),
    ({"input": USER, "truncation": "junk"}, 400, "truncation"),
    ({"input": USER, "store": "maybe"}, 400, "store"),
    ({"input": USER, "include": ["bogus.thing"]}, 400, "include"),
    ({"input": USER, "text": {"verbosity": 5}}, 400, "text.verbosity"),
    ({"input": USER, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     400, "tool_choice"),
    ({"input": USER, "tools": [TOOL], "tool_choice": {"type": "function"}}, 400, "tool_choice.name"),
    ({"input": USER, "request_id": "\ud800"}, 400, "request_id"),
    # Fields the response repeats must render as strict JSON: no NaN/Infinity, no lone surrogate.
    ({"input": USER, "reasoning": {"effort": "low", "summary": float("nan")}}, 400, "reasoning"),
    ({"input": USER, "tools": [{**TOOL, "parameters": {"type": "object", "maximum": float("inf")}}],
      "tool_choice": "none"}, 400, "tools"),
    ({"input": USER, "tools": [{**TOOL, "description": "\ud800"}], "tool_choice": "none"}, 400, "tools"),
    ({"input": USER, "text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, 400,
     "text.format.name"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call_output", "call_id": "c", "output": "\ud800"}]},
     400, "input[1].output"),
    ({"input": USER, "user": "\ud800"}, 400, "user"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, 400, "input[0].call_id"),
    ({"input": [{"type": "input_image"}]}, 400, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input[0].content[0]"),
    ({"input": USER, "instructions": 5}, 400, "instructions"),
    ({"input": [{"role": "user", "content": None}]}, 400, "input[0].content"),
    ({"input": [{"role": "user", "content": "hi"}, {"role": "assistant"}]}, 400, "input[1].content"),
    ({"input": USER, "previous_response_id": 5}, 400, "previous_response_id"),
    ({"input": USER, "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": USER, "temperature": -1}, 400, "temperature"),
    ({"input": USER, "tools": [{"type": "web_search_preview"}]}, 400, "tools[0]"),
    ({"input": USER, "text": {"format": {"type": "yaml"}}}, 400, "text.format"),
    ({"input": USER, "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format"),
    ({"input": USER, "top_logprobs": 99, "include": ["message.output_text.logprobs"]}, 400, "top_logprobs"),
    ({"input": USER, "include": "logprobs"}, 400, "include"),
    ({"input": USER, "model": "other"}, 404, "model"),
    ({"input": USER, "structured_outputs": {"choice": []}}, 400, "structured_outputs"),
    ({"input": USER, "prompt": {"id": "pmpt_1"}}, 400, "prompt"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": [{"type": ["input_text"], "text": "r"}]}]},
     400, "input[1].output[0]"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "image", "x": 1}]}]}, 400,
     "input[0].output[0]"),
    ({"input": [{"role": "user", "content": [{"type": {"k": 1}, "text": "x"}]}]}, 400, "input[0].content[0]"),
    ({"input": USER, "service_tier": "bogus"}, 400, "service_tier"),
    ({"input": USER, "max_tool_calls": 0}, 400, "max_tool_calls"),
    ({"input": USER, "reasoning": {"effort": "extreme"}}, 400, "reasoning"),
    ({"input": USER, "text": {"format": {"type": "json_object"}}, "structured_outputs": {"regex": "a"}}, 400,
     "structured_outputs"),
])
def test_bad_requests_name_the_field(http, body, status, param):
    body = {"model": MODEL, **body} if "model" not in body else body
    # JSON text with \u escapes: a lone surrogate is valid JSON, but not encodable as UTF-8 text.
    r = http.post("/v1/responses", content=json.dumps(body), headers={"content-type": "application/json"})
    assert assert_openai_error(r, status, param)["param"] == param
    ok = http.post("/v1/responses", json={"model": MODEL, "input": USER, "max_output_tokens": 2})
    assert ok.status_code == 200 and ok.json()["status"] in ("completed", "incomplete")


def test_a_named_function_that_is_not_a_tool_is_told_in_this_apis_shape(http):
    r = http.post("/v1/responses", json={"model": MODEL, "input": USER, "tools": [TOOL],
                                         "tool_choice": {"type": "function", "name": "nope"}})
    err = assert_openai_error(r, 400, "nope")
    assert err["param"].startswith("tool_choice") and "'function': {" not in err["message"], err
    # The request's own choice, shown back when it names a function with no tools at all.
    r = http.post("/v1/responses", json={"model": MODEL, "input": USER,
                                         "tool_choice": {"type": "function", "name": "f"}})
    err = assert_openai_error(r, 400, "{'type': 'function', 'name': 'f'}")
    assert "'function': {" not in err["message"], err


def test_usage_validates_as_the_sdks_response_and_counts_cache_writes(http):
    """The installed SDK's Response model requires input_tokens_details.cache_write_tokens: the
    prompt's full KV blocks (16 tokens) that the request computed, which the prefix cache keeps."""
    from openai.types.responses import Response

    body = {"model": MODEL, "input": "cache me " * 30 + USER, "max_output_tokens": 2, "temperature": 0.0}
    first, again = (Response.model_validate(http.post("/v1/responses", json=body).json()) for _ in range(2))
    full = first.usage.input_tokens // 16 * 16
    assert full >= 32 and first.usage.input_tokens_details.cached_tokens == 0
    assert first.usage.input_tokens_details.cache_write_tokens == full
    cached = again.usage.input_tokens_details.cached_tokens
    assert cached > 0 and again.usage.input_tokens_details.cache_write_tokens == full - cached


def test_empty_instructions_add_no_system_turn(http):
    def input_tokens(**kw):
        r = http.post("/v1/responses", json={"model": MODEL, "input": USER, "max_output_tokens": 1, **kw})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["input_tokens"]
    assert input_tokens(instructions="") == input_tokens() < input_tokens(instructions=" ")


def test_an_empty_model_name_is_the_served_one(http):
    r = http.post("/v1/responses", json={"model": "", "input": USER, "max_output_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == MODEL, r.text


@pytest.mark.parametrize("method, path", [("GET", "/v1/responses/resp_1"), ("DELETE", "/v1/responses/resp_1"),
                                          ("POST", "/v1/responses/resp_1/cancel")])
def test_nothing_is_stored(http, method, path):
    assert assert_openai_error(http.request(method, path), 404, "resp_1")["param"] == "response_id"


def test_raw_stream_is_named_events_without_done(http):
    with http.stream("POST", "/v1/responses", json={"model": MODEL, "input": USER, "max_output_tokens": 3,
                                                     "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        blocks = [b for b in r.read().decode().split("\n\n") if b]
    for b in blocks:
        event, data = b.split("\n")
        assert event.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[len("data: "):])["type"] == event[len("event: "):]
    assert "[DONE]" not in blocks[-1]


# Shows what reaches the template: the tools, the reasoning knobs and whether a turn is opened.
PROBE_TEMPLATE = ("{% if tools %}TOOLS {% for t in tools %}{{ t.function.name }} {% endfor %}{% endif %}"
                  "{% if reasoning_effort is defined %}EFFORT {{ reasoning_effort }} THINK {{ enable_thinking }} "
                  "{% endif %}{% for m in messages %}<{{ m.role }}> {{ m.content }} {% endfor %}"
                  "{% if add_generation_prompt %}<assistant>{% endif %}")


def prompt_tokens(http, messages, **kw) -> int:
    r = http.post("/tokenize", json={"model": MODEL, "messages": messages, "chat_template": PROBE_TEMPLATE, **kw})
    assert r.status_code == 200, r.text
    return r.json()["count"]


def input_tokens(http, **kw) -> int:
    r = http.post("/v1/responses", json={"model": MODEL, "max_output_tokens": 2, "chat_template": PROBE_TEMPLATE,
                                         **kw})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["input_tokens"]


def test_tool_choice_none_shows_the_template_no_tools(http):
    """vLLM's construct_tool_dicts: with ``tool_choice: "none"`` the tools stay out of the prompt."""
    user = [{"role": "user", "content": USER}]
    with_tools = prompt_tokens(http, user, tools=[{"type": "function", "function": {k: v for k, v in TOOL.items()
                                                                                     if k != "type"}}])
    assert input_tokens(http, input=USER, tools=[TOOL], tool_choice="none") == prompt_tokens(http, user) < with_tools


@pytest.mark.parametrize("effort", ["high", "none"])
def test_reasoning_effort_reaches_the_template(http, effort):
    """vLLM's build_chat_params: ``reasoning.effort`` and ``enable_thinking`` (off for "none") are
    template kwargs; the caller's own ``chat_template_kwargs`` win."""
    user = [{"role": "user", "content": USER}]
    want = prompt_tokens(http, user, chat_template_kwargs={"reasoning_effort": effort,
                                                            "enable_thinking": effort != "none"})
    assert input_tokens(http, input=USER, reasoning={"effort": effort}) == want > prompt_tokens(http, user)
    own = {"reasoning_effort": effort, "enable_thinking": "the caller's own value"}
    assert input_tokens(http, input=USER, reasoning={"effort": effort}, chat_template_kwargs=own) == \
        prompt_tokens(http, user, chat_template_kwargs=own) != want


@pytest.mark.parametrize("status", ["in_progress", "incomplete"])
def test_a_partial_assistant_message_is_continued(http, status):
    """vLLM's should_continue_final_message: the answer goes on from the partial message (no new
    turn); a completed one gets a new turn."""
    items = [{"role": "user", "content": USER}, {"role": "assistant", "content": "The sky"}]
    partial = [items[0], {**items[1], "type": "message", "status": status}]
    assert input_tokens(http, input=partial) == \
        prompt_tokens(http, items, add_generation_prompt=False, continue_final_message=True)
    assert input_tokens(http, input=[items[0], {**items[1], "status": "completed"}]) == prompt_tokens(http, items)
    # Only a message is continued (vLLM's): a partial reasoning item after the user's turn is left
    # out and a new turn opens, whatever role it claims.
    reasoning = {"type": "reasoning", "role": "assistant", "status": status, "summary": []}
    assert input_tokens(http, input=[items[0], reasoning]) == prompt_tokens(http, items[:1])


def test_a_function_call_output_of_text_parts_is_its_text(http):
    """The SDK's ``output`` may be a list of ``input_text`` parts (vLLM passes it on as content)."""
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}
    def out(output):
        return {"type": "function_call_output", "call_id": "c1", "output": output}
    as_text = input_tokens(http, input=[{"role": "user", "content": USER}, call, out("sunny and warm")])
    parts = [{"type": "input_text", "text": "sunny and warm"}]
    assert input_tokens(http, input=[{"role": "user", "content": USER}, call, out(parts)]) == as_text


def test_truncation_auto_keeps_the_prompts_last_tokens(http):
    """vLLM's: ``truncation: "auto"`` cuts the prompt from the left to fit; "disabled" is a 400."""
    long_input = " ".join(["word"] * 2000)
    r = http.post("/v1/responses", json={"model": MODEL, "input": long_input, "max_output_tokens": 10})
    assert_openai_error(r, 400, "input")
    r = http.post("/v1/responses", json={"model": MODEL, "input": long_input, "max_output_tokens": 10,
                                         "truncation": "auto"})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens"] == 512 - 10 and r.json()["truncation"] == "auto"


@pytest.mark.parametrize("stream", [False, True])
def test_a_max_output_tokens_past_the_context_is_named_so(http, stream):
    r = http.post("/v1/responses", json={"model": MODEL, "input": USER, "max_output_tokens": 600, "stream": stream})
    assert "max_output_tokens=600" in assert_openai_error(r, 400, "max_output_tokens")["message"]


def test_service_tier_and_max_tool_calls_are_echoed(http):
    r = http.post("/v1/responses", json={"model": MODEL, "input": USER, "max_output_tokens": 2,
                                         "service_tier": "flex", "max_tool_calls": 3})
    assert r.status_code == 200 and (r.json()["service_tier"], r.json()["max_tool_calls"]) == ("flex", 3)
    default = http.post("/v1/responses", json={"model": MODEL, "input": USER, "max_output_tokens": 2}).json()
    assert (default["service_tier"], default["max_tool_calls"]) == ("auto", None)


def test_a_capacity_error_is_told_in_this_apis_names():
    """The core's "lower max_tokens or n" as a response's: it has max_output_tokens and no n."""
    import numpy as np

    from ferrokv import CacheCapacityError
    from ferrokv._core import Scheduler
    from ferrokv.entrypoints.openai.serving import to_openai_error
    from ferrokv.entrypoints.openai.serving_responses import _renamed

    with pytest.raises(CacheCapacityError) as e:
        Scheduler(8, block_size=4, max_model_len=1024).add_request(1, np.arange(1, 21, dtype=np.int64), 20)
    told = _renamed(to_openai_error(e.value), ["input[0]"])
    assert told.param == "max_output_tokens" and "max_output_tokens=20" in told.message
    assert told.message.endswith("lower max_output_tokens, or enlarge the KV cache"), told.message
