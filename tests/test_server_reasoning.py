"""Reasoning parsers (``ferrokv.reasoning_parsers``): the splitter on its own,
then ``--reasoning-parser`` end to end, on a tiny model steered to write a chosen chain of tokens
(``helpers.chain_model``) through chat completions and the Responses API, streamed and not."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from ferrokv.engine_args import EngineArgs
from ferrokv.reasoning_parsers import ReasoningParser, ReasoningSplitter, reasoning_ended_in, split_whole

MODEL = "chain"
THINK, END = "<think>", "</think>"
TAGS = (1000, 1001)  # their ids, where a test needs some


def _whole(parser: str, text: str, kwargs: dict | None = None) -> tuple[str | None, str | None]:
    return split_whole(ReasoningParser(parser, TAGS).splitter(kwargs), text)


@pytest.mark.parametrize("text,deepseek,qwen3", [
    ("<think>abc</think>def", ("abc", "def"), ("abc", "def")),
    ("abc</think>def", ("abc", "def"), ("abc", "def")),  # the template opened it
    ("abc</think>", ("abc", None), ("abc", None)),
    ("<think>abc", ("abc", None), ("abc", None)),  # cut short: all reasoning (vLLM's current qwen3 too)
    ("plain answer", ("plain answer", None), ("plain answer", None)),
    ("a</think>b</think>c", ("a", "b</think>c"), ("a", "b</think>c")),  # the first end tag ends it
    ("x<think>y</think>z", ("x<think>y", "z"), ("x<think>y", "z")),  # only a leading <think> is the model's
    (" \n<think>y</think>z", (" \ny", "z"), (" \ny", "z")),
    ("a</think>b<think>c", ("a", "b<think>c"), ("a", "b<think>c")),  # a <think> after the end is content
    ("<think></think>x", (None, "x"), (None, "x")),  # an empty reasoning is none
    ("", (None, None), (None, None)),
    # qwen3: a tool call ends the reasoning, and is content (for the tool parser); a tag only
    # named in the reasoning does not (review27)
    ("why<tool_call>{}</tool_call>", ("why<tool_call>{}</tool_call>", None), ("why", "<tool_call>{}</tool_call>")),
    ("a<tool_call>\n<function=f>", ("a<tool_call>\n<function=f>", None), ("a", "<tool_call>\n<function=f>")),
    ("I emit <tool_call> now.</think>4", ("I emit <tool_call> now.", "4"), ("I emit <tool_call> now.", "4")),
    ("a<tool_call>", ("a<tool_call>", None), ("a<tool_call>", None)),
    ("<think>a</think>b<tool_call>c", ("a", "b<tool_call>c"), ("a", "b<tool_call>c")),
])
def test_a_whole_answer_splits_as_vllms_parsers_read_it(text, deepseek, qwen3):
    assert _whole("deepseek_r1", text) == deepseek
    assert _whole("qwen3", text) == qwen3
    # Qwen3 with enable_thinking false (any false value, as vLLM reads it): all content
    # (deepseek_r1 has no such switch).
    for off in (False, 0, None, ""):
        assert _whole("qwen3", text, {"enable_thinking": off}) == (None, text or None)
    assert _whole("deepseek_r1", text, {"enable_thinking": False}) == deepseek
    assert _whole("qwen3", text, {"enable_thinking": True}) == qwen3


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_a_stream_splits_as_the_whole_text_under_any_chunking(parser):
    """Deltas cut anywhere, tags included, give the whole text's split: nothing is lost, doubled or
    sent early as the wrong kind."""
    rng = random.Random(7)
    pieces = ["<think>", "</think>", "<tool_call>", "<", "/", "think", ">", "a", "b c", "<thin", "k>", "</thi", "nk",
              "<tool_", "{", " ", "<function", "<func"]
    p = ReasoningParser(parser, TAGS)
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 8)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 5))))
        chunks = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        splitter = p.splitter(None)
        got = [splitter.feed(c) for c in chunks] + [splitter.close()]
        reasoning, content = "".join(r for r, _ in got), "".join(c for _, c in got)
        assert (reasoning or None, content or None) == _whole(parser, text), (text, chunks)


def test_a_partial_tag_waits_for_the_next_delta():
    s = ReasoningSplitter()
    assert s.feed("<thi") == ("", "")
    assert s.feed("nk>idea</th") == ("idea", "")
    assert s.feed("ink>answer <") == ("", "answer <")
    assert s.feed("x") == ("", "x")
    s = ReasoningSplitter()
    assert s.feed("so 3 <") == ("so 3 ", "") and s.close() == ("<", "")
    s = ReasoningParser("qwen3", TAGS).splitter(None)
    assert s.feed("hm <tool") == ("hm ", "") and s.feed("_call> ") == ("", "") and s.feed("{") == ("", "<tool_call> {")
    s = ReasoningParser("qwen3", TAGS).splitter(None)  # a call tag waits for what follows it
    assert s.feed("say <tool_call>") == ("say ", "") and s.feed(" <fu") == ("", "")
    assert s.feed("nny>") == ("<tool_call> <funny>", "")


def test_a_parser_is_refused_when_the_tokenizer_lacks_its_tags():
    with pytest.raises(ValueError, match=r"reasoning_parser='qwen3': the tokenizer has no '</think>' token"):
        ReasoningParser.of("qwen3", {"<think>": 5})
    assert ReasoningParser.of("deepseek_r1", {THINK: 5, END: 6}) == ReasoningParser("deepseek_r1", (5, 6))
    assert ReasoningParser.of(None, {}) is None
    with pytest.raises(ValueError, match="reasoning_parser must be one of deepseek_r1, qwen3; got 'granite'"):
        EngineArgs(model="m", reasoning_parser="granite").validate()


def test_a_constrained_answer_after_a_prompt_that_closed_the_reasoning_is_content():
    """The engine starts a structured output's grammar at once when the prompt closed the
    reasoning: the answer is content, whatever the parser would make of it (review28)."""
    for parser in ("deepseek_r1", "qwen3"):
        p = ReasoningParser(parser, TAGS)
        assert split_whole(p.splitter(None, [5, 1000, 1001, 7], constrained=True), '{"a": 1}') == (None, '{"a": 1}')
        assert split_whole(p.splitter(None, [5, 1000, 7], constrained=True), "x</think>y") == ("x", "y")
        assert split_whole(p.splitter(None, [5, 1000, 1001], constrained=False), "x</think>y") == ("x", "y")


def test_reasoning_tokens_are_counted_as_vllm_counts_them():
    p = ReasoningParser("deepseek_r1", TAGS)
    assert p.count_reasoning_tokens([1000, 5, 6, 1001, 7]) == 2  # the leading <think> is not counted
    assert p.count_reasoning_tokens([5, 6, 1001, 7, 1001]) == 2 and p.count_reasoning_tokens([5, 6, 7]) == 3
    assert p.count_reasoning_tokens([]) == 0 and p.count_reasoning_tokens([1001, 4]) == 0


def test_the_prompt_closing_the_reasoning_is_read_from_its_last_tags():
    assert reasoning_ended_in([5, 10, 6, 11, 7], (10, 11)) and reasoning_ended_in([11], (10, 11))
    assert not reasoning_ended_in([5, 10, 6], (10, 11)) and not reasoning_ended_in([10, 11, 10], (10, 11))
    assert not reasoning_ended_in([], (10, 11))


# ------------------------------------------------------------------------------------------------
# End to end. The template ends the prompt on <|assistant|> (the model then writes its own
# <think>), on <think> (open_think: as Qwen3 thinking templates open it), or on <think></think>
# (enable_thinking false); the chain model answers "<think> the cat</think> srd" from there.
TEMPLATE = ("{% for m in messages %}{{ m['content'] }}{% endfor %}<|assistant|>"
            "{% if enable_thinking is defined and not enable_thinking %}<think></think>"
            "{% elif open_think is defined %}<think>{% endif %}")
CHAIN = ["<|assistant|>", THINK, 279, 309, END, 260, 350, 0]  # " the", " cat", " s", "rd", then EOS


@pytest.fixture(scope="module")
def chain_llm(tmp_path_factory):
    """``chain_llm(parser)``: an engine on the chain model with that ``reasoning_parser``."""
    from helpers.chain_model import save_chain_model

    from ferrokv import AsyncLLM

    path = tmp_path_factory.mktemp("chain") / "model"
    save_chain_model(path, [THINK, END, "<|assistant|>"], CHAIN)
    made = {}

    def llm(parser):
        if parser not in made:
            made[parser] = AsyncLLM(str(path), device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=32,
                                    reasoning_parser=parser)
        return made[parser]

    yield llm
    for engine in made.values():
        engine.shutdown()


def _post_all(chain_llm, parser, requests):
    """Each (path, body) posted to a server of an engine with ``parser``; JSON bodies, or a
    stream's events."""
    from ferrokv.entrypoints.openai.api_server import ServerConfig, build_app

    app = build_app(chain_llm(parser), ServerConfig(served_model_name=MODEL, chat_template=TEMPLATE))

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            out = []
            for path, body in requests:
                r = await c.post(path, json=body)
                assert r.status_code == 200, r.text
                if not body.get("stream"):
                    out.append(r.json())
                    continue
                data = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
                out.append([json.loads(d) for d in data if d != "[DONE]"])
            return out

    return asyncio.run(main())


def _chat(stream=False, **kw):
    return ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12,
                                     "temperature": 0, "stream": stream, **kw})


def _streamed(events):
    deltas = [ch["delta"] for e in events for ch in e["choices"]]
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    return "".join(d.get("reasoning") or "" for d in deltas), "".join(d.get("content") or "" for d in deltas)


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_chat_answers_carry_their_reasoning_apart_from_their_content(chain_llm, parser):
    """Whether the model or the template opens the reasoning, and whatever an earlier turn held;
    Qwen3's enable_thinking false makes the answer content (deepseek_r1 has no such switch: an
    answer without the end tag is reasoning cut short)."""
    history = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "<think>x</think>y"},
               {"role": "user", "content": "q2"}]
    kwargs = [{}, {"chat_template_kwargs": {"open_think": True}}, {"messages": history},
              {"chat_template_kwargs": {"enable_thinking": False}}]
    plain = _post_all(chain_llm, None, [_chat(**kw) for kw in kwargs])
    texts = [p["choices"][0]["message"]["content"] for p in plain]
    assert texts == ["<think> the cat</think> srd", " the cat</think> srd", "<think> the cat</think> srd", " srd"]
    assert all(p["choices"][0]["message"]["reasoning"] is None for p in plain)  # no parser: vLLM's null
    got = _post_all(chain_llm, parser, [_chat(stream=s, **kw) for kw in kwargs for s in (False, True)])
    wants = [(" the cat", " srd")] * 3 + [(None, " srd") if parser == "qwen3" else (" srd", None)]
    for (whole, events), want in zip(zip(got[::2], got[1::2]), wants):
        m = whole["choices"][0]["message"]
        assert (m["reasoning"], m["content"]) == want and m["reasoning_content"] == m["reasoning"]
        assert whole["choices"][0]["finish_reason"] == "stop"
        assert _streamed(events) == (want[0] or "", want[1] or "")


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_an_answer_cut_before_its_end_tag_is_reasoning(chain_llm, parser):
    whole, events = _post_all(chain_llm, parser, [_chat(max_tokens=2), _chat(stream=True, max_tokens=2)])
    m = whole["choices"][0]["message"]  # "<think> the"
    assert (m["reasoning"], m["content"]) == (" the", None) and _streamed(events) == (" the", "")
    assert whole["choices"][0]["finish_reason"] == "length"


def test_include_reasoning_false_drops_the_reasoning(chain_llm):
    whole, events = _post_all(chain_llm, "deepseek_r1", [
        _chat(include_reasoning=False), _chat(stream=True, include_reasoning="false")])
    m = whole["choices"][0]["message"]
    assert (m["reasoning"], m["content"]) == (None, " srd")
    assert _streamed(events) == ("", " srd")
    with pytest.raises(AssertionError, match="include_reasoning must be a boolean"):
        _post_all(chain_llm, "qwen3", [_chat(include_reasoning=[1])])


def test_responses_put_the_reasoning_in_its_own_item(chain_llm):
    body = {"input": "hi", "max_output_tokens": 12, "temperature": 0}
    whole, events = _post_all(chain_llm, "deepseek_r1", [("/v1/responses", body),
                                                         ("/v1/responses", {**body, "stream": True})])
    reasoning, message = whole["output"]
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [{"type": "reasoning_text", "text": " the cat"}]
    assert message["type"] == "message" and message["content"][0]["text"] == " srd"
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == " the cat"
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == " srd"
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert [(e["output_index"], e["item"]["type"]) for e in done] == [(0, "reasoning"), (1, "message")]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.content_part.added")
    assert [(i["type"], i["status"]) for i in events[-1]["response"]["output"]] == [("reasoning", "completed"),
                                                                                   ("message", "completed")]
    # usage counts the reasoning's tokens (" the", " cat"), streamed or not (vLLM's)
    for usage in (whole["usage"], events[-1]["response"]["usage"]):
        assert usage["output_tokens_details"] == {"reasoning_tokens": 2} and usage["output_tokens"] == 7
    # An answer of reasoning alone (cut short) has no message item (vLLM's), streamed or not.
    short = {**body, "max_output_tokens": 3}
    whole, events = _post_all(chain_llm, "qwen3", [("/v1/responses", short),
                                                   ("/v1/responses", {**short, "stream": True})])
    for output in (whole["output"], events[-1]["response"]["output"]):
        assert [(i["type"], i["status"]) for i in output] == [("reasoning", "incomplete")]
        assert output[0]["content"][0]["text"] == " the cat"
    assert not [e for e in events if "output_text" in e["type"] or "content_part" in e["type"]]


def test_a_structured_output_constrains_what_follows_the_reasoning(chain_llm):
    """vLLM's reasoning-aware structured outputs: the grammar starts after the </think> token, so
    the model reasons freely first; without a parser, or when the prompt closed the reasoning
    (Qwen3's enable_thinking false), it constrains the whole answer."""
    regex = {"structured_outputs": {"regex": " cat"}}  # the chain would answer " srd"
    (plain,) = _post_all(chain_llm, None, [_chat(**regex)])
    assert plain["choices"][0]["message"]["content"] == " cat"
    for parser in ("deepseek_r1", "qwen3"):
        whole, events = _post_all(chain_llm, parser, [_chat(**regex), _chat(stream=True, **regex)])
        m = whole["choices"][0]["message"]
        assert (m["reasoning"], m["content"]) == (" the cat", " cat") and _streamed(events) == (" the cat", " cat")
    off = {**regex, "chat_template_kwargs": {"enable_thinking": False}}
    for parser in ("deepseek_r1", "qwen3"):  # (deepseek_r1 reads no enable_thinking: the prompt tells)
        whole, events = _post_all(chain_llm, parser, [_chat(**off), _chat(stream=True, **off)])
        m = whole["choices"][0]["message"]
        assert (m["reasoning"], m["content"]) == (None, " cat") and _streamed(events) == ("", " cat")
    # The offline engine too: the reasoning, then the constrained answer.
    from ferrokv import SamplingParams
    from ferrokv.structured_outputs import StructuredOutputsParams

    async def offline():
        llm = chain_llm("deepseek_r1")
        params = SamplingParams(max_tokens=12, temperature=0, structured_outputs=StructuredOutputsParams(regex=" cat"))
        ids = llm.tokenizer("hi<|assistant|>")["input_ids"]
        async for out in llm.generate({"prompt_token_ids": ids}, params, "offline"):
            last = out
        return last.outputs[0].text

    assert asyncio.run(offline()) == "<think> the cat</think> cat"


def test_an_engine_whose_tokenizer_lacks_the_tags_is_refused(tiny_model_dir):
    from ferrokv import AsyncLLM

    with pytest.raises(ValueError, match="reasoning_parser='deepseek_r1': the tokenizer has no '<think>' or "
                                         "'</think>' token"):
        AsyncLLM(str(tiny_model_dir("llama")), device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=16,
                 reasoning_parser="deepseek_r1")
