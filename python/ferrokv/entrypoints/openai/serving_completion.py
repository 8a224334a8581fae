"""``POST /v1/completions``: OpenAI's legacy completions, one engine request per prompt.

Choices are numbered ``prompt_index * n + sample_index``, as in OpenAI and vLLM. Non-streaming
requests run ``FINAL_ONLY`` (one output each); streaming ones ``DELTA``, one chunk per choice
that moved per engine step (one choice per chunk, as vLLM and OpenAI send them), then a usage
chunk if ``stream_options.include_usage`` (and, with vLLM's ``continuous_usage_stats``, each
chunk's own: its prompt's tokens and its choice's so far), then ``data: [DONE]``.
``logprobs`` follow OpenAI's completion shape (``tokens``, ``token_logprobs``,
``top_logprobs``, ``text_offset``; the sampled token first in each ``top_logprobs`` entry, which
keeps a key that several tokens decode to, e.g. a partial UTF-8 character). ``prompt_logprobs``
(vLLM's extra) are in each non-streamed choice, as vLLM sends them: one entry per prompt token,
``null`` for the first, else ``{"token id": {logprob, rank, decoded_token}}``. ``echo`` (vLLM's)
puts the prompt first in each choice's text and, with ``logprobs``, its logprobs first (computed
as prompt logprobs; the first token has none); streamed, in each choice's first chunk (a
stream's prompt logprobs are all in the request's first output, which comes with its first
tokens); ``max_tokens: 0`` then reports the prompt alone.
Costs: O(tokens) per response for the text and logprobs, nothing per step beyond the chunks.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any

from fastapi import Request

from ferrokv.entrypoints.openai.protocol import CompletionRequest, parse_completion_request
from ferrokv.entrypoints.openai.serving import (RESPONSE_NULLS, Acceptance, Generation, JSONBody, ServerState,
                                               SSEResponse, engine_request_id, generate_checked, response_id,
                                               run_generation, stream_events, watched)
from ferrokv.outputs import CompletionOutput, RequestOutput

logger = logging.getLogger("ferrokv.serve")

__all__ = ["create_completion", "finite_logprob", "prompt_logprobs_json", "token_text", "usage"]


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def finite_logprob(x: float) -> float:
    """JSON has no -inf: an impossible token's logprob is sent as -9999.0, as vLLM does."""
    return x if x >= -9999.0 else -9999.0  # NaN too (every comparison with NaN is false)


def prompt_logprobs_json(plp: list[Any] | None) -> list[Any] | None:
    """``RequestOutput.prompt_logprobs`` as vLLM's JSON: ``[null, {"id": {logprob, rank,
    decoded_token}}, ...]`` (an impossible token's logprob as -9999.0)."""
    if plp is None:
        return None
    return [None if entry is None else
            {str(t): {"logprob": finite_logprob(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
             for t, lp in entry.items()}
            for entry in plp]


def token_text(tid: int, lp: Any, as_ids: bool) -> str:
    """How logprobs name a token: its text, or ``token_id:N`` (no text, or vLLM's
    ``return_tokens_as_token_ids``)."""
    return lp.decoded_token if lp is not None and lp.decoded_token is not None and not as_ids else f"token_id:{tid}"


class _Logprobs:
    """One choice's completion logprobs, accumulated across streamed pieces (``text_offset``
    runs on from the previous piece); each position lists at most ``logprobs + 1`` tokens, the
    echoed prompt's too (vLLM's, whatever ``prompt_logprobs`` asked)."""

    __slots__ = ("offset", "as_ids", "most")

    def __init__(self, as_ids: bool, logprobs: int) -> None:
        self.offset = 0
        self.as_ids = as_ids  # vLLM's return_tokens_as_token_ids
        self.most = logprobs + 1

    def piece(self, token_ids: list[int], entries: list[Any], first_text: str = "") -> dict[str, Any]:
        """OpenAI's logprobs of ``token_ids``; an entry may be None (a prompt's first token,
        whose text is ``first_text``: it has no logprob)."""
        tokens, lps, tops, offsets = [], [], [], []
        for tid, entry in zip(token_ids, entries):
            if entry is None:  # named by its id too under return_tokens_as_token_ids (vLLM's)
                tokens.append(f"token_id:{tid}" if self.as_ids else first_text)
                lps.append(None)
                tops.append(None)
            else:
                tokens.append(token_text(tid, entry.get(tid), self.as_ids))
                lps.append(finite_logprob(entry[tid].logprob) if tid in entry else None)
                top: dict[str, float] = {}
                # The sampled token first: it keeps its text's key.
                for t, lp in itertools.islice(entry.items(), self.most):
                    top.setdefault(token_text(t, lp, self.as_ids), finite_logprob(lp.logprob))
                tops.append(top)
            offsets.append(self.offset)
            self.offset += len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


class _Completion:
    """One call's ids and running totals."""

    def __init__(self, req: CompletionRequest, model: str, tokenizer: Any, rid: str) -> None:
        self.req = req
        self.model = model
        self.tokenizer = tokenizer  # echo: the text of a prompt given as token ids
        self.echoed: set[int] = set()
        self.ids_sent: set[int] = set()  # choices whose prompt_token_ids went out (return_token_ids)
        self.id = rid
        self.n = req.params.n
        self.logprobs: dict[int, _Logprobs] = {}
        self.prompt_tokens: dict[int, int] = {}
        self.prompt_logprobs: dict[int, list[Any]] = {}  # per prompt: echo's, as the outputs bring them
        self.cached: dict[int, int] = {}
        self.choice_tokens: dict[int, int] = {}  # generated tokens per choice index

    def choice(self, i: int, out: RequestOutput, c: CompletionOutput) -> dict[str, Any]:
        index = i * self.n + c.index
        lp = None
        if c.logprobs is not None:
            lp = self.logprobs.setdefault(index, _Logprobs(self.req.tokens_as_ids, self.req.logprobs or 0))
        text, ids, entries = (c.text, c.token_ids, c.logprobs) if self.req.generate else ("", [], [])
        logprobs = None
        if self.req.echo and index not in self.echoed:  # the first piece of this choice
            self.echoed.add(index)
            prompt = out.prompt if out.prompt is not None else self.tokenizer.decode(out.prompt_token_ids)
            text = prompt + text
            if lp is not None:
                first = self.tokenizer.decode(out.prompt_token_ids[:1])
                logprobs = lp.piece(out.prompt_token_ids, self.prompt_logprobs.get(i, []), first)
        if lp is not None:
            rest = lp.piece(ids, entries)
            logprobs = rest if logprobs is None else {k: logprobs[k] + rest[k] for k in logprobs}
        choice = {"index": index, "text": text, "logprobs": logprobs,
                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if self.req.token_ids:  # vLLM's return_token_ids: the prompt's with a choice's first piece
            choice["prompt_token_ids"] = None if index in self.ids_sent else list(out.prompt_token_ids)
            choice["token_ids"] = list(ids)
            self.ids_sent.add(index)
        return choice

    def count(self, i: int, out: RequestOutput) -> None:
        """Takes output ``out`` of prompt ``i`` in (before its choices are made)."""
        self.prompt_tokens[i] = len(out.prompt_token_ids)
        if out.prompt_logprobs:  # a stream's (DELTA) come once; FINAL_ONLY's once whole
            self.prompt_logprobs.setdefault(i, []).extend(out.prompt_logprobs)
        self.cached[i] = max(self.cached.get(i, 0), out.num_cached_tokens)
        if self.req.generate:  # echo with max_tokens 0 generates nothing it reports
            for c in out.outputs:
                index = i * self.n + c.index
                self.choice_tokens[index] = self.choice_tokens.get(index, 0) + len(c.token_ids)

    def usage(self) -> dict[str, Any]:
        return usage(sum(self.prompt_tokens.values()), sum(self.choice_tokens.values()), sum(self.cached.values()))

    def choice_usage(self, i: int, index: int) -> dict[str, Any]:
        """vLLM's continuous usage of one choice's chunk: its prompt's tokens and its own."""
        return usage(self.prompt_tokens[i], self.choice_tokens.get(index, 0), self.cached[i])

    def head(self, created: int) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": created, "model": self.model}


async def create_completion(request: Request, state: ServerState, body: Any) -> Any:
    req = parse_completion_request(body, defaults=state.llm.default_sampling_params,
                             max_logprobs=state.llm.engine.args.max_logprobs)
    state.apply_defaults(req, body)
    model = state.check_model(req.model)
    state.admit(len(req.prompts), req.params.n)
    call = _Completion(req, model, state.llm.tokenizer, response_id("cmpl", request, req.request_id))
    created = int(time.time())  # OpenAI's created: when this completion was made
    if state.config.log_prompts:
        logger.info("%s: prompts %s, params %r", call.id, state.loggable(req.prompts), req.params)
    field = "prompt" if len(req.prompts) == 1 else "prompt[{}]"
    rid = engine_request_id(call.id)
    # Several prompts: the response starts once the engine took them all, not once each has a token.
    accepted = Acceptance(len(req.prompts))
    gens = [generate_checked(state.llm, p, req.params, f"{rid}-{i}", field.format(i), req.add_special_tokens,
                             asked_max_tokens=req.asked_max_tokens, priority=req.priority, cache_salt=req.cache_salt,
                             on_accepted=accepted.of(i))
            for i, p in enumerate(req.prompts)]

    async def respond(gen: Generation) -> Any:
        if req.stream:
            return SSEResponse(_stream(gen, call, created), gen)
        finals = await watched(request, gen.finals())
        choices = []
        for i, out in enumerate(finals):
            call.count(i, out)
            plp = prompt_logprobs_json(out.prompt_logprobs)
            choices += [{**call.choice(i, out, c), "prompt_logprobs": plp} for c in out.outputs]
        choices.sort(key=lambda c: c["index"])
        return JSONBody({**call.head(created), "choices": choices, **RESPONSE_NULLS, "usage": call.usage()})

    return await run_generation(request, state, gens, req.params, respond, req.engine_error, accepted)


def _stream(gen: Generation, call: _Completion, created: int) -> Any:
    head = call.head(created)
    include_usage = call.req.include_usage

    def chunks(i: int, out: RequestOutput) -> list[Any]:
        call.count(i, out)
        events = []
        for c in out.outputs:
            # A token that completes no character yet has nothing to send (unless it has logprobs).
            first_echo = call.req.echo and i * call.n + c.index not in call.echoed
            if c.text or c.finish_reason is not None or c.logprobs is not None or first_echo \
                    or (call.req.token_ids and c.token_ids):
                choice = call.choice(i, out, c)
                chunk = {**head, "choices": [choice]}
                if include_usage:
                    chunk["usage"] = call.choice_usage(i, choice["index"]) if call.req.continuous_usage else None
                events.append(chunk)
        return events

    def tail() -> list[Any]:
        return [{**head, "choices": [], "usage": call.usage()}] if include_usage else []

    return stream_events(gen, chunks, tail)
