"""`ferrokv serve`'s tool calling (``ferrokv.entrypoints.openai.tool_calls``) through the official
``openai`` client and raw HTTP: a named function and ``tool_choice: "required"`` decode under the
tools' schemas and come back as ``message.tool_calls`` (streamed: ``delta.tool_calls``), with
vLLM's shapes; replayed calls reach the chat template; bad fields are 400s naming them.

The model is a tiny random one, so only the constraint can make its output a call: a test passes
only if the schema really drives decoding. Schemas are bounded (enums, small integers, no extra
properties), so every call ends well within ``max_tokens``. Requests are greedy and sequential.
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

from ferrokv.entrypoints.openai.protocol import parse_chat_request
from ferrokv.entrypoints.openai.tool_calls import ToolChoice
from ferrokv.entrypoints.openai.tool_parsers import tool_call_parser

MODEL = "tiny-tools"
MAX_TOKENS = 400
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with serve(tiny_model_dir("llama-serve"), "--served-model-name", MODEL, "--max-model-len", "512") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120.0) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=httpx.Timeout(120.0, connect=30.0)) as c:
        yield c


def create(client, stream: bool, **kw: Any) -> Any:
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=0.0,
                                          max_tokens=kw.pop("max_tokens", MAX_TOKENS), stream=stream, **kw)


def streamed_calls(chunks: Any) -> tuple[list[dict[str, Any]], str, str | None, list[Any]]:
    """The tool calls a stream's deltas add up to (by call index), its content, finish_reason,
    and every tool-call delta as sent."""
    calls: dict[int, dict[str, Any]] = {}
    content, reason, deltas = "", None, []
    for chunk in chunks:
        for c in chunk.choices:
            content += c.delta.content or ""
            reason = c.finish_reason or reason
            for d in c.delta.tool_calls or []:
                deltas.append(d)
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = d.id or call["id"]
                if d.function is not None:
                    call["name"] += d.function.name or ""
                    call["arguments"] += d.function.arguments or ""
    return [calls[i] for i in sorted(calls)], content, reason, deltas


def test_named_function_is_one_call_valid_under_its_schema(client):
    r = create(client, False, tool_choice=NAMED)
    (choice,) = r.choices
    assert choice.finish_reason == "stop"  # vLLM's, as OpenAI's: a named call keeps "stop"
    assert choice.message.content == ""
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_named_function_streams_its_arguments_and_equals_the_whole(client):
    whole = create(client, False, tool_choice=NAMED).choices[0].message.tool_calls[0]
    calls, content, reason, deltas = streamed_calls(create(client, True, tool_choice=NAMED))
    assert reason == "stop" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", whole.function.arguments)]
    assert len(deltas) > 1, "the arguments should arrive in several deltas"
    first, rest = deltas[0], deltas[1:]
    assert first.id.startswith("chatcmpl-tool-") and first.type == "function" and first.function.name == "get_weather"
    assert all(d.id is None and d.function.name is None and d.index == 0 for d in rest)


def test_a_forced_call_keeps_the_requests_whitespace_pattern(client):
    """vLLM passes guided_whitespace_pattern on to a forced call's schema: here none at all."""
    r = create(client, False, tool_choice=NAMED, extra_body={"guided_whitespace_pattern": ""})
    args = r.choices[0].message.tool_calls[0].function.arguments
    jsonschema.validate(json.loads(args), WEATHER)
    assert not any(ch.isspace() for ch in args), args


def test_required_with_no_tools_is_none_as_openai(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[], tool_choice="required",
                                       temperature=0.0, max_tokens=4)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("parallel", [None, False])
def test_required_gives_calls_of_the_tools_each_valid(client, parallel):
    kw = {} if parallel is None else {"parallel_tool_calls": parallel}
    r = create(client, False, tool_choice="required", **kw)
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == ""  # vLLM's, as OpenAI's
    calls = choice.message.tool_calls
    assert len(calls) >= 1 and (parallel is None or len(calls) == 1)
    assert len({c.id for c in calls}) == len(calls)
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def test_required_stream_equals_the_whole(client):
    whole = create(client, False, tool_choice="required").choices[0].message.tool_calls
    calls, content, reason, _ = streamed_calls(create(client, True, tool_choice="required"))
    assert reason == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.function.name, c.function.arguments) for c in whole]


def test_a_call_cut_by_max_tokens_loses_no_text(client):
    """``required`` cut short: the text that is no complete call comes back as content (nothing
    generated is lost), and the stream says the same."""
    r = create(client, False, tool_choice="required", max_tokens=3)
    (choice,) = r.choices
    assert choice.finish_reason == "length" and choice.message.tool_calls == []
    assert choice.message.content.lstrip().startswith("[")
    calls, content, reason, _ = streamed_calls(create(client, True, tool_choice="required", max_tokens=3))
    assert (calls, content, reason) == ([], choice.message.content, "length")


def test_n_choices_each_get_their_own_calls(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, n=2,
                                       temperature=1.0, seed=3, max_tokens=MAX_TOKENS)
    assert sorted(c.index for c in r.choices) == [0, 1]
    ids = {c.message.tool_calls[0].id for c in r.choices}
    assert len(ids) == 2
    for c in r.choices:
        jsonschema.validate(json.loads(c.message.tool_calls[0].function.arguments), WEATHER)


def test_tool_schema_wins_over_response_format(client):
    """vLLM's precedence: a forced call's schema is the constraint."""
    r = create(client, False, tool_choice=NAMED, response_format={"type": "json_object"})
    jsonschema.validate(json.loads(r.choices[0].message.tool_calls[0].function.arguments), WEATHER)


def test_a_named_choice_takes_the_last_tool_of_that_name(client):
    """vLLM's: tools are looked up by name, the last one wins."""
    tools = [TOOLS[0], {"type": "function", "function": {"name": "get_weather", "parameters": TIME}}]
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=tools, tool_choice=NAMED, temperature=0,
                                       max_tokens=MAX_TOKENS)
    jsonschema.validate(json.loads(r.choices[0].message.tool_calls[0].function.arguments), TIME)


def test_tool_choice_none_and_no_tools_answer_in_text(client):
    r = create(client, False, tool_choice="none", max_tokens=4)
    assert r.choices[0].message.tool_calls in (None, []) and r.choices[0].message.content is not None


def test_replayed_calls_reach_the_template_as_objects(http):
    """An assistant turn with ``tool_calls`` (no content) and the tool's answer are accepted; the
    template sees the arguments as an object (vLLM's), so the conversation round-trips."""
    replay = MESSAGES + [
        {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny"}]
    req = parse_chat_request({"messages": replay, "tools": TOOLS, "tool_choice": "none"})
    # Checked, and left as JSON text: the chat layer decodes it once for the template.
    assert req.messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    assert req.messages[1]["content"] == "" and req.messages[2]["tool_call_id"] == "call_1"
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": replay, "tools": TOOLS,
                                                "tool_choice": NAMED, "temperature": 0, "max_tokens": MAX_TOKENS})
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]),
                        WEATHER)


@pytest.mark.parametrize("arguments,shown", [("5", "5"), ('"{\\"a\\": 1}"', '{"a": 1}')])
def test_replayed_arguments_are_decoded_once(tiny_model_dir, arguments, shown):
    """vLLM json.loads a replayed call's arguments once and hands the template whatever JSON value
    it is: a number is no error, a JSON string holding JSON stays a string (the server used to
    decode twice: a 400 for "5", an object for the string)."""
    from transformers import AutoTokenizer

    from ferrokv.llm import chat_prompt

    replay = MESSAGES + [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "get_weather", "arguments": arguments}}]}]
    req = parse_chat_request({"messages": replay})
    template = "{% for m in messages %}{% for c in m.get('tool_calls', []) %}<{{ c.function.arguments }}>" \
               "{% endfor %}{% endfor %}"
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir("llama-serve")))
    assert chat_prompt(tokenizer, req.messages, False, chat_template=template)[0] == f"<{shown}>"


@pytest.fixture(scope="module")
def auto_client(tiny_model_dir):
    """A server that reads ``tool_choice: "auto"`` calls in the hermes format."""
    with serve(tiny_model_dir("llama-serve"), "--served-model-name", MODEL, "--max-model-len", "512",
               "--enable-auto-tool-choice", "--tool-call-parser", "hermes") as s:
        with openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120.0) as c:
            yield c


def forced_text(text: str) -> dict[str, Any]:
    """A structured output that makes the random model write exactly ``text`` (the model's own
    calls would be noise): the parser then reads what a tool-calling model writes."""
    return {"structured_outputs": {"regex": re.sub(r"([.+*?()|\[\]{}^$\\])", r"\\\1", text)}}


HERMES_TEXT = 'Checking.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_hermes_calls_from_the_text(auto_client, stream):
    r = create(auto_client, stream, extra_body=forced_text(HERMES_TEXT))
    if stream:
        calls, content, reason, _ = streamed_calls(r)
    else:
        (choice,) = r.choices
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in choice.message.tool_calls]
        content, reason = choice.message.content, choice.finish_reason
    assert reason == "tool_calls"  # vLLM's, once an auto reply called tools
    assert content == "Checking.\n"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_time", {"zone": "CET"})]
    assert calls[0]["id"].startswith("chatcmpl-tool-")


@pytest.mark.parametrize("stream", [False, True])
def test_auto_without_calls_is_plain_text(auto_client, stream):
    r = create(auto_client, stream, extra_body=forced_text("It is <b>sunny</b>."))
    if stream:
        calls, content, reason, _ = streamed_calls(r)
    else:
        calls, content, reason = r.choices[0].message.tool_calls, r.choices[0].message.content, \
            r.choices[0].finish_reason
    assert (calls, content, reason) == ([], "It is <b>sunny</b>.", "stop")


def test_auto_only_calls_has_null_content(auto_client):
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}</tool_call>'
    choice = create(auto_client, False, extra_body=forced_text(text)).choices[0]
    assert choice.message.content is None and choice.finish_reason == "tool_calls"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Rome", "days": 2}


HERMES_TWO_CALLS = ('<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>\n'
             '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}</tool_call>')


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parallel", [None, False])
def test_auto_parallel_tool_calls_false_keeps_the_first_call(auto_client, stream, parallel):
    """vLLM's maybe_filter_parallel_tool_calls: the model wrote two calls; with
    ``parallel_tool_calls`` false only the first comes back (streamed: only call 0's deltas)."""
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    r = create(auto_client, stream, extra_body=forced_text(HERMES_TWO_CALLS), **extra)
    if stream:
        calls, content, reason, deltas = streamed_calls(r)
        assert {d.index for d in deltas} == ({0} if parallel is False else {0, 1})
    else:
        (choice,) = r.choices
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls]
        content, reason = choice.message.content, choice.finish_reason
    want = [("get_time", {"zone": "CET"}), ("get_weather", {"city": "Rome", "days": 2})]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == (want[:1] if parallel is False else want)
    assert not content and reason == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parallel", [None, False])
def test_responses_parallel_tool_calls_false_keeps_the_first_call(auto_client, stream, parallel):
    """The Responses API answers the same calls as chat, streamed or not (``structured_outputs``
    is passed on, as vLLM's ResponsesRequest takes it)."""
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    r = auto_client.responses.create(model=MODEL, input="weather?", tools=tools, temperature=0.0, stream=stream,
                                     max_output_tokens=MAX_TOKENS, extra_body=forced_text(HERMES_TWO_CALLS), **extra)
    if stream:
        events = list(r)
        added = [e.item.name for e in events if e.type == "response.output_item.added"]
        r = events[-1].response
        assert added == [item.name for item in r.output]
    want = [("get_time", {"zone": "CET"}), ("get_weather", {"city": "Rome", "days": 2})]
    assert r.status == "completed"
    assert [(i.type, i.name, json.loads(i.arguments)) for i in r.output] == \
        [("function_call", *w) for w in (want[:1] if parallel is False else want)]


@pytest.mark.parametrize("stream", [False, True])
def test_auto_call_cut_by_max_tokens_finishes_with_length(auto_client, stream):
    """vLLM's: "tool_calls" only when the engine stopped; a reply cut by ``max_tokens`` after a
    complete call keeps "length", so the truncation is not hidden."""
    text = '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call> ' + "x" * 300
    r = create(auto_client, stream, max_tokens=100, extra_body=forced_text(text))
    if stream:
        calls, _, reason, _ = streamed_calls(r)
    else:
        (choice,) = r.choices
        calls, reason = choice.message.tool_calls, choice.finish_reason
    assert reason == "length" and len(calls) == 1


BAD = [
    (dict(tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice.function.name", ["'nope'"]),
    (dict(tool_choice="auto"), "tool_choice", ["auto"]),
    (dict(tool_choice=None), "tool_choice", ["auto"]),
    (dict(tool_choice="sometimes"), "tool_choice", ["'sometimes'"]),
    (dict(tool_choice=7), "tool_choice", ["7"]),
    (dict(tools=None, tool_choice="required"), "tools", ["'required'"]),
    (dict(tools=None, tool_choice="auto"), "tools", ["'auto'"]),  # OpenAI's and vLLM's: a choice needs tools
    (dict(tool_choice="required", tools=[
        {"type": "function", "function": {"name": "f", "parameters": {"$defs": {"A": {"type": "integer"}}}}},
        {"type": "function", "function": {"name": "g", "parameters": {"$defs": {"A": {"enum": ["s"]}}}}}]),
     "tools[1].function.parameters.$defs", ["'A'", "two schemas"]),
    (dict(tool_choice="required", tools=[{"type": "function", "function": {"name": "f", "parameters": {"$defs": [1]}}}]),
     "tools[0].function.parameters.$defs", ["[1]"]),
    (dict(tool_choice="none", messages=[{"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "[" * 100_000 + "]" * 100_000}}]}]),
     "messages[0].tool_calls[0].function.arguments", ["must be JSON text"]),
    (dict(tool_choice="required", response_format={"type": "json_schema"}), "response_format.json_schema", ["None"]),
    (dict(tool_choice=NAMED, structured_outputs="bogus"), "structured_outputs", ["'bogus'"]),
    (dict(tools=[{"type": "function", "function": {"parameters": {}}}], tool_choice="required"),
     "tools[0].function.name", ["None"]),
    (dict(tools=[{"type": "retrieval"}], tool_choice="required"), "tools[0].type", ["'retrieval'"]),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}], tool_choice="required"),
     "tools[0].function.parameters", ["'x'"]),
    (dict(tools="f", tool_choice="none"), "tools", ["'f'"]),
    (dict(tools=[{"type": "function", "function": {"name": "f", "description": 5}}], tool_choice="none"),
     "tools[0].function.description", ["5"]),
    (dict(tool_choice="required", parallel_tool_calls="maybe"), "parallel_tool_calls", ["'maybe'"]),
    (dict(tool_choice="none", messages=[{"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]),
     "messages[0].tool_calls[0].function.arguments", ["'{oops'"]),
    (dict(tool_choice="none", messages=[{"role": "assistant", "tool_calls": [{"type": "function"}]}]),
     "messages[0].tool_calls[0]", ["{'type': 'function'}"]),
    (dict(tool_choice="none", messages=[{"role": "tool", "tool_call_id": 5, "content": "x"}]),
     "messages[0].tool_call_id", ["5"]),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
          tool_choice="required"), "tools", ["nonsense"]),
]


@pytest.mark.parametrize("extra,param,needles", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_bad_tool_fields_are_400s_naming_them(http, extra, param, needles):
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 4, **extra}
    err = assert_openai_error(http.post("/v1/chat/completions", json=body), 400, *needles)
    assert err["param"] == param, err
    assert http.get("/health").status_code == 200


def test_tokenize_takes_tools_without_a_tool_choice(http):
    r = http.post("/tokenize", json={"model": MODEL, "messages": MESSAGES, "tools": TOOLS})
    assert r.status_code == 200 and r.json()["count"] > 0


# ------------------------------------------------------------------------------------------------
# The parsers alone: any split of the text gives the same calls and content.
FUNCTIONS = tuple(t["function"] for t in TOOLS)


def parse_split(choice: ToolChoice, text: str, cut: int) -> tuple[list[tuple[str, str]], str | None]:
    """The calls (name, arguments) and content of ``text`` fed in two pieces, as a stream adds
    them up (each call's first delta whole, later ones appending arguments)."""
    p = tool_call_parser(choice)
    content, calls = "", {}
    for piece in (p.feed(text[:cut]), p.feed(text[cut:]), p.close()):
        content += piece[0]
        for d in piece[1]:
            c = calls.setdefault(d["index"], ["", ""])
            c[0] += d["function"].get("name", "")
            c[1] += d["function"]["arguments"]
    assert [tuple(c) for c in calls.values()] == [(c["function"]["name"], c["function"]["arguments"]) for c in p.calls]
    return [tuple(c) for c in calls.values()], content


def test_required_text_splits_into_calls_at_any_cut():
    choice = ToolChoice(FUNCTIONS)
    text = ' [ {"name": "get_time", "parameters": {"zone": "U\\"}{TC"}} ,{"name":"get_weather","parameters":{}}]'
    want = [("get_time", json.dumps({"zone": 'U"}{TC'})), ("get_weather", "{}")]
    assert all(parse_split(choice, text, cut) == (want, "") for cut in range(len(text) + 1))
    cut = text[:70]  # the second call is open: it comes back as text
    calls, content = parse_split(choice, cut, 30)
    assert calls == want[:1] and content == cut[cut.index("} ,") + 1:]
    assert parse_split(choice, text[:60], 30) == (want[:1], "")  # cut after a separator: no text
    # A forced answer keeps its call whatever its numbers (the grammar allows 1e999), as vLLM
    # writes it; in "auto" such an object is text (see the hermes cases).
    assert parse_split(choice, '[{"name": "get_time", "parameters": {"x": 1e999}}]', 9) == \
        ([("get_time", '{"x": Infinity}')], "")


def test_named_call_with_no_text_still_has_one_call():
    assert parse_split(ToolChoice(FUNCTIONS, name="get_time"), "", 0) == ([("get_time", "")], "")


HERMES = ToolChoice(FUNCTIONS, parser="hermes")


@pytest.mark.parametrize("text,calls,content", [
    ("Let me check.\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"zone\": \"CET\"}}\n</tool_call>",
     [("get_time", '{"zone": "CET"}')], "Let me check.\n"),
    ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": {"x": "</"}}'
     "</tool_call>", [("a", "{}"), ("b", '{"x": "</"}')], ""),
    ("no calls here, just a < sign and <tool", [], "no calls here, just a < sign and <tool"),
    ('<tool_call>{"name": "a", "arguments": {"k": 1}}', [("a", '{"k": 1}')], ""),  # unclosed at the end: vLLM's
    ("<tool_call>{not json}</tool_call> after", [], "<tool_call>{not json}</tool_call> after"),
    ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\nDone.', [("a", "{}")], "Done."),
    # No strict JSON reader takes the Infinity/NaN these would re-serialize to: content, as pythonic's
    ('<tool_call>{"name": "a", "arguments": {"x": 1e999}}</tool_call>', [],
     '<tool_call>{"name": "a", "arguments": {"x": 1e999}}</tool_call>'),
    ('<tool_call>{"name": "a", "arguments": {"x": NaN}}</tool_call>', [],
     '<tool_call>{"name": "a", "arguments": {"x": NaN}}</tool_call>'),
    # A lone surrogate written as an escape stays an escape: the response must be valid UTF-8.
    ('<tool_call>{"name": "a", "arguments": {"x": "\\ud800 é"}}</tool_call>', [("a", '{"x": "\\ud800 é"}')], ""),
    ('<tool_call>{"name": "a\\udfff", "arguments": {}}</tool_call>', [],  # no tool has such a name
     '<tool_call>{"name": "a\\udfff", "arguments": {}}</tool_call>'),
])
def test_hermes_calls_and_content_at_any_cut(text, calls, content):
    assert all(parse_split(HERMES, text, cut) == (calls, content) for cut in range(len(text) + 1))
    p = tool_call_parser(HERMES)  # a character at a time: the closing-tag search resumes
    fed = [p.feed(ch) for ch in text] + [p.close()]
    assert "".join(f[0] for f in fed) == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in p.calls] == calls


TWO_CALLS = [("get_weather", {"city": "Rome", "days": 2}), ("get_time", {"zone": "CET"})]


def mistral_model_dir(tiny_model_dir) -> Any:
    """The tiny Llama with room for one more token, ``[TOOL_CALLS]``, in its tokenizer (an added
    token that is not special: a structured output can spell it)."""
    from helpers.tiny_models import TINY_VOCAB
    from tokenizers import AddedToken, Tokenizer

    path = tiny_model_dir("mistral-serve", vocab_size=TINY_VOCAB + 1)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    if tok.token_to_id("[TOOL_CALLS]") is None:
        tok.add_tokens([AddedToken("[TOOL_CALLS]", special=False)])
        tok.save(str(path / "tokenizer.json"))
    assert tok.token_to_id("[TOOL_CALLS]") == TINY_VOCAB
    return path


@pytest.mark.parametrize("parser,text", [
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Rome", "days": 2}}; '
                    '{"name": "get_time", "parameters": {"zone": "CET"}}'),
    ("pythonic", '[get_weather(city="Rome", days=2), get_time(zone="CET")]'),
    ("mistral", 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}, '
                '{"name": "get_time", "arguments": {"zone": "CET"}}]'),
])
def test_a_server_reads_calls_with_its_parser(tiny_model_dir, parser, text):
    """``--tool-call-parser`` end to end, streamed and not."""
    model = mistral_model_dir(tiny_model_dir) if parser == "mistral" else tiny_model_dir("llama-serve")
    with serve(model, "--served-model-name", MODEL, "--max-model-len", "512",
               "--enable-auto-tool-choice", "--tool-call-parser", parser) as s:
        with openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120.0) as c:
            whole = create(c, False, extra_body=forced_text(text)).choices[0]
            calls, content, reason, _ = streamed_calls(create(c, True, extra_body=forced_text(text)))
    want_content = "Sure." if parser == "mistral" else None
    assert (whole.message.content, whole.finish_reason) == (want_content, "tool_calls")
    assert [(t.function.name, json.loads(t.function.arguments)) for t in whole.message.tool_calls] == TWO_CALLS
    assert [(x["name"], json.loads(x["arguments"])) for x in calls] == TWO_CALLS
    assert (content, reason) == (want_content or "", "tool_calls")
    if parser == "mistral":  # Mistral's templates check replayed ids: 9 letters and digits
        assert all(re.fullmatch("[A-Za-z0-9]{9}", t.id) for t in whole.message.tool_calls)


def test_the_mistral_parser_needs_its_token(tiny_model_dir, capsys):
    from ferrokv.cli import main

    rc = main(["serve", str(tiny_model_dir("llama-serve")), "--enable-auto-tool-choice", "--tool-call-parser",
               "mistral", "--max-model-len", "512", "--port", "0"])
    err = capsys.readouterr().err
    assert rc == 2 and "--tool-call-parser mistral needs a tokenizer with the [TOOL_CALLS] token" in err


LLAMA3 = ToolChoice(FUNCTIONS, parser="llama3_json")


@pytest.mark.parametrize("text,calls,content", [
    ('{"name": "get_time", "parameters": {"zone": "CET"}}', [("get_time", '{"zone": "CET"}')], ""),
    ('<|python_tag|>{"name": "a", "arguments": {"k": "}{"}}; {"name": "b", "parameters": {}}',
     [("a", '{"k": "}{"}'), ("b", "{}")], ""),
    (' \n{"name": "a", "parameters": {}}\n', [("a", "{}")], ""),
    ("It is sunny {today}.", [], "It is sunny {today}."),  # not a reply that starts with a call
    ("<|python", [], "<|python"),
    ('{"name": "a", "parameters": {}}; {"name": "b", "param', [("a", "{}")], '; {"name": "b", "param'),
    ("{not json}", [], "{not json}"),
    # Text between calls, or an object that is no call, is content; separators alone are not.
    ('{"name": "a", "parameters": {}} and then {"name": "b", "parameters": {}};',
     [("a", "{}"), ("b", "{}")], " and then "),
    ('{"name": "a", "parameters": {}}; {"x": 1}; {"name": "b", "parameters": {}}]',
     [("a", "{}"), ("b", "{}")], '; {"x": 1}; ]'),
])
def test_llama3_json_calls_and_content_at_any_cut(text, calls, content):
    """vLLM's llama3_json: a reply that starts with a JSON object (or <|python_tag|>) is calls,
    separated by ";"; nothing that is not a complete call is lost."""
    assert all(parse_split(LLAMA3, text, cut) == (calls, content) for cut in range(len(text) + 1))


def test_required_schema_matches_vllms_shape():
    schema = ToolChoice(FUNCTIONS, parallel=False).schema()
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    jsonschema.validate([{"name": "get_time", "parameters": {"zone": "UTC"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {"city": "Paris", "days": 2}}], schema)
    assert "maxItems" not in ToolChoice(FUNCTIONS).schema()


PYTHONIC = ToolChoice(FUNCTIONS, parser="pythonic")


@pytest.mark.parametrize("text,calls,content", [
    ('[get_weather(city="Rome", days=2)]', [("get_weather", '{"city": "Rome", "days": 2}')], ""),
    # Several calls; strings hold brackets, quotes and escapes; literals become JSON.
    ("\n[a(k='x)]\\'(', n=-1.5, flag=True, none=None), b()]",
     [("a", '{"k": "x)]\'(", "n": -1.5, "flag": true, "none": null}'), ("b", "{}")], ""),
    ('[f(xs=[1, (2, 3)], d={"k": [None]})]', [("f", '{"xs": [1, [2, 3]], "d": {"k": [null]}}')], ""),
    # What Python reads counts: triple quotes, comments.
    ("[f(s='''it's (ok)'''),  # the first\n g(b=2)]", [("f", '{"s": "it\'s (ok)"}'), ("g", '{"b": 2}')], ""),
    # Anything but a list of calls with keyword literals is content, all of it (vLLM's reading).
    ("It is sunny [today].", [], "It is sunny [today]."),
    ("[1, 2, 3]", [], "[1, 2, 3]"),
    ("[]", [], "[]"),
    ('[a(k=1), b("positional")]', [], '[a(k=1), b("positional")]'),
    ("[a(k=1), b(k=open(1))]", [], "[a(k=1), b(k=open(1))]"),
    ("[a(k={1, 2})]", [], "[a(k={1, 2})]"),  # a set is no JSON value
    ("[a(k=1)] and some words", [], "[a(k=1)] and some words"),
    ("[f(a=1),,g(b=2)]", [], "[f(a=1),,g(b=2)]"),
    ("[f(a=1)][g(b=2)]", [], "[f(a=1)][g(b=2)]"),
    ('[a(k=1), b(k="cut by max_tok', [], '[a(k=1), b(k="cut by max_tok'),
    ('[a(k="\\ud800 é")]', [("a", '{"k": "\\ud800 é"}')], ""),  # a lone surrogate stays an escape (UTF-8 out)
])
def test_pythonic_calls_and_content_at_any_cut(text, calls, content):
    """vLLM's pythonic parser: a reply that is a Python list of calls with keyword literal
    arguments is calls; any other is content, all of it, as vLLM reads it."""
    assert all(parse_split(PYTHONIC, text, cut) == (calls, content) for cut in range(len(text) + 1))


MISTRAL = ToolChoice(FUNCTIONS, parser="mistral")


@pytest.mark.parametrize("text,calls,content", [
    ('[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "CET"}}]', [("get_time", '{"zone": "CET"}')], ""),
    ('Let me see [1].[TOOL_CALLS] [{"name": "a", "arguments": {"k": "]}["}}, {"name": "b", "arguments": {}}]',
     [("a", '{"k": "]}["}'), ("b", "{}")], "Let me see [1]."),
    ("No calls, a [TOOL_CALL and a [TOOL", [], "No calls, a [TOOL_CALL and a [TOOL"),
    ('[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "argu', [("a", "{}")], ', {"name": "b", "argu'),
    ("[TOOL_CALLS]{not json}", [], "{not json}"),
    # Text after the array is content, without the array's bracket.
    ('Before.[TOOL_CALLS][{"name": "a", "arguments": {}}] after', [("a", "{}")], "Before. after"),
    # Text before the array, between calls or after a stray bracket is content, as generated.
    ('[TOOL_CALLS] Sure: [{"name": "a", "arguments": {}}, "oops", {"name": "b", "arguments": {}},]',
     [("a", "{}"), ("b", "{}")], ' Sure: , "oops", '),
    ('[TOOL_CALLS][{"name": "a", "arguments": {}}]]', [("a", "{}")], "]"),
])
def test_mistral_calls_and_content_at_any_cut(text, calls, content):
    """vLLM's mistral parser with a Hugging Face tokenizer: the calls are a JSON array after the
    [TOOL_CALLS] token; text before it is content, and nothing that is not a complete call is lost."""
    assert all(parse_split(MISTRAL, text, cut) == (calls, content) for cut in range(len(text) + 1))
