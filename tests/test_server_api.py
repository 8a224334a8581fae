"""`ferrokv serve` through the official ``openai`` client: completions and chat (checked against
an in-process ``LLM`` on the same tiny model), streaming (deltas concatenate to the non-streamed
text at temperature 0), stream usage, n, prompt lists, stop strings, logprobs, seeds, /v1/models,
/tokenize and /detokenize, prefix-cache accounting (cached_tokens, and the /metrics counter) and
cache_salt isolation, /metrics names, and prompts kept out of the log.

One server per module (started with --api-key, so every call also exercises auth's happy path);
requests are sequential unless a test says otherwise, so the greedy reference holds exactly.
"""

from __future__ import annotations

import collections
import itertools
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from helpers.server import assert_openai_error, metric_values, read_metrics, serve, sse_events
from helpers.tiny_tokenizer import tiny_tokenizer

MODEL = "tiny-test"
API_KEY = "sk-ferrokv-test"
MAX_MODEL_LEN = 512
AUTH = {"Authorization": f"Bearer {API_KEY}"}

PROMPT = "The cat runs the red ball"
MAX_LOGPROBS = 30  # the server's --max-logprobs, above the default 20
UNI_PROMPT = "The café owner likes crème brûlée 中文 🚀"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "A dog sees the blue sky."}]
# Long enough to span several 16-token KV blocks, so a repeat can hit the prefix cache.
LONG_TEXT = " ".join(["Every request samples many tokens from the paged cache with joy."] * 12)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama-serve")


@pytest.fixture(scope="module")
def server(model_dir):
    with serve(model_dir, "--served-model-name", MODEL, "--api-key", API_KEY, "--max-model-len", str(MAX_MODEL_LEN),
               "--enable-prefix-caching", "--trust-request-chat-template", "--max-logprobs", str(MAX_LOGPROBS)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120.0) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120.0) as c:
        yield c


@pytest.fixture(scope="module")
def reference(model_dir):
    """The same model in-process: what the server must answer at temperature 0."""
    from ferrokv import LLM

    return LLM(str(model_dir), max_model_len=MAX_MODEL_LEN, num_kv_blocks=128)


def chat_ids(messages) -> list[int]:
    from ferrokv.llm import chat_token_ids

    return chat_token_ids(tiny_tokenizer(), messages)


def prompt_ids(text: str) -> list[int]:
    return tiny_tokenizer()(text)["input_ids"]


def greedy_reference(reference, prompt, max_tokens: int) -> str:
    from ferrokv import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return reference.generate(prompt, params, use_tqdm=False)[0].outputs[0].text


def complete(client, **kw):
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True})
    args.update(kw)
    return client.completions.create(**args)


def chat(client, **kw):
    args = dict(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True})
    args.update(kw)
    return client.chat.completions.create(**args)


def cached_tokens(usage) -> int:
    details = usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None, usage
    return details.cached_tokens


# ------------------------------------------------------------------------------------------------
# completions and chat
# ------------------------------------------------------------------------------------------------

def test_completion_matches_offline_llm(client, reference):
    r = complete(client, max_tokens=10)
    assert r.object == "text_completion" and r.model == MODEL and r.id
    assert len(r.choices) == 1
    c = r.choices[0]
    assert c.index == 0 and c.finish_reason == "length"
    assert c.text == greedy_reference(reference, PROMPT, 10)
    assert r.usage.prompt_tokens == len(prompt_ids(PROMPT))
    assert r.usage.completion_tokens == 10
    assert r.usage.total_tokens == r.usage.prompt_tokens + 10


def test_echo_puts_the_prompt_first_as_vllm(client, reference):
    """vLLM's echo: the prompt leads the text (streamed: the first chunk); with logprobs, the
    prompt's own logprobs lead them (the first token has none); with max_tokens 0, as lm-eval's
    loglikelihood sends it, the choice is the prompt alone."""
    from ferrokv import SamplingParams

    want = greedy_reference(reference, PROMPT, 4)
    r = complete(client, max_tokens=4, echo=True)
    assert r.choices[0].text == PROMPT + want and r.usage.completion_tokens == 4
    streamed = "".join(ch.choices[0].text for ch in complete(client, max_tokens=4, echo=True, stream=True)
                       if ch.choices)
    assert streamed == PROMPT + want
    r = complete(client, max_tokens=0, echo=True, logprobs=1)
    lp, ids = r.choices[0].logprobs, prompt_ids(PROMPT)
    assert r.choices[0].text == PROMPT and r.usage.completion_tokens == 0
    assert "".join(lp.tokens) == PROMPT and len(lp.tokens) == len(ids) and lp.text_offset[0] == 0
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = reference.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=1),
                             use_tqdm=False)[0].prompt_logprobs
    for got, entry, tid in zip(lp.token_logprobs[1:], ref[1:], ids[1:]):
        assert got == pytest.approx(entry[tid].logprob, abs=1e-4)
    # Streamed, each choice's first chunk leads with the prompt and its logprobs (vLLM's); the
    # pieces add up to the whole answer. Token names as ids too (the prompt's first as well).
    for max_tokens, as_ids in ((0, False), (3, False), (3, True)):
        kw = dict(max_tokens=max_tokens, echo=True, logprobs=2, n=2, temperature=1.0, seed=5,
                  extra_body={"ignore_eos": True, "return_tokens_as_token_ids": as_ids})
        whole = {c.index: c for c in complete(client, **kw).choices}
        got: dict[int, list] = {}
        for ch in complete(client, stream=True, **kw):
            (c,) = ch.choices
            text, tokens, lps, offsets = got.setdefault(c.index, ["", [], [], []])
            got[c.index] = [text + c.text, tokens + c.logprobs.tokens, lps + c.logprobs.token_logprobs,
                            offsets + c.logprobs.text_offset]
        for i, w in whole.items():
            assert got[i] == [w.text, w.logprobs.tokens, w.logprobs.token_logprobs, w.logprobs.text_offset]
            assert w.text.startswith(PROMPT) and (w.logprobs.tokens[0] == f"token_id:{ids[0]}") == as_ids
    with pytest.raises(openai.BadRequestError, match="max_tokens must be an integer in \\[1,"):
        complete(client, max_tokens=0)
    # Each position lists at most logprobs + 1 tokens, the echoed prompt's too (vLLM's), whatever
    # prompt_logprobs asked.
    r = complete(client, max_tokens=3, echo=True, logprobs=1, extra_body={"prompt_logprobs": 4})
    sizes = [len(top) for top in r.choices[0].logprobs.top_logprobs[1:]]
    assert sizes and max(sizes) <= 2 and min(sizes) >= 1


def test_truncate_prompt_tokens_runs_on_the_prompts_last_tokens(client, reference):
    ids = prompt_ids(PROMPT)
    r = complete(client, max_tokens=6, extra_body={"ignore_eos": True, "truncate_prompt_tokens": 3})
    assert r.usage.prompt_tokens == 3 < len(ids)
    assert r.choices[0].text == greedy_reference(reference, {"prompt_token_ids": ids[-3:]}, 6)
    # A prompt longer than the context fits once truncated: the room is checked after truncation.
    long_ids = [5 + i % 300 for i in range(MAX_MODEL_LEN + 20)]
    r = complete(client, prompt=long_ids, max_tokens=4, extra_body={"ignore_eos": True, "truncate_prompt_tokens": 8})
    assert r.usage.prompt_tokens == 8 and r.usage.completion_tokens == 4
    # -1: as many as leave max_tokens to generate (vLLM's renderer).
    r = complete(client, prompt=long_ids, max_tokens=4, extra_body={"ignore_eos": True, "truncate_prompt_tokens": -1})
    assert r.usage.prompt_tokens == MAX_MODEL_LEN - 4 and r.usage.completion_tokens == 4
    with pytest.raises(openai.BadRequestError, match=rf"truncate_prompt_tokens={MAX_MODEL_LEN + 1} is greater"):
        complete(client, max_tokens=4, extra_body={"truncate_prompt_tokens": MAX_MODEL_LEN + 1})


def test_chat_matches_offline_llm(client, reference):
    r = chat(client, max_tokens=10)
    assert r.object == "chat.completion" and r.model == MODEL and r.id
    assert len(r.choices) == 1
    c = r.choices[0]
    assert c.index == 0 and c.finish_reason == "length" and c.message.role == "assistant"
    ids = chat_ids(MESSAGES)
    assert c.message.content == greedy_reference(reference, {"prompt_token_ids": ids}, 10)
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == 10
    assert r.usage.total_tokens == len(ids) + 10


def test_chat_echo_leads_a_continued_message_with_its_content_as_vllm(client):
    """vLLM's chat echo: the last message's content (text parts joined by newlines) leads each
    choice when that message has the answer's role, streamed as its own first delta; a reply to a
    user message is unchanged."""
    assert chat(client, extra_body={"ignore_eos": True, "echo": True}).choices[0].message.content == \
        chat(client).choices[0].message.content
    cont = dict(messages=MESSAGES + [{"role": "assistant", "content": [{"type": "text", "text": "The sky"},
                                                                      {"type": "text", "text": "is"}]}])
    body = {"ignore_eos": True, "add_generation_prompt": False, "continue_final_message": True}
    plain = chat(client, n=2, extra_body=body, **cont)
    echoed = chat(client, n=2, extra_body={**body, "echo": True}, **cont)
    assert [c.message.content for c in echoed.choices] == ["The sky\nis" + c.message.content for c in plain.choices]
    assert echoed.usage == plain.usage
    events = list(chat(client, extra_body={**body, "echo": True}, stream=True, **cont))
    deltas = [e.choices[0].delta.content for e in events if e.choices and e.choices[0].delta.content]
    assert deltas[0] == "The sky\nis" and "".join(deltas) == echoed.choices[0].message.content


def test_chat_content_as_text_parts(client):
    """Text parts reach a template that reads strings joined with newlines, as vLLM joins them."""
    parts = [{"type": "text", "text": "A dog sees"}, {"type": "text", "text": "the blue sky."}]
    as_parts = chat(client, messages=[{"role": "user", "content": parts}])
    as_text = chat(client, messages=[{"role": "user", "content": "A dog sees\nthe blue sky."}])
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content
    assert as_parts.usage.prompt_tokens == as_text.usage.prompt_tokens


def test_chat_max_completion_tokens(client):
    r = chat(client, max_tokens=None, max_completion_tokens=5)
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"


def test_completion_prompt_as_token_ids(client):
    ids = prompt_ids(PROMPT)
    by_ids = complete(client, prompt=ids)
    by_text = complete(client)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_completion_prompt_list_gives_one_choice_per_prompt(client):
    prompts = [PROMPT, UNI_PROMPT, "A dog"]
    r = complete(client, prompt=prompts, max_tokens=5)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [complete(client, prompt=p, max_tokens=5).choices[0].text for p in prompts]
    assert r.usage.prompt_tokens == sum(len(prompt_ids(p)) for p in prompts)
    assert r.usage.completion_tokens == 15


def test_vllm_extras_and_user_are_accepted(client):
    r = complete(client, max_tokens=6, temperature=0.8, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.5,
                 user="user-1", seed=3,
                 extra_body={"ignore_eos": True, "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1,
                             "min_tokens": 2, "priority": 0})
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"


# ------------------------------------------------------------------------------------------------
# streaming
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt", [PROMPT, UNI_PROMPT])
def test_completion_stream_equals_non_stream(client, prompt):
    whole = complete(client, prompt=prompt, max_tokens=24)
    chunks = list(complete(client, prompt=prompt, max_tokens=24, stream=True))
    assert chunks, "no chunks"
    assert {c.id for c in chunks} == {chunks[0].id}
    assert all(c.object == "text_completion" and c.model == MODEL for c in chunks)
    assert all(c.usage is None for c in chunks)
    text = "".join(ch.text for c in chunks for ch in c.choices)
    assert text == whole.choices[0].text
    reasons = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason is not None]
    assert reasons == ["length"], reasons


@pytest.mark.parametrize("content", ["A dog sees the blue sky.", "Le café: crème brûlée 😀 中文"])
def test_chat_stream_equals_non_stream(client, content):
    messages = [{"role": "user", "content": content}]
    whole = chat(client, messages=messages, max_tokens=24)
    chunks = list(chat(client, messages=messages, max_tokens=24, stream=True))
    assert chunks
    assert {c.id for c in chunks} == {chunks[0].id}
    assert all(c.object == "chat.completion.chunk" and c.model == MODEL for c in chunks)
    roles = [ch.delta.role for c in chunks for ch in c.choices if ch.delta.role]
    assert roles == ["assistant"], roles
    text = "".join(ch.delta.content or "" for c in chunks for ch in c.choices)
    assert text == whole.choices[0].message.content
    reasons = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason is not None]
    assert reasons == ["length"], reasons


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_raw_sse_framing_ends_with_done(http, path):
    body = {"model": MODEL, "max_tokens": 5, "temperature": 0, "stream": True, "ignore_eos": True}
    body.update({"prompt": PROMPT} if "chat" not in path else {"messages": MESSAGES})
    with http.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = list(resp.iter_lines())
    events = sse_events(lines)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    for e in events[:-1]:
        assert isinstance(json.loads(e), dict), e
    # Every event is one "data:" line followed by a blank line.
    assert [line for line in lines if line and not line.startswith("data:")] == []


def test_responses_carry_the_fields_vllm_sends_as_null(http):
    """vLLM dumps its response models whole: fields ferrokv never sets are there as null, so a
    client indexing a plain dict finds them (a message without tools has no tool_calls, as OpenAI's)."""
    nulls = {"service_tier": None, "system_fingerprint": None, "kv_transfer_params": None}
    body = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2}).json()
    assert {k: body[k] for k in nulls} == nulls and body["usage"]["completion_tokens"] == 2, body
    body = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2}).json()
    assert {k: body[k] for k in nulls} == nulls, body
    message = body["choices"][0]["message"]
    assert message["role"] == "assistant" and isinstance(message["content"], str)
    assert {k: message[k] for k in ("refusal", "annotations", "audio", "function_call", "reasoning_content")} == \
        dict(refusal=None, annotations=None, audio=None, function_call=None, reasoning_content=None)
    assert "tool_calls" not in message


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_stream_include_usage(client, endpoint):
    call = complete if endpoint == "completions" else chat
    expected_prompt = len(prompt_ids(PROMPT)) if endpoint == "completions" else len(chat_ids(MESSAGES))
    chunks = list(call(client, max_tokens=7, stream=True, stream_options={"include_usage": True}))
    *body, last = chunks
    assert last.choices == [] and last.usage is not None, last
    assert last.usage.prompt_tokens == expected_prompt
    assert last.usage.completion_tokens == 7
    assert last.usage.total_tokens == expected_prompt + 7
    assert body and all(c.usage is None for c in body)
    # Without stream_options no chunk carries usage; given, include_usage defaults to true (vLLM's),
    # unless it is false.
    assert all(c.usage is None for c in call(client, max_tokens=3, stream=True))
    for opts, usage in (({}, True), ({"continuous_usage_stats": False}, True), ({"include_usage": False}, False),
                        ({"include_usage": None}, False)):
        *_, last = list(call(client, max_tokens=3, stream=True, stream_options=opts))
        assert (last.usage is not None) == usage, opts
    # vLLM's continuous_usage_stats: the usage so far in every chunk, growing to the total.
    opts = {"include_usage": True, "continuous_usage_stats": True}
    *body, last = list(call(client, max_tokens=7, stream=True, stream_options=opts))
    counts = [c.usage.completion_tokens for c in body]
    assert all(c.usage.prompt_tokens == expected_prompt for c in body) and counts == sorted(counts)
    assert counts[-1] == last.usage.completion_tokens == 7
    if endpoint == "chat":  # the role chunk comes before any token (vLLM's 0)
        assert body[0].choices[0].delta.role == "assistant" and counts[0] == 0


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_stream_sends_one_choice_per_chunk_with_its_own_usage(client, endpoint):
    """As vLLM and OpenAI: every chunk carries one choice (a client reading choices[0] loses
    nothing), and continuous usage counts that choice's tokens and its prompt's."""
    call = complete if endpoint == "completions" else chat
    prompts = {"prompt": [PROMPT, "Once upon a time"]} if endpoint == "completions" else {}
    opts = {"include_usage": True, "continuous_usage_stats": True}
    *body, last = list(call(client, n=2, max_tokens=5, stream=True, stream_options=opts, **prompts))
    assert all(len(c.choices) == 1 for c in body)
    seen: dict[int, list[int]] = {}
    for c in body:
        seen.setdefault(c.choices[0].index, []).append(c.usage.completion_tokens)
    assert sorted(seen) == list(range(4 if prompts else 2))
    assert all(counts == sorted(counts) and counts[-1] == 5 for counts in seen.values())
    assert last.usage.completion_tokens == 5 * len(seen)
    if prompts:  # each chunk counts its own prompt
        lens = [len(prompt_ids(p)) for p in prompts["prompt"]]
        assert all(c.usage.prompt_tokens == lens[c.choices[0].index // 2] for c in body)
        assert last.usage.prompt_tokens == sum(lens)


# ------------------------------------------------------------------------------------------------
# n, stop strings, logprobs, seeds
# ------------------------------------------------------------------------------------------------

def test_n2_completions(client):
    r = complete(client, n=2, temperature=1.0, seed=7, max_tokens=8)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 16
    assert r.usage.prompt_tokens == len(prompt_ids(PROMPT))  # the prompt counts once, not once per choice
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert texts[0] != texts[1], "two seeded samples at temperature 1 came out identical"
    # Streamed with the same seed: the same two texts, each index ending once.
    chunks = list(complete(client, n=2, temperature=1.0, seed=7, max_tokens=8, stream=True))
    streamed = {0: "", 1: ""}
    ends = []
    for c in chunks:
        for ch in c.choices:
            streamed[ch.index] += ch.text
            if ch.finish_reason:
                ends.append(ch.index)
    assert sorted(ends) == [0, 1]
    assert [streamed[0], streamed[1]] == texts


def test_n2_chat(client):
    r = chat(client, n=2, temperature=1.0, seed=8, max_tokens=8)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 16
    assert all(c.message.role == "assistant" for c in r.choices)
    assert r.choices[0].message.content != r.choices[1].message.content
    # Streamed: every choice's role chunk first, as vLLM sends them, then the contents.
    chunks = list(chat(client, n=2, temperature=1.0, seed=8, max_tokens=8, stream=True))
    firsts = [(c.choices[0].index, c.choices[0].delta.role) for c in chunks[:2]]
    assert firsts == [(0, "assistant"), (1, "assistant")]
    assert not any(c.choices[0].delta.role for c in chunks[2:])


def _stop_candidate(text: str, length: int) -> str:
    """A ``length``-character ASCII piece of ``text`` (no replacement characters) whose first
    occurrence is not at the start, so stopping on it leaves a non-empty prefix. Longer pieces
    usually span a token boundary, so a streamed response must hold back a partial match."""
    for i in range(len(text) // 3, len(text) - length + 1):
        piece = text[i:i + length]
        if piece.isascii() and piece.isprintable() and piece.strip() and text.index(piece) > 0:
            return piece
    pytest.fail(f"no usable {length}-character stop string in {text!r}")


@pytest.mark.parametrize("length", [1, 3])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_stop_string(client, endpoint, length):
    call = complete if endpoint == "completions" else chat

    def text_of(r):
        c = r.choices[0]
        return c.text if endpoint == "completions" else c.message.content

    full = text_of(call(client, max_tokens=32))
    stop = _stop_candidate(full, length)
    expected = full[:full.index(stop)]
    r = call(client, max_tokens=32, stop=[stop, "never-appears-xyz"])
    assert text_of(r) == expected
    assert r.choices[0].finish_reason == "stop"
    # The streamed deltas stop at the same place, never showing a piece of the stop string.
    chunks = list(call(client, max_tokens=32, stop=stop, stream=True))
    if endpoint == "completions":
        streamed = "".join(ch.text for c in chunks for ch in c.choices)
    else:
        streamed = "".join(ch.delta.content or "" for c in chunks for ch in c.choices)
    assert streamed == expected


def test_completion_logprobs(client):
    r = complete(client, max_tokens=8, logprobs=3)
    lp = r.choices[0].logprobs
    assert lp is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert all(isinstance(t, str) for t in lp.tokens)
    assert all(x <= 0.0 for x in lp.token_logprobs)
    assert lp.text_offset == sorted(lp.text_offset)
    for token, sampled, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        # The top 3 plus the sampled token, keyed by text: byte tokens that are not UTF-8 on their
        # own all read "\ufffd" and share one key (the format's limit), hence <= rather than ==.
        assert 1 <= len(top) <= 4, top
        assert token in top and all(v <= 0.0 for v in top.values()), (token, top)
        if "\ufffd" not in "".join(top):
            assert len(top) >= 3, top
        # Greedy: no alternative is more likely than the sampled token.
        assert sampled >= max(top.values()) - 1e-4, (sampled, top)
    assert complete(client, max_tokens=3).choices[0].logprobs is None


def test_streamed_logprobs_equal_non_streamed(client):
    whole = complete(client, max_tokens=8, logprobs=2).choices[0].logprobs
    chunks = list(complete(client, max_tokens=8, logprobs=2, stream=True))
    tokens = [t for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.tokens]
    values = [v for c in chunks for ch in c.choices if ch.logprobs for v in ch.logprobs.token_logprobs]
    assert tokens == whole.tokens
    assert values == pytest.approx(whole.token_logprobs, abs=1e-5)
    whole_chat = chat(client, max_tokens=8, logprobs=True, top_logprobs=2).choices[0].logprobs.content
    chunks = list(chat(client, max_tokens=8, logprobs=True, top_logprobs=2, stream=True))
    streamed = [e for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in whole_chat]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in whole_chat], abs=1e-5)
    assert all(len(e.top_logprobs) == 2 for e in streamed)


def test_chat_logprobs_and_top_logprobs(client):
    r = chat(client, max_tokens=8, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 8
    for entry in content:
        assert isinstance(entry.token, str) and entry.logprob <= 0.0
        assert len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert entry.logprob == pytest.approx(tops[0], abs=1e-4)  # greedy: the top token was sampled
    # The engine's --max-logprobs caps top_logprobs, logprobs and prompt_logprobs (not a fixed 20).
    wide = chat(client, max_tokens=2, logprobs=True, top_logprobs=MAX_LOGPROBS).choices[0].logprobs.content
    assert [len(e.top_logprobs) for e in wide] == [MAX_LOGPROBS] * 2
    # (completions' top_logprobs is keyed by token text, and texts can repeat: at most 25 keys)
    assert 20 < len(complete(client, max_tokens=2, logprobs=25).choices[0].logprobs.top_logprobs[0]) <= 25
    with pytest.raises(openai.BadRequestError, match=r"top_logprobs must be an integer in \[0, 30\]"):
        chat(client, max_tokens=2, logprobs=True, top_logprobs=MAX_LOGPROBS + 1)
    only_sampled = chat(client, max_tokens=4, logprobs=True, top_logprobs=0).choices[0].logprobs.content
    assert len(only_sampled) == 4 and all(e.top_logprobs == [] for e in only_sampled)
    assert chat(client, max_tokens=3).choices[0].logprobs is None


def test_seed_reproducible(client):
    def sample(seed: int) -> str:
        return complete(client, temperature=1.0, seed=seed, max_tokens=12).choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first
    # Still the same when it shares its batch with other, unseeded requests.
    with ThreadPoolExecutor(4) as pool:
        others = [pool.submit(complete, client, temperature=1.0, max_tokens=12) for _ in range(3)]
        again = pool.submit(sample, 1234)
        for f in others:
            f.result()
        assert again.result() == first


# ------------------------------------------------------------------------------------------------
# models, tokenize / detokenize, metrics, logs
# ------------------------------------------------------------------------------------------------

def test_models(client, model_dir):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].object == "model"
    assert models[0].root == str(model_dir)  # vLLM's: the model as given, whatever it is served as
    (perm,) = models[0].permission  # vLLM's card lists its permission entry
    assert perm["object"] == "model_permission" and perm["allow_sampling"] and perm["id"].startswith("modelperm-")


def test_models_retrieve_as_openai(client, http):
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model" and card == client.models.list().data[0]
    for unknown in ("other", "org/other", f"{MODEL}/"):
        r = http.get(f"/v1/models/{unknown}")
        assert r.status_code == 404, (unknown, r.text)
        assert r.json()["error"]["param"] == "model" and repr(unknown) in r.json()["error"]["message"]
    listed = http.get("/v1/models/")  # a trailing slash: the list (vLLM's redirects to it)
    assert listed.status_code == 200 and listed.json() == http.get("/v1/models").json()


def test_completion_max_tokens_null_fills_the_context_as_vllm(client, http):
    """vLLM's 16 is the default of a field left out; an explicit null means no limit but the context."""
    body = {"model": MODEL, "prompt": PROMPT, "ignore_eos": True}
    left_out = http.post("/v1/completions", json=body).json()
    assert left_out["usage"]["completion_tokens"] == 16
    null = http.post("/v1/completions", json={**body, "max_tokens": None}).json()
    assert null["usage"]["completion_tokens"] == MAX_MODEL_LEN - null["usage"]["prompt_tokens"]
    assert null["choices"][0]["finish_reason"] == "length"


def test_invocations_serves_a_chat_or_a_completion_body_as_vllm(http):
    """vLLM's (SageMaker's) /invocations: a body with messages is a chat request, one with a
    prompt a completion request; the answers equal those of the OpenAI routes."""
    for path, body in (("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 6,
                                                 "temperature": 0}),
                       ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0})):
        direct, via = http.post(path, json=body), http.post("/invocations", json=body)
        assert via.status_code == 200, via.text
        assert via.json()["object"] == direct.json()["object"]
        assert via.json()["choices"] == direct.json()["choices"]
    neither = http.post("/invocations", json={"model": MODEL, "max_tokens": 3})
    assert neither.status_code == 400 and "messages" in neither.json()["error"]["message"]
    not_an_object = http.post("/invocations", json=[1, 2])
    assert not_an_object.status_code == 400, not_an_object.text


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_ping_is_the_health_check(http, method):
    assert http.request(method, "/ping").status_code == 200


@pytest.mark.parametrize("text", [PROMPT, UNI_PROMPT, "two\nlines\tand  spaces", "x"])
def test_tokenize_detokenize_round_trip(http, text):
    r = http.post("/tokenize", json={"model": MODEL, "prompt": text})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == prompt_ids(text)
    assert body["count"] == len(body["tokens"])
    assert body["max_model_len"] == MAX_MODEL_LEN and body["token_strs"] is None
    strs = http.post("/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True}).json()["token_strs"]
    assert strs == tiny_tokenizer().convert_ids_to_tokens(body["tokens"])
    d = http.post("/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
    assert d.status_code == 200, d.text
    assert d.json()["prompt"] == text


def test_tokenize_messages_uses_chat_template(http):
    r = http.post("/tokenize", json={"model": MODEL, "messages": MESSAGES})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == chat_ids(MESSAGES)
    assert r.json()["count"] == len(chat_ids(MESSAGES))


def test_documents_reasoning_effort_and_replayed_reasoning_reach_the_template(http):
    """vLLM's build_chat_params and message parsing: ``documents``, ``reasoning_effort`` (with
    ``enable_thinking``, off for "none"; the caller's kwargs win) and an assistant message's
    ``reasoning`` (``reasoning_content`` another name for it, both given) reach the template, in
    chat completions and /tokenize alike."""
    from ferrokv.llm import chat_token_ids

    template = ("{% for d in documents or [] %}DOC {{ d.title }}: {{ d.text }}\n{% endfor %}"
                "{% if reasoning_effort is defined %}EFFORT {{ reasoning_effort }} THINK {{ enable_thinking }}\n"
                "{% endif %}{% for m in messages %}{{ m.role }}: {{ m.reasoning_content or '' }}"
                "|{{ m.reasoning or '' }}|{{ m.content }}\n{% endfor %}")
    conv = MESSAGES + [{"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Why?"}]
    docs = [{"title": "Sky", "text": "Rayleigh scattering."}]
    thought = "Short wavelengths scatter more."
    cases = [  # (request fields, messages, what the template must be given)
        (dict(documents=docs), conv, dict(documents=docs)),
        # chat_template_kwargs' values reach the template as they are (vLLM's), documents too.
        (dict(chat_template_kwargs={"documents": [{"title": 7, "text": "x"}]}), conv,
         dict(chat_template_kwargs={"documents": [{"title": 7, "text": "x"}]})),
        (dict(reasoning_effort="low"), conv,
         dict(chat_template_kwargs={"reasoning_effort": "low", "enable_thinking": True})),
        (dict(reasoning_effort="none"), conv,
         dict(chat_template_kwargs={"reasoning_effort": "none", "enable_thinking": False})),
        (dict(reasoning_effort="high", chat_template_kwargs={"enable_thinking": False}), conv,
         dict(chat_template_kwargs={"reasoning_effort": "high", "enable_thinking": False})),
    ]
    for key in ("reasoning", "reasoning_content"):
        replayed = [*conv[:2], {**conv[2], key: thought}, conv[3]]
        cases.append(({}, replayed, dict(messages=[*conv[:2], {**conv[2], "reasoning": thought,
                                                                "reasoning_content": thought}, conv[3]])))
    plain = chat_token_ids(tiny_tokenizer(), conv, True, chat_template=template)
    for body, messages, given in cases:
        want = chat_token_ids(tiny_tokenizer(), given.pop("messages", messages), True, chat_template=template,
                              **given)
        assert want != plain, body
        tok = http.post("/tokenize", json={"model": MODEL, "messages": messages, "chat_template": template, **body})
        assert tok.status_code == 200 and tok.json()["tokens"] == want, (body, tok.text)
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 1,
                                                    "chat_template": template, **body})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(want), (body, r.text)


def test_chat_template_fields_shape_the_prompt_as_in_vllm(http):
    """chat_template, continue_final_message and chat_template_kwargs reach the template, in chat
    completions and /tokenize alike (the prompt's size is in usage)."""
    from ferrokv.llm import chat_token_ids

    conv = MESSAGES + [{"role": "assistant", "content": "The sky is"}]
    template = "{% if hi %}{{ hi }} {% endif %}{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    cases = [
        (dict(add_generation_prompt=False, continue_final_message=True), dict(add_generation_prompt=False,
                                                                            continue_final_message=True)),
        (dict(chat_template=template), dict(chat_template=template)),
        (dict(chat_template=template, chat_template_kwargs={"hi": "Hello."}),
         dict(chat_template=template, chat_template_kwargs={"hi": "Hello."})),
    ]
    for body, kw in cases:
        add = kw.pop("add_generation_prompt", True)
        want = chat_token_ids(tiny_tokenizer(), conv, add, **kw)
        tok = http.post("/tokenize", json={"model": MODEL, "messages": conv, **body})
        assert tok.status_code == 200 and tok.json()["tokens"] == want, (body, tok.text)
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": conv, "max_tokens": 1, **body})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(want), (body, r.text)
    assert want != chat_token_ids(tiny_tokenizer(), conv, True, chat_template=template)
    # A trusted template's code failing on the request is a 400 naming it, never a 500.
    for bad in ("{{ 1/0 }}", "{{ messages[0].content + 1 }}", "{% for i in range(1000000) %}{% endfor %}"):
        for path in ("/tokenize", "/v1/chat/completions"):
            r = http.post(path, json={"model": MODEL, "messages": conv, "max_tokens": 1, "chat_template": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", (path, bad, r.text)
    for body, field in [({"continue_final_message": True}, "continue_final_message"),
                        ({"chat_template_kwargs": 5}, "chat_template_kwargs"),
                        ({"add_special_tokens": [1]}, "add_special_tokens")]:
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": conv, "max_tokens": 1, **body})
        assert r.status_code == 400 and field in r.json()["error"]["message"], (body, r.text)


def test_created_is_when_each_completion_was_made(http, client):
    import time

    started = http.get("/v1/models").json()["data"][0]["created"]  # the server's start
    time.sleep(1.1)
    t0 = int(time.time())
    assert complete(client, max_tokens=1).created >= t0 > started
    assert chat(client, max_tokens=1).created >= t0
    chunks = list(complete(client, max_tokens=2, stream=True))
    assert chunks and all(c.created >= t0 for c in chunks)


class _StatsEngine:
    max_model_len = MAX_MODEL_LEN

    def stats(self):
        return collections.defaultdict(int, step_tokens_le_inf=0)  # the engine gauges read at scrape time


def _output(finished, choices, tokens=1, stats=None):
    """A RequestOutput of choices ``(index, finish_reason)``, each with ``tokens`` new tokens."""
    from ferrokv.outputs import CompletionOutput, RequestOutput

    comps = [CompletionOutput(i, "x", [5] * tokens, finish_reason=r) for i, r in choices]
    return RequestOutput("r", None, [1], None, comps, finished, metrics=stats)


def _sample(m, name, **labels):
    return m.registry.get_sample_value(name, {"model_name": "m", **labels})


def test_the_success_counter_counts_each_choice_once_streamed_or_not():
    """A DELTA choice that ended early is not in the request's last output; it counts anyway.
    Every finish reason's series is there from the start (vLLM's), so rate() sees the first."""
    from ferrokv.entrypoints.openai.metrics import RequestTimer, ServerMetrics

    m = ServerMetrics(_StatsEngine(), "m", lambda: 0)
    for reason in ("stop", "length", "abort", "error"):
        assert _sample(m, "ferrokv:request_success_total", finished_reason=reason) == 0, reason
    delta = RequestTimer()
    m.on_output(_output(False, [(0, "stop"), (1, None)]), delta)  # choice 0 ends first ...
    m.on_output(_output(True, [(1, "length")]), delta)  # ... and is not in the last DELTA output
    m.on_output(_output(True, [(0, "stop"), (1, "length")]), RequestTimer())
    for reason in ("stop", "length"):
        assert _sample(m, "ferrokv:request_success_total", finished_reason=reason) == 2, reason


def test_latencies_count_each_choice_as_vllms_child_requests():
    """vLLM runs each of n samples as a request: TTFT, queue and e2e once per choice, inter-token
    latency once per decode step of each choice, one final output or a DELTA stream alike."""
    from ferrokv.entrypoints.openai.metrics import RequestTimer, ServerMetrics
    from ferrokv.outputs import RequestStateStats

    stats = RequestStateStats(40, 0.0, queued_ts=1.0, scheduled_ts=1.0, first_token_ts=1.0, last_token_ts=1.9,
                              finished_ts=1.9)
    length4 = [(i, "length") for i in range(4)]

    def itl(m):
        return tuple(_sample(m, f"ferrokv:inter_token_latency_seconds_{part}") for part in ("count", "sum"))

    final = ServerMetrics(_StatsEngine(), "m", lambda: 0)
    final.on_output(_output(True, length4, 10, stats), RequestTimer())  # 4 samples of 10 tokens: 9 steps each
    assert itl(final) == (36, pytest.approx(3.6))
    streamed, timer = ServerMetrics(_StatsEngine(), "m", lambda: 0), RequestTimer()
    for k in (1, 3, 2, 3):  # DELTA outputs, some bundling several steps
        streamed.on_output(_output(False, [(i, None) for i in range(4)], k, stats), timer)
    streamed.on_output(_output(True, length4, 1, stats), timer)
    assert itl(streamed) == (36, pytest.approx(3.6))
    assert _sample(final, "ferrokv:inter_token_latency_seconds_bucket", le="0.1") == 36
    assert _sample(final, "ferrokv:inter_token_latency_seconds_bucket", le="0.075") == 0
    for m in (final, streamed):
        for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
            assert _sample(m, f"ferrokv:{name}_count") == 4, name
        assert _sample(m, "ferrokv:request_success_total", finished_reason="length") == 4
    # Every engine series carries the model's name too, as vLLM's.
    assert _sample(final, "ferrokv:num_requests_running") == 0
    assert _sample(final, "ferrokv:generation_tokens_total") == 0


def test_ttft_is_observed_with_the_first_token_and_steps_of_a_request_cut_short_count():
    """A stream's TTFT counts at its first chunk, not when the request ends; a client that leaves
    mid-stream still leaves its decode steps so far (vLLM observes both as they happen)."""
    from ferrokv.entrypoints.openai.metrics import RequestTimer, ServerMetrics
    from ferrokv.outputs import RequestStateStats

    m, timer = ServerMetrics(_StatsEngine(), "m", lambda: 0), RequestTimer()
    queued = RequestStateStats(0, 0.0, queued_ts=1.0)
    m.on_output(_output(False, [], 0, queued), timer)  # nothing yet (a prompt-logprobs output, say)
    assert _sample(m, "ferrokv:time_to_first_token_seconds_count") == 0
    first = RequestStateStats(1, 0.0, queued_ts=1.0, scheduled_ts=1.1, first_token_ts=1.25, last_token_ts=1.25)
    m.on_output(_output(False, [(0, None)], 1, first), timer)
    assert _sample(m, "ferrokv:time_to_first_token_seconds_count") == 1
    assert _sample(m, "ferrokv:time_to_first_token_seconds_sum") == pytest.approx(0.25)
    later = RequestStateStats(5, 0.0, queued_ts=1.0, scheduled_ts=1.1, first_token_ts=1.25, last_token_ts=1.65)
    m.on_output(_output(False, [(0, None)], 4, later), timer)
    assert _sample(m, "ferrokv:time_to_first_token_seconds_count") == 1  # once
    m.on_close(timer)  # the client left: 4 steps after the first token, 0.1 s apart
    m.on_close(timer)  # idempotent
    assert _sample(m, "ferrokv:inter_token_latency_seconds_count") == 4
    assert _sample(m, "ferrokv:inter_token_latency_seconds_sum") == pytest.approx(0.4)
    assert _sample(m, "ferrokv:e2e_request_latency_seconds_count") == 0  # it never ended
    assert sum(_sample(m, "ferrokv:request_success_total", finished_reason=r) for r in ("stop", "length")) == 0


def _aborted_choices(base_url: str) -> float:
    import re

    text = httpx.get(base_url + "/metrics", timeout=30).text
    found = re.search(r'^ferrokv:request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_whose_client_leaves_counts_its_choices_as_aborted_streamed_or_not(server, stream):
    """A client that times out before the response's first byte (a non-streamed request) leaves
    its n choices in request_success_total as "abort", as a streamed one does: the engine had
    taken the request, although no output of it reached the server yet."""
    import time

    before = _aborted_choices(server.url)
    body = {"model": MODEL, "prompt": PROMPT, "n": 2, "max_tokens": 480, "ignore_eos": True, "temperature": 1.0,
            "stream": stream}
    left = False
    try:  # streamed: the client leaves after the first line; not streamed: it times out waiting
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30 if stream else 0.2,
                          headers={"Authorization": f"Bearer {API_KEY}"}) as r:
            for _ in r.iter_lines():
                left = stream
                break
    except httpx.ReadTimeout:
        left = not stream
    assert left
    deadline = time.monotonic() + 30
    while _aborted_choices(server.url) < before + 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _aborted_choices(server.url) == before + 2


def test_metrics_leave_prometheus_client_settings_alone():
    """The server's registry drops no other registry's _created series (it once switched them off
    for the whole process)."""
    from prometheus_client import CollectorRegistry, Counter

    import ferrokv.entrypoints.openai.api_server  # noqa: F401  (imported: nothing may change)
    from ferrokv.entrypoints.openai.metrics import ServerMetrics

    ServerMetrics(_StatsEngine(), "m", lambda: 0)
    other = CollectorRegistry()
    Counter("app_things", "things", registry=other).inc()
    assert other.get_sample_value("app_things_created") is not None
    assert b"_created" not in ServerMetrics(_StatsEngine(), "m", lambda: 0).render()[0]


def test_metrics_names(server, client):
    complete(client, max_tokens=4)
    resp = httpx.get(server.url + "/metrics", timeout=60.0)  # open: no key
    assert resp.status_code == 200
    values = metric_values(resp.text)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_free_blocks",
                 "num_blocks", "prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total",
                 "prompt_tokens_total", "generation_tokens_total"):
        assert "ferrokv:" + name in values, name
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prompt_tokens", "request_generation_tokens",
                 "request_max_num_generation_tokens", "request_params_n", "request_params_max_tokens",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_time_per_output_token_seconds", "iteration_tokens_total"):
        assert values.get(f"ferrokv:{name}_count", 0) > 0, name
    assert values["ferrokv:prompt_tokens_total"] > 0 and values["ferrokv:generation_tokens_total"] >= 4
    assert 0 < values["ferrokv:num_free_blocks"] <= values["ferrokv:num_blocks"]
    info = [line for line in resp.text.splitlines() if line.startswith("ferrokv:cache_config_info{")]
    assert len(info) == 1 and info[0].endswith(" 1.0"), info
    # num_gpu_blocks counts the reserved null block, as vLLM's; ferrokv:num_blocks does not.
    assert 'block_size="16"' in info[0] and f'num_gpu_blocks="{int(values["ferrokv:num_blocks"]) + 1}"' in info[0]
    assert 0.0 <= values["ferrokv:kv_cache_usage_perc"] <= 1.0
    # OpenMetrics to a scraper that asks for it (Prometheus does), text format otherwise.
    # Prometheus 2.x's own Accept header: the samples keep the families' names (ferrokv:...).
    accept = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
              "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
    om = httpx.get(server.url + "/metrics", headers={"accept": accept}, timeout=60.0)
    assert om.headers["content-type"].startswith("application/openmetrics-text") and om.text.endswith("# EOF\n")
    assert "ferrokv:generation_tokens_total{" in om.text and "ferrokv_" not in om.text, om.text[:2000]
    assert resp.headers["content-type"].startswith("text/plain")


def test_prompts_not_logged(server, client):
    marker = "zebra quokka marmalade"
    complete(client, prompt=f"The {marker} runs", max_tokens=2)
    chat(client, messages=[{"role": "user", "content": f"a {marker}"}], max_tokens=2)
    assert marker not in server.stderr()


# ------------------------------------------------------------------------------------------------
# prefix caching: cached_tokens and cache_salt
# ------------------------------------------------------------------------------------------------

_unique = itertools.count()


def _long_prompt() -> str:
    return f"Request number {next(_unique)} of this module. {LONG_TEXT}"


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_cached_tokens_on_repeated_long_prompt(server, client, endpoint):
    text = _long_prompt()
    if endpoint == "completions":
        call = lambda: complete(client, prompt=text, max_tokens=2)  # noqa: E731
    else:
        call = lambda: chat(client, messages=[{"role": "user", "content": text}], max_tokens=2)  # noqa: E731
    first = call()
    assert first.usage.prompt_tokens > 64
    assert cached_tokens(first.usage) == 0
    hits_before = read_metrics(server.url)["ferrokv:prefix_cache_hits_total"]
    second = call()
    assert 0 < cached_tokens(second.usage) < second.usage.prompt_tokens
    # /metrics counts the same hits.
    hits = read_metrics(server.url)["ferrokv:prefix_cache_hits_total"] - hits_before
    assert hits == cached_tokens(second.usage)


def test_cached_tokens_in_stream_usage(client):
    text = _long_prompt()
    complete(client, prompt=text, max_tokens=2)
    *_, last = complete(client, prompt=text, max_tokens=2, stream=True, stream_options={"include_usage": True})
    assert cached_tokens(last.usage) > 0


def test_cache_salt_isolates_tenants(client):
    text = _long_prompt()

    def cached(salt: str | None) -> int:
        extra = {"ignore_eos": True} if salt is None else {"ignore_eos": True, "cache_salt": salt}
        return cached_tokens(complete(client, prompt=text, max_tokens=2, extra_body=extra).usage)

    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 0  # the same tenant hits its own cache
    assert cached("tenant-b") == 0  # another tenant does not see it
    assert cached(None) == 0  # nor does an unsalted request
    assert cached(None) > 0
    assert cached("tenant-b") > 0


def test_response_role_default_template_kwargs_and_max_log_len_as_vllms_flags(tiny_model_dir):
    """``--response-role`` names the answers' role (a chat that continues its last message keeps
    that message's role, as vLLM); ``--default-chat-template-kwargs`` reach every template under
    the request's own; ``--max-log-len`` cuts a logged prompt."""
    import asyncio
    import logging

    from ferrokv import AsyncLLM
    from ferrokv.entrypoints.openai.api_server import ServerConfig, build_app

    llm = AsyncLLM(str(tiny_model_dir("llama", "llama")), device="cpu", dtype="float32", max_model_len=128,
                   num_kv_blocks=64)
    config = ServerConfig(served_model_name=MODEL, response_role="bot", log_prompts=True, max_log_len=12,
                          chat_template="{% for m in messages %}{{ m.content }}{% endfor %}{{ flavour }}",
                          default_chat_template_kwargs={"flavour": " salty"})
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "A dog runs in the park."}], "max_tokens": 2,
            "temperature": 0}

    async def ask():
        transport = httpx.ASGITransport(app=build_app(llm, config))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as c:
            answer = (await c.post("/v1/chat/completions", json=chat)).json()
            streamed = (await c.post("/v1/chat/completions", json={**chat, "stream": True})).text
            continued = (await c.post("/v1/chat/completions", json={**chat, "add_generation_prompt": False})).json()
            kwargs = {"chat_template_kwargs": {"add_generation_prompt": False}}  # vLLM's: they override the flag
            continued_too = (await c.post("/v1/chat/completions", json={**chat, **kwargs})).json()
            tokenized = [(await c.post("/tokenize", json={"model": MODEL, "messages": chat["messages"], **extra})).json()
                         for extra in ({}, {"chat_template_kwargs": {"flavour": " sweet"}})]
        return answer, streamed, continued, continued_too, tokenized

    logged: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    serve_log = logging.getLogger("ferrokv.serve")  # the package's loggers do not propagate
    serve_log.addHandler(handler)
    try:
        answer, streamed, continued, continued_too, tokenized = asyncio.run(ask())
    finally:
        serve_log.removeHandler(handler)
        llm.shutdown()
    assert answer["choices"][0]["message"]["role"] == "bot"
    first = json.loads(next(e for e in streamed.split("\n") if e.startswith("data: {"))[len("data: "):])
    assert first["choices"][0]["delta"]["role"] == "bot"
    assert continued["choices"][0]["message"]["role"] == continued_too["choices"][0]["message"]["role"] == "user"
    assert [t["tokens"] for t in tokenized] == [prompt_ids("A dog runs in the park. salty"),
                                                prompt_ids("A dog runs in the park. sweet")]
    logged = [m for m in logged if ": messages " in m]
    # Each text is cut, not the messages' repr: 12 characters of the content itself are kept.
    assert len(logged) == 4 and all("'A dog runs i... (23 characters)'" in m and "park" not in m
                                    for m in logged), logged


def test_enable_log_outputs_logs_each_choice_once_it_finishes(tiny_model_dir):
    """vLLM's --enable-log-outputs: each choice's whole text (a stream's deltas gathered), cut to
    --max-log-len, and its finish reason; off, nothing."""
    import asyncio
    import logging

    from ferrokv import AsyncLLM
    from ferrokv.entrypoints.openai.api_server import ServerConfig, build_app

    llm = AsyncLLM(str(tiny_model_dir("llama", "llama")), device="cpu", dtype="float32", max_model_len=128,
                   num_kv_blocks=64)
    body = {"model": MODEL, "prompt": "A dog runs", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "n": 2}

    async def ask(config):
        transport = httpx.ASGITransport(app=build_app(llm, config))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as c:
            whole = (await c.post("/v1/completions", json=body)).json()
            await c.post("/v1/completions", json={**body, "stream": True})
        return [ch["text"] for ch in sorted(whole["choices"], key=lambda ch: ch["index"])]

    logged: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    serve_log = logging.getLogger("ferrokv.serve")
    serve_log.addHandler(handler)
    try:
        texts = asyncio.run(ask(ServerConfig(served_model_name=MODEL, log_outputs=True)))
        outputs = [m for m in logged if ": output " in m]
        asyncio.run(ask(ServerConfig(served_model_name=MODEL, log_outputs=True, max_log_len=3)))
        cut = [m for m in logged if ": output " in m][len(outputs):]
        logged.clear()
        asyncio.run(ask(ServerConfig(served_model_name=MODEL)))
    finally:
        serve_log.removeHandler(handler)
        llm.shutdown()
    assert len(outputs) == 4  # two choices, streamed and not
    for i, text in enumerate(texts):
        assert sum(f": output {i}: {text!r}, finish_reason: length" in m for m in outputs) == 2, (text, outputs)
    assert len(cut) == 4 and all(f"... ({len(texts[0])} characters)" in m or f"({len(texts[1])} characters)" in m
                                 for m in cut), cut
    assert not [m for m in logged if ": output " in m]


def test_a_completion_of_several_prompts_streams_each_as_it_comes_and_refuses_before_any_byte(tiny_model_dir):
    """The response starts once the engine took every prompt, not once each has a token: with one
    running slot, prompt 0 streams to its end before prompt 1 starts (vLLM's merge). A prompt the
    engine refuses (more KV blocks than the cache has) is still a 400 naming it, before any byte."""
    import asyncio
    import time

    from ferrokv import AsyncLLM
    from ferrokv.entrypoints.openai.api_server import ServerConfig, build_app

    llm = AsyncLLM(str(tiny_model_dir("llama", "llama")), device="cpu", dtype="float32", max_model_len=128,
                   block_size=4, num_kv_blocks=24, max_num_seqs=1)
    body = {"model": MODEL, "prompt": [[5, 6, 7], [8, 9]], "max_tokens": 5, "ignore_eos": True, "temperature": 0,
            "stream": True}

    app = build_app(llm, ServerConfig(served_model_name=MODEL))

    async def ask():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as c:
            streamed = (await c.post("/v1/completions", json=body)).text
            refused = await c.post("/v1/completions", json={**body, "prompt": [[5, 6, 7], [5] * 100]})
        return streamed, refused

    try:
        streamed, refused = asyncio.run(ask())
        for _ in range(500):  # the refused call's other prompt is aborted (by the engine's loop)
            if not llm.engine.has_unfinished_requests():
                break
            time.sleep(0.01)
        assert llm.engine.num_free_blocks == 23
    finally:
        llm.shutdown()
    chunks = [json.loads(e[len("data: "):]) for e in streamed.split("\n") if e.startswith("data: {")]
    order = [(c["choices"][0]["index"], c["choices"][0]["finish_reason"]) for c in chunks]
    indexes = [i for i, _ in order]  # (a token that completes no character sends no chunk)
    assert indexes == sorted(indexes) and set(indexes) == {0, 1}, order
    assert order[indexes.count(0) - 1] == (0, "length") and order[-1] == (1, "length"), order
    assert_openai_error(refused, 400, "prompt[1]")
    assert not refused.text.startswith("data:")
    # The refused call's prompt 0 was aborted by the server, not left by its client: no "abort".
    registry = app.state.ferrokv.metrics.registry
    assert registry.get_sample_value("ferrokv:request_success_total",
                                     {"model_name": MODEL, "finished_reason": "abort"}) == 0


def test_a_generation_closed_and_cancelled_meanwhile_still_aborts_every_request(tiny_model_dir):
    """``Generation.close`` stops the first fetches still pending, then closes every generator;
    cancelled while it waits for the first part (a server cancelling its response), it still
    does the second: no request is left running for a client that is gone."""
    import asyncio
    import time

    from ferrokv import AsyncLLM, SamplingParams
    from ferrokv.entrypoints.openai.api_server import ServerConfig, build_app
    from ferrokv.entrypoints.openai.serving import Acceptance, Generation, generate_checked

    llm = AsyncLLM(str(tiny_model_dir("llama", "llama")), device="cpu", dtype="float32", max_model_len=128,
                   block_size=4, num_kv_blocks=64, max_num_seqs=1)
    state = build_app(llm, ServerConfig(served_model_name=MODEL)).state.ferrokv
    params = SamplingParams(max_tokens=100, ignore_eos=True, temperature=0)

    async def main():
        state.admit(2, 1)
        accepted = Acceptance(2)
        gens = [generate_checked(llm, {"prompt_token_ids": [5 + i, 6, 7]}, params, f"g{i}", f"prompt[{i}]",
                                 asked_max_tokens=100, on_accepted=accepted.of(i)) for i in range(2)]
        gen = Generation(gens, state, params, accepted)
        await gen.start()  # prompt 0 runs (its first output fetched), prompt 1 waits for the one slot
        while not gen.first[0]:
            await asyncio.sleep(0.001)
        closing = asyncio.ensure_future(gen.close())
        await asyncio.sleep(0)  # close is waiting for the pending first fetch to stop
        closing.cancel()
        await asyncio.gather(closing, return_exceptions=True)
        deadline = time.monotonic() + 30  # in this event loop: its end would close the generators itself
        while llm.engine.has_unfinished_requests() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return llm.stats()["requests_aborted"]

    try:
        aborted = llm.stats()["requests_aborted"]
        assert asyncio.run(main()) - aborted == 2 and state.admitted == 0
    finally:
        llm.shutdown()


@pytest.mark.parametrize("prompts", [[[5, 6, 7]], [[5, 6, 7], [8, 9]]])
def test_a_call_a_failed_step_ended_after_its_first_outputs_counts_no_client_abort(tiny_model_dir, prompts):
    """The third forward pass fails: the streamed call ends with an error after its first tokens.
    Its requests were ended by that error, not left by the client: no "abort" (review22: once an
    output had come, and always with one prompt, they were counted as the client's aborts)."""
    import asyncio

    from ferrokv import AsyncLLM
    from ferrokv.entrypoints.openai.api_server import ServerConfig, build_app
    from helpers.engine_faults import RunnerHook, raise_on

    llm = AsyncLLM(str(tiny_model_dir("llama", "llama")), device="cpu", dtype="float32", max_model_len=128,
                   block_size=4, num_kv_blocks=64)
    app = build_app(llm, ServerConfig(served_model_name=MODEL))
    RunnerHook(llm.engine, raise_on(3, RuntimeError("boom")))
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 8, "ignore_eos": True, "temperature": 0, "stream": True}

    async def ask():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as c:
            return (await c.post("/v1/completions", json=body)).text

    try:
        text = asyncio.run(ask())
        assert text.count('"text"') >= 1 and "InternalServerError" in text, text  # tokens came, then the error
        registry = app.state.ferrokv.metrics.registry
        assert registry.get_sample_value("ferrokv:request_success_total",
                                         {"model_name": MODEL, "finished_reason": "abort"}) == 0
    finally:
        llm.shutdown()


def test_a_first_output_that_failed_after_start_returned_is_the_calls_error():
    """With several prompts, ``start`` returns once the engine took them all; a request that then
    fails before its first output is the call's error, raised by ``outputs`` (review22: an
    AssertionError, an "internal error" to the client, and its others counted as aborts)."""
    import asyncio
    import types

    from ferrokv import SamplingParams
    from ferrokv.entrypoints.openai.server_config import ServerConfig
    from ferrokv.entrypoints.openai.serving import Acceptance, Generation

    closed: list[bool] = []
    state = types.SimpleNamespace(admitted=2, config=ServerConfig(), metrics=types.SimpleNamespace(
        on_output=lambda out, timer: None, on_close=lambda timer, failed=False: closed.append(failed)))
    params = SamplingParams(n=1, max_tokens=4)

    async def ends_at_once():
        yield types.SimpleNamespace(finished=True)

    async def fails_after_acceptance():
        await asyncio.sleep(0.001)
        raise RuntimeError("request 'r1' was ended by a failed engine step")
        yield

    async def main():
        accepted = Acceptance(2)
        accepted.of(0)()
        accepted.of(1)()
        gen = Generation([ends_at_once(), fails_after_acceptance()], state, params, accepted)
        await gen.start()
        await asyncio.sleep(0.01)  # the failure lands before the response reads the outputs
        try:
            with pytest.raises(RuntimeError, match="failed engine step"):
                await gen.finals()
        finally:
            await gen.close()
        return gen.failed

    assert asyncio.run(main()) is True and state.admitted == 0


def test_logged_prompts_are_cut_each_not_their_repr():
    from ferrokv.entrypoints.openai.serving import _cut

    assert _cut(["abcdef", "ab", [1, 2, 3, 4, 5], [1, 2]], 3) == [
        "abc... (6 characters)", "ab", [1, 2, 3, "... (5 token ids)"], [1, 2]]
    assert _cut([{"role": "user", "content": [{"type": "text", "text": "hello"}]}], 4) == [
        {"role": "user", "content": [{"type": "text", "text": "hell... (5 characters)"}]}]
    # Many short messages: the whole line is bounded too.
    from ferrokv.entrypoints.openai.serving import ServerConfig, ServerState

    state = ServerState(llm=None, metrics=None, config=ServerConfig(max_log_len=10))  # type: ignore[arg-type]
    line = state.loggable([{"role": "user", "content": "hi"}] * 5000)
    assert len(line) < 200 and line.endswith("characters)"), line


def test_request_id_and_tokens_as_ids_as_vllm(http):
    """vLLM's request_id (an X-Request-Id header wins) is the response id's base, and
    return_tokens_as_token_ids names logprobs' tokens "token_id:N"."""
    chat_body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3, "temperature": 0}
    r = http.post("/v1/chat/completions", json={**chat_body, "request_id": "my-req-1"})
    assert r.json()["id"] == "chatcmpl-my-req-1"
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "request_id": "body"},
                  headers={"X-Request-Id": "hdr-7"})
    assert r.json()["id"] == "cmpl-hdr-7"
    # Clients may reuse an id (retries, a gateway's header): requests in flight at once are both
    # served, under the one response id (vLLM adds a suffix inside).
    with http.stream("POST", "/v1/chat/completions", json={**chat_body, "max_tokens": 50, "stream": True},
                     headers={"X-Request-Id": "same"}) as first:
        assert first.status_code == 200
        next(first.iter_lines())  # in flight
        second = http.post("/v1/chat/completions", json=chat_body, headers={"X-Request-Id": "same"})
        assert second.status_code == 200 and second.json()["id"] == "chatcmpl-same", second.text
    r = http.post("/v1/chat/completions", json={**chat_body, "logprobs": True, "top_logprobs": 2,
                                                "return_tokens_as_token_ids": True}).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    assert all(t["token"].startswith("token_id:") for c in content for t in [c, *c["top_logprobs"]])
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "logprobs": 2,
                                           "return_tokens_as_token_ids": True}).json()
    lp = r["choices"][0]["logprobs"]
    assert all(t.startswith("token_id:") for t in lp["tokens"])
    assert all(k.startswith("token_id:") for top in lp["top_logprobs"] for k in top)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_return_token_ids_as_vllm(http, endpoint):
    """vLLM's return_token_ids: the prompt's token ids (chat: at the top; completions: in each
    choice) and each choice's; streamed, the prompt's come once, first, and the choices' as deltas
    that add up to the whole."""
    if endpoint == "chat":
        path, body, prompt = "/v1/chat/completions", {"messages": MESSAGES}, chat_ids(MESSAGES)
    else:
        path, body, prompt = "/v1/completions", {"prompt": PROMPT}, prompt_ids(PROMPT)
    body = {**body, "model": MODEL, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    whole = http.post(path, json=body).json()
    (choice,) = whole["choices"]
    assert (whole if endpoint == "chat" else choice)["prompt_token_ids"] == prompt
    assert len(choice["token_ids"]) == whole["usage"]["completion_tokens"] == 6
    events = [json.loads(line[len("data: "):]) for line in http.post(path, json={**body, "stream": True}).text.split("\n")
              if line.startswith("data: {")]
    where = (lambda e: [e]) if endpoint == "chat" else (lambda e: e["choices"])
    prompts = [x["prompt_token_ids"] for e in events for x in where(e) if x.get("prompt_token_ids") is not None]
    assert prompts == [prompt]
    assert [t for e in events for c in e["choices"] for t in c.get("token_ids") or []] == choice["token_ids"]
    assert "token_ids" not in http.post(path, json={**body, "return_token_ids": False}).json()["choices"][0]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_booleans_are_read_as_vllms_pydantic_reads_them(http, path):
    """pydantic's lax booleans: 0/1 and strings such as "yes", "off", "true"."""
    stream = {"stream": "true", "stream_options": {"include_usage": "yes", "continuous_usage_stats": 0}}
    events = sse_events(http.post(path, json={"model": MODEL, "max_tokens": 2, "prompt": PROMPT, "messages": MESSAGES,
                                              **stream}).text.splitlines())
    assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] == 2
    body = {"model": MODEL, "max_tokens": 3, "stream": "false", "ignore_eos": "yes", "skip_special_tokens": 1,
            **({"prompt": PROMPT, "echo": "off"} if path == "/v1/completions" else {"messages": MESSAGES, "logprobs": 1})}
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert r.json()["usage"]["completion_tokens"] == 3
    if path != "/v1/completions":
        assert len(choice["logprobs"]["content"]) == 3


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_numbers_are_read_as_vllms_pydantic_reads_them(http, path):
    """An integral float or a numeric string for an int field, a numeric string for a float one
    (vLLM's models are lax); a fraction for an int is still a 400 naming the field."""
    body = {"model": MODEL, "max_tokens": 4.0, "n": "2", "temperature": "0", "seed": " 7 ", "ignore_eos": True,
            **({"prompt": PROMPT} if path == "/v1/completions" else {"messages": MESSAGES})}
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2 and r.json()["usage"]["completion_tokens"] == 8
    bad = http.post(path, json={**body, "max_tokens": 4.5})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
