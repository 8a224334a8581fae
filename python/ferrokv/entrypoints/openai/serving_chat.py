"""``POST /v1/chat/completions``: the conversation through the model's chat template (on the
tokenizer pool), then one engine request with ``n`` samples.

Streaming sends first every choice's chunk with ``delta.role`` (``--response-role``; vLLM's order), then
per choice content chunks as the engine steps, a last chunk with ``finish_reason`` (its delta empty unless
text came with it), then a usage chunk if ``stream_options.include_usage``, then ``data: [DONE]``. ``logprobs``
follow OpenAI's chat shape (``content: [{token, logprob, bytes, top_logprobs}]``), with
``top_logprobs`` alternatives ranked 1..top_logprobs. ``prompt_logprobs`` (vLLM's extra) are a
top-level field of the non-streamed response, in vLLM's shape (``serving_completion``).
With tools, the calls come as ``tool_calls`` (``tool_parsers``): a forced call's replace the
content, and a reply of ``tool_choice: "auto"`` that called tools ends with ``finish_reason``
"tool_calls". With ``--reasoning-parser`` (``reasoning_parsers``), the answer's reasoning is its
``reasoning`` (and ``reasoning_content``, the older name) and only the rest is read for calls (a
structured output, a forced call's too, constrains that rest: the engine's grammar starts after the
reasoning).
Costs: as completions, plus one chat-template render per request.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from fastapi import Request

from ferrokv.entrypoints.openai.protocol import ChatRequest, OpenAIError, parse_chat_request
from ferrokv.entrypoints.openai.serving import (RESPONSE_NULLS, Acceptance, Generation, JSONBody, ServerState,
                                               SSEResponse, engine_request_id, generate_checked, response_id,
                                               run_generation, stream_events, to_openai_error, watched)
from ferrokv.entrypoints.openai.serving_completion import finite_logprob, prompt_logprobs_json, token_text, usage
from ferrokv.entrypoints.openai.tool_parsers import ToolCallParser, tool_call_parser
from ferrokv.outputs import CompletionOutput, RequestOutput
from ferrokv.reasoning_parsers import ReasoningParser, ReasoningSplitter, split_whole

logger = logging.getLogger("ferrokv.serve")

__all__ = ["ChatAnswer", "create_chat_completion"]


def _top(tid: int, lp: Any, as_ids: bool) -> dict[str, Any]:
    token = token_text(tid, lp, as_ids)
    return {"token": token, "logprob": finite_logprob(lp.logprob), "bytes": list(token.encode("utf-8"))}


def _logprobs(c: CompletionOutput, top_n: int, as_ids: bool) -> dict[str, Any] | None:
    if c.logprobs is None:
        return None
    content = []
    for tid, entry in zip(c.token_ids, c.logprobs):
        item = _top(tid, entry[tid], as_ids)
        # top_n -1: every token (vLLM's, under --max-logprobs -1).
        ranked = sorted((lp.rank, t, lp) for t, lp in entry.items() if lp.rank and (top_n < 0 or lp.rank <= top_n))
        item["top_logprobs"] = [_top(t, lp, as_ids) for _, t, lp in ranked]
        content.append(item)
    return {"content": content}


def _calls_kept(parser: ToolCallParser) -> int | None:
    """How many of a choice's calls are answered (None: all). vLLM's
    maybe_filter_parallel_tool_calls: with ``parallel_tool_calls`` false only the first, whatever
    the model wrote."""
    return None if parser.choice.parallel else 1


# vLLM's chat message fields that ferrokv never sets (sent as null, as vLLM dumps its message model).
_MESSAGE_NULLS = MappingProxyType({"refusal": None, "annotations": None, "audio": None, "function_call": None,
                                   "reasoning": None, "reasoning_content": None})


class ChatAnswer:
    """One chat call's answer as it is made: its message or stream deltas per choice (tool calls
    read out of the text), logprobs, finish reasons and usage (also the Responses API's)."""

    def __init__(self, req: ChatRequest, model: str, created: int, response_role: str, rid: str,
                 reasoning: ReasoningParser | None = None, template_kwargs: Mapping[str, Any] | None = None) -> None:
        self.req = req
        # vLLM's: the answer's role is --response-role, or the last message's when the request
        # continues it (add_generation_prompt false).
        self.role = response_role if req.add_generation_prompt else req.messages[-1]["role"]
        # vLLM's echo: the last message's content (text parts joined by newlines) leads each
        # choice, when that message has the answer's role (it is being continued).
        last = req.messages[-1]
        content = last.get("content") or ""
        self.echo = (content if isinstance(content, str) else "\n".join(content)) \
            if req.echo and last["role"] == self.role else ""
        self.head = {"id": rid, "object": "chat.completion.chunk", "created": created,
                     "model": model}
        self.prompt_tokens = 0
        self.cached = 0
        self.choice_tokens: dict[int, int] = {}  # generated tokens per choice index
        self.started = False  # the stream's role (and echo) chunks were sent
        self.parsers: dict[int, ToolCallParser] = {}  # per choice, when the request uses tools
        self.reasoning = reasoning  # the engine's reasoning parser, if any
        self.template_kwargs = template_kwargs  # the chat's (qwen3's enable_thinking)
        self.splitters: dict[int, ReasoningSplitter] = {}  # per streamed choice, with a reasoning parser
        self.prompt_ids: list[int] = []  # (known once outputs come: the splitters read them)

    def count(self, out: RequestOutput) -> None:
        self.prompt_ids = out.prompt_token_ids
        self.prompt_tokens = len(out.prompt_token_ids)
        self.cached = max(self.cached, out.num_cached_tokens)
        for c in out.outputs:
            self.choice_tokens[c.index] = self.choice_tokens.get(c.index, 0) + len(c.token_ids)

    def usage(self, index: int | None = None) -> dict[str, Any]:
        """The call's usage, or (vLLM's continuous usage of a chunk) choice ``index``'s so far."""
        generated = sum(self.choice_tokens.values()) if index is None else self.choice_tokens.get(index, 0)
        return usage(self.prompt_tokens, generated, self.cached)

    def logprobs(self, c: CompletionOutput) -> dict[str, Any] | None:
        return _logprobs(c, self.req.top_logprobs, self.req.tokens_as_ids) if self.req.logprobs else None

    def message(self, c: CompletionOutput) -> dict[str, Any]:
        """A whole choice's message: its reasoning, its text, and the tool calls it made (``tool_calls``)."""
        reasoning, text = (None, c.text) if self.reasoning is None else split_whole(self._splitter(), c.text)
        thought = self._reasoning_fields(reasoning)
        if self.req.tool_choice is None:  # no tool_calls: OpenAI's
            content = self.echo + text if text is not None else (self.echo or None)
            return {"role": self.role, "content": content, **_MESSAGE_NULLS, **thought}
        parser = self._parser(c.index)
        content = parser.feed(text or "")[0] + parser.close()[0]
        if (not parser.choice.forced and parser.calls and not content) or (text is None and not content):
            content = None  # vLLM's: a reply that only called tools (or only reasoned) has no content
        if self.echo:
            content = self.echo + (content or "")
        return {"role": self.role, "content": content, **_MESSAGE_NULLS, **thought,
                "tool_calls": self.answered_calls(c.index)}

    def delta(self, c: CompletionOutput) -> dict[str, Any]:
        """A streamed choice's next delta (empty: nothing to send yet): its reasoning, content and calls."""
        reasoning, text = self._split_delta(c)
        if self.req.tool_choice is None:
            content_due = text or (c.finish_reason is None and not reasoning)
            return {**({"content": text} if content_due else {}), **self._reasoning_fields(reasoning or None)}
        parser = self._parser(c.index)
        content, deltas = parser.feed(text)
        if c.finish_reason is not None:
            rest, more = parser.close()
            content, deltas = content + rest, deltas + more
        delta: dict[str, Any] = {"content": content} if content else {}
        delta.update(self._reasoning_fields(reasoning or None))
        kept = _calls_kept(parser)
        deltas = [d for d in deltas if kept is None or d["index"] < kept]
        if deltas:
            delta["tool_calls"] = deltas
        return delta

    def _split_delta(self, c: CompletionOutput) -> tuple[str, str]:
        """A streamed choice's next reasoning and content text (``reasoning_parsers``)."""
        if self.reasoning is None:
            return "", c.text
        splitter = self.splitters.get(c.index)
        if splitter is None:
            splitter = self.splitters[c.index] = self._splitter()
        reasoning, text = splitter.feed(c.text)
        if c.finish_reason is not None:
            more, rest = splitter.close()
            reasoning, text = reasoning + more, text + rest
        return reasoning, text

    def _splitter(self) -> ReasoningSplitter:
        """A choice's reasoning splitter (``ReasoningParser.splitter``: a structured output's answer
        is all content when the prompt closed the reasoning, as its grammar then started at once)."""
        assert self.reasoning is not None
        constrained = self.req.params.structured_outputs is not None
        return self.reasoning.splitter(self.template_kwargs, self.prompt_ids, constrained)

    def reasoning_tokens(self, token_ids: Sequence[int]) -> int:
        """How many of a choice's ``token_ids`` are its reasoning (vLLM's count, for usage)."""
        if self.reasoning is None or not self._splitter().thinking:
            return 0
        return self.reasoning.count_reasoning_tokens(token_ids)

    def _reasoning_fields(self, reasoning: str | None) -> dict[str, Any]:
        """A message's (or delta's) reasoning, under vLLM's name and its older one, unless the
        request said ``include_reasoning: false``."""
        if reasoning is None or not self.req.include_reasoning:
            return {}
        return {"reasoning": reasoning, "reasoning_content": reasoning}

    def answered_calls(self, index: int) -> list[dict[str, Any]]:
        """The calls choice ``index`` made so far that are answered (``_calls_kept``)."""
        parser = self.parsers.get(index)
        return [] if parser is None else parser.calls[:_calls_kept(parser)]

    def finish_reason(self, c: CompletionOutput) -> str | None:
        """vLLM's (and OpenAI's): "tool_calls" once a reply of ``tool_choice`` "auto" or "required"
        called tools and stopped, "stop" for a named function; any other reason ("length": cut by
        max_tokens) is kept, so a truncation is not hidden."""
        parser = self.parsers.get(c.index)
        called = parser is not None and parser.choice.name is None and parser.calls
        return "tool_calls" if called and c.finish_reason == "stop" else c.finish_reason

    def _parser(self, index: int) -> ToolCallParser:
        parser = self.parsers.get(index)
        if parser is None:
            parser = self.parsers[index] = tool_call_parser(self.req.tool_choice)  # type: ignore[arg-type]
        return parser


async def create_chat_completion(request: Request, state: ServerState, body: Any) -> Any:
    req = parse_chat_request(body, defaults=state.llm.default_sampling_params,
                             max_logprobs=state.llm.engine.args.max_logprobs, tool_call_parser=state.tool_call_parser)
    state.apply_defaults(req, body)
    model = state.check_model(req.model)
    template = state.template_for(req.template)
    state.admit(1, req.params.n)
    call = ChatAnswer(req, model, int(time.time()),  # created: when this completion was made
                      state.config.response_role, response_id("chatcmpl", request, req.request_id),
                      state.reasoning, template.get("chat_template_kwargs"))
    rid = engine_request_id(call.head["id"])
    if state.config.log_prompts:
        logger.info("%s: messages %s, params %r", rid, state.loggable(req.messages), req.params)

    accepted = Acceptance(1)  # (the metrics count a request the engine took, ended before any output)

    async def prompt_then_generate() -> Any:
        # The template runs inside the generator, so its errors surface in Generation.start.
        ids = await state.llm.encode_chat(req.messages, req.add_generation_prompt, **template)
        stream = generate_checked(state.llm, {"prompt_token_ids": ids}, req.params, rid, "messages",
                                  asked_max_tokens=req.asked_max_tokens, priority=req.priority,
                                  cache_salt=req.cache_salt, on_accepted=accepted.of(0))
        async with contextlib.aclosing(stream):  # closed at once when this one is (the abort)
            async for out in stream:
                yield out

    async def respond(gen: Generation) -> Any:
        if req.stream:
            return SSEResponse(_stream(gen, call), gen)
        (out,) = await watched(request, gen.finals())
        call.count(out)
        choices = [{"index": c.index, "message": call.message(c),
                    "logprobs": call.logprobs(c), "finish_reason": call.finish_reason(c), "stop_reason": c.stop_reason,
                    **({"token_ids": list(c.token_ids)} if req.token_ids else {})}
                   for c in sorted(out.outputs, key=lambda c: c.index)]
        ids = {"prompt_token_ids": list(out.prompt_token_ids)} if req.token_ids else {}
        return JSONBody({**call.head, "object": "chat.completion", "choices": choices, **RESPONSE_NULLS,
                         "usage": call.usage(), "prompt_logprobs": prompt_logprobs_json(out.prompt_logprobs), **ids})

    def engine_error(e: Exception) -> Exception:
        return _as_asked(req, req.engine_error(e))

    return await run_generation(request, state, [prompt_then_generate()], req.params, respond, engine_error,
                                accepted)


def _as_asked(req: ChatRequest, e: Exception) -> Exception:
    """An error about ``max_tokens`` in the name the request gave it (``max_completion_tokens``)."""
    if req.max_tokens_field == "max_tokens" or not isinstance(e, (OpenAIError, ValueError)):
        return e
    return to_openai_error(e).renamed(lambda s: re.sub(r"\bmax_tokens\b", req.max_tokens_field, s))


def _stream(gen: Generation, call: ChatAnswer) -> Any:
    include_usage = call.req.include_usage
    head = call.head

    def chunk(choice: dict[str, Any], generated: bool = True) -> dict[str, Any]:
        """One choice's chunk; with continuous usage, that choice's tokens so far (none before
        its content: the role and echo chunks, as vLLM counts them)."""
        c = {**head, "choices": [choice]}
        if include_usage and not call.req.continuous_usage:
            c["usage"] = None
        elif include_usage:
            c["usage"] = call.usage(choice["index"]) if generated else usage(call.prompt_tokens, 0, call.cached)
        return c

    def chunks(i: int, out: RequestOutput) -> list[Any]:
        call.count(out)
        events = []
        with_ids = call.req.token_ids  # vLLM's return_token_ids: the prompt's first, then each delta's
        if not call.started:  # vLLM's: every choice's role chunk first, then every echo chunk
            call.started = True
            for index in range(call.req.params.n):
                events.append(chunk({"index": index, "delta": {"role": call.role, "content": ""},
                                     "logprobs": None, "finish_reason": None}, generated=False))
                if with_ids and index == 0:
                    events[-1]["prompt_token_ids"] = list(out.prompt_token_ids)
            if call.echo:
                events += [chunk({"index": index, "delta": {"content": call.echo}, "logprobs": None,
                                  "finish_reason": None}, generated=False) for index in range(call.req.params.n)]
        for c in out.outputs:
            delta = call.delta(c)
            if not delta.get("content") and not delta.get("reasoning") and "tool_calls" not in delta \
                    and c.finish_reason is None \
                    and c.logprobs is None and not (with_ids and c.token_ids):
                continue  # a token that completes no character (or call) yet: nothing to send
            events.append(chunk({"index": c.index, "delta": delta, "logprobs": call.logprobs(c),
                                 "finish_reason": call.finish_reason(c), "stop_reason": c.stop_reason,
                                 **({"token_ids": list(c.token_ids)} if with_ids else {})}))
        return events

    def tail() -> list[Any]:
        return [{**head, "choices": [], "usage": call.usage()}] if include_usage else []

    return stream_events(gen, chunks, tail)
