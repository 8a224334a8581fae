"""What the completion and chat endpoints share: admission, running a request's generators
with the client watched, merging several requests' outputs, and server-sent events.

Invariants:

* ``admit`` refuses (503) while the server drains or when accepting the request would put more
  than ``max_waiting_requests`` sequences (prompts x n) beyond the engine's ``max_num_seqs`` running slots
  (400: a request that alone is more than both); refusals change nothing.
* ``Generation.start`` returns only once the engine took every request of the call (one
  request: once it has its first output), so a request it refuses (a prompt too long, a bad token
  id...) is a 400 before any byte of a stream is sent. Its other requests are aborted then.
* A client that disconnects ends its generators (each aborts its request in the engine); so does
  any error, and every exit path closes them (``Generation.close``).
* Errors map to HTTP: ``ValueError`` (bad input, found by the engine) -> 400,
  ``EngineDeadError`` (shut down, or failed) -> 503, anything else -> 500 with a generic message (the
  detail goes to the log, never to the client).

Costs: one task per request of the call while merging (a completion may carry several prompts);
O(1) per output besides the JSON encoding.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from fastapi import Request
from starlette.responses import JSONResponse, StreamingResponse

from ferrokv._core import CacheCapacityError
from ferrokv.engine_loop import EngineDeadError, EngineGenerateError
from ferrokv.entrypoints.openai.metrics import RequestTimer, ServerMetrics
from ferrokv.entrypoints.openai.protocol import OpenAIError, error_body
from ferrokv.entrypoints.openai.server_config import ServerConfig
from ferrokv.inputs import truncation_length
from ferrokv.outputs import RequestOutput, RequestOutputKind
from ferrokv.reasoning_parsers import ReasoningParser

logger = logging.getLogger("ferrokv.serve")

__all__ = ["Acceptance", "Generation", "ServerState", "SSEResponse", "error_response", "sse", "to_openai_error"]


@dataclass(slots=True)
class ServerState:
    """What every endpoint reads: the engine, the server's settings (``config``, their one home),
    the limits and the drain flag (one per app)."""

    llm: Any  # AsyncLLM
    metrics: ServerMetrics
    config: ServerConfig
    draining: bool = False
    http_in_flight: int = 0  # generation requests being served (the drain waits for 0)
    admitted: int = 0  # engine requests of the calls being served (admit reserves, Generation.close frees)
    created: int = field(default_factory=lambda: int(time.time()))
    reasoning: ReasoningParser | None = None  # the engine's reasoning_parser

    @property
    def model_names(self) -> tuple[str, ...]:
        """The names clients may send (``--served-model-name``'s), the first the one responses show."""
        return (self.config.served_model_name, *self.config.served_model_aliases)

    @property
    def tool_call_parser(self) -> str | None:
        """The format models' own tool calls are read in; None unless ``tool_choice: "auto"`` is on."""
        return self.config.tool_call_parser if self.config.enable_auto_tool_choice else None

    def check_model(self, model: str | None) -> str:
        """The name a response shows: the first served, whichever of them the request sent (vLLM's
        ``model_name()``); a name not served is a 404 (none, or "": the model)."""
        if model and model not in self.model_names:
            raise OpenAIError(404, f"model {model!r} does not exist; this server serves "
                                   f"{', '.join(map(repr, self.model_names))}", "model", "NotFoundError")
        return self.model_names[0]

    def check_chat_template(self, template: Mapping[str, Any]) -> None:
        """A request's own chat template (``template``: ``protocol._template``'s keywords) is
        refused unless the server trusts them (vLLM's ``--trust-request-chat-template``)."""
        if self.config.trust_request_chat_template:
            return
        for name, value in (("chat_template", template.get("chat_template")),
                            ("chat_template_kwargs", (template.get("chat_template_kwargs") or {}).get("chat_template"))):
            if value is not None:
                raise OpenAIError(400, f"{name}: a chat template sent with the request is refused: this server was "
                                       "not started with --trust-request-chat-template", name)

    def template_for(self, template: Mapping[str, Any]) -> dict[str, Any]:
        """``chat_token_ids``' keywords for a request's template fields (checked by
        ``check_chat_template``): the server's ``--chat-template`` unless the request gives its
        own, and the server's content format; the server's default ``chat_template_kwargs`` under
        the request's own (vLLM's ``--default-chat-template-kwargs``)."""
        self.check_chat_template(template)
        config = self.config
        out = dict(template, content_format=config.chat_template_content_format)
        if out.get("chat_template") is None:
            out["chat_template"] = config.chat_template
        if config.default_chat_template_kwargs:
            own = out.get("chat_template_kwargs") or {}
            out["chat_template_kwargs"] = {**config.default_chat_template_kwargs, **own}
        return out

    def apply_defaults(self, req: Any, body: Mapping[str, Any]) -> None:
        """The server's defaults for a parsed completion or chat request ``req`` (vLLM's): its
        ``return_tokens_as_token_ids`` unless the request gives one, a stream's usage, and a chat's
        tools kept from its template under ``tool_choice: "none"``."""
        config = self.config
        if body.get("return_tokens_as_token_ids") is None:
            req.tokens_as_ids = config.return_tokens_as_token_ids
        if config.enable_force_include_usage and req.stream:
            req.include_usage = True
            opts = body.get("stream_options")  # checked by the parse: a JSON object or absent
            req.continuous_usage = bool(isinstance(opts, Mapping) and opts.get("continuous_usage_stats"))
        template = getattr(req, "template", None)
        if config.exclude_tools_when_tool_choice_none and template and body.get("tool_choice") == "none":
            template["tools"] = None

    def loggable(self, prompt: Any) -> str:
        """Prompts (or chat messages) as ``--log-prompts`` logs them: their repr, each text cut to
        ``--max-log-len`` characters and each token-id list to as many ids (vLLM's), and the whole
        line to ``_LOG_LINE_FACTOR`` times that (thousands of short messages stay one short line)."""
        n = self.config.max_log_len
        if n is None:
            return repr(prompt)
        return _cut(repr(_cut(prompt, n)), _LOG_LINE_FACTOR * n + 100)

    def admit(self, num_prompts: int, n: int) -> None:
        """Takes a call's ``num_prompts`` x ``n`` sequences (what ``max_num_seqs`` counts too), or
        refuses it; ``Generation.close`` gives them back."""
        waiting = self.config.max_waiting_requests
        if self.draining:
            raise OpenAIError(503, "the server is shutting down")
        if not self.llm.is_running:
            raise to_openai_error(self.llm.dead_error)
        slots, seqs = self.llm.engine.args.max_num_seqs, num_prompts * n
        if seqs > slots + waiting:  # not even an idle server takes it: no retry helps
            field = "prompt" if num_prompts > 1 else "n"
            raise OpenAIError(400, f"{field}: {num_prompts} prompt{'s' * (num_prompts > 1)} x n={n} in one request "
                                   f"are {seqs} sequences, more than this server admits at once ({slots} running "
                                   f"+ {waiting} waiting)", field)
        if self.admitted + seqs > slots + waiting:
            raise OpenAIError(503, f"the waiting queue is full ({waiting} sequences wait "
                                   f"beyond the {slots} running); retry later", retry_after=1)
        self.admitted += seqs


_LOG_LINE_FACTOR = 4  # a logged request's line: at most this many times --max-log-len (+ its framing)


def _cut(value: Any, n: int) -> Any:
    """``value`` with every string over ``n`` characters, and every list of ints over ``n``
    items, cut to ``n`` and marked with its length."""
    if isinstance(value, str):  # the one text rule, for each text and for a whole logged line
        return value if len(value) <= n else f"{value[:n]}... ({len(value)} characters)"
    if isinstance(value, (list, tuple)):
        if len(value) > n and all(isinstance(x, int) for x in value):
            return [*value[:n], f"... ({len(value)} token ids)"]
        return [_cut(x, n) for x in value]
    if isinstance(value, dict):
        return {k: _cut(v, n) for k, v in value.items()}
    return value


def to_openai_error(e: BaseException) -> OpenAIError:
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, EngineDeadError):  # shut down, or failed (its detail is logged)
        return OpenAIError(503, "the engine failed and stopped; see the server log" if e.failed
                           else "the server is shutting down")
    # Its worst case (the prompt's full blocks once, and the rest of prompt + max_tokens - 1 for each
    # of n), or its prompt, never fits.
    if isinstance(e, CacheCapacityError):
        # Told without the engine's request id ("request_id='cmpl-...-0' needs"): the client knows its own.
        message = re.sub(r"^request_id=.*?(: (?=its prompt of )| (?=needs up to ))",
                         lambda m: "" if m[1] == ": " else "the request ", str(e), count=1, flags=re.S)
        return OpenAIError(400, message, "max_tokens" if e.field == "max_tokens" else None)
    if isinstance(e, ValueError):  # the engine's checks name the field first ("prompt_token_ids[3]=...")
        m = re.match(r"[A-Za-z_]+", str(e))
        return OpenAIError(400, str(e), m.group(0) if m else None)
    logger.error("request failed: %s: %s", type(e).__name__, e, exc_info=e)
    # A failed step's own exception type, not the wrapper every request of the step got.
    cause = e.__cause__ if isinstance(e, EngineGenerateError) and e.__cause__ is not None else e
    return OpenAIError(500, f"internal error ({type(cause).__name__}); see the server log")


def error_response(e: BaseException) -> JSONResponse:
    err = to_openai_error(e)
    headers = None if err.retry_after is None else {"Retry-After": str(err.retry_after)}
    return JSONResponse(error_body(err), status_code=err.status, headers=headers)


def dumps(obj: Any, allow_nan: bool = True) -> str:
    """Compact JSON, non-ASCII text as it is, unless UTF-8 cannot carry the text (a lone surrogate
    echoed from a request): then all of it escaped, so that no response fails to encode."""
    text = json.dumps(obj, ensure_ascii=False, allow_nan=allow_nan, separators=(",", ":"))
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return json.dumps(obj, allow_nan=allow_nan, separators=(",", ":"))
    return text


class JSONBody(JSONResponse):
    """A JSON response rendered by ``dumps``."""

    def render(self, content: Any) -> bytes:
        return dumps(content, allow_nan=False).encode("utf-8")


def sse(obj: Any) -> str:
    return f"data: {dumps(obj)}\n\n"


class SSEResponse(StreamingResponse):
    """A text/event-stream response that closes its body iterator and its generation however
    the response ends (a client that went away cancels the send, not the iterator; an iterator
    never started runs no ``finally`` of its own)."""

    def __init__(self, content: AsyncIterator[str], gen: Generation) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.gen = gen

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[union-attr]
            await self.gen.close()


# Fields of vLLM's completion and chat responses that ferrokv never sets: vLLM sends them as null
# (its response models are dumped whole), and clients that index a plain dict may read them.
RESPONSE_NULLS = MappingProxyType({"service_tier": None, "system_fingerprint": None, "kv_transfer_params": None})


def response_id(prefix: str, request: Request, request_id: str | None) -> str:
    """vLLM's response id: ``prefix`` and the ``X-Request-Id`` header, else the body's
    ``request_id``, else a random one."""
    return f"{prefix}-{request.headers.get('x-request-id') or request_id or uuid.uuid4().hex}"


def engine_request_id(response_id: str) -> str:
    """The engine's id of a response's request: the response id and a random suffix, as vLLM
    adds one, so that clients reusing an id (retries, a gateway's header) never collide."""
    return f"{response_id}-{uuid.uuid4().hex[:8]}"


def check_room(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, field: str,
               keep: int | None = None) -> None:
    """The prompt (its last ``keep`` tokens when it is truncated) and the tokens asked for fit in
    the context (vLLM's 400; the engine itself would cut the output short instead): an error of
    the prompt's ``field`` when it leaves no room at all, else of ``max_tokens`` (chat's
    ``max_completion_tokens`` too)."""
    wanted = max_tokens if max_tokens is not None else 1
    kept = num_prompt_tokens if keep is None else min(num_prompt_tokens, keep)
    if kept + wanted <= max_model_len:
        return
    if kept < max_model_len:
        cut = f", truncated to {kept}" if kept < num_prompt_tokens else ""
        raise OpenAIError(400, f"max_tokens={wanted} is too large: the context is max_model_len={max_model_len} "
                               f"tokens and the prompt has {num_prompt_tokens}{cut}, so at most "
                               f"{max_model_len - kept} can be generated", "max_tokens")
    raise OpenAIError(400, f"{field}: the context is max_model_len={max_model_len} tokens, but the request "
                           f"needs {num_prompt_tokens + wanted} ({num_prompt_tokens} in the prompt, {wanted} "
                           f"to generate)", field)


async def generate_checked(llm: Any, prompt: Any, params: Any, request_id: str, field: str,
                           add_special_tokens: bool = True, *, asked_max_tokens: int | None,
                           **kw: Any) -> AsyncIterator[RequestOutput]:
    """``llm.generate``, after tokenizing a text prompt (on the pool) and ``check_room`` of the
    max_tokens the request gave (``asked_max_tokens``: a default is cut to the context, as vLLM's
    ``get_max_tokens``, by the engine, which ends the output there); the inner generator is
    closed as soon as this one is (which aborts its request). The engine's prompt errors
    ("prompt_token_ids[3]=...") are told as errors of ``field``, the request's own name for this
    prompt (``prompt[2]`` of a batch)."""
    keep = truncation_length(params.truncate_prompt_tokens, llm.max_model_len, params.max_tokens)
    try:
        prompt = await llm.tokenize_prompt(prompt, add_special_tokens, keep)
    except ValueError as e:
        raise _prompt_error(e, field)
    if isinstance(prompt, dict) and isinstance(prompt.get("prompt_token_ids"), list):
        check_room(len(prompt["prompt_token_ids"]), asked_max_tokens, llm.max_model_len, field, keep)
    stream = llm.generate(prompt, params, request_id, **kw)
    async with contextlib.aclosing(stream):
        try:
            first = await anext(stream)  # the engine checks the request before its first output
        except ValueError as e:
            raise _prompt_error(e, field)
        except StopAsyncIteration:
            return
        yield first
        async for out in stream:
            yield out


def _prompt_error(e: ValueError, field: str) -> Exception:
    """A prompt error ("prompt_token_ids[3]=...", a prompt the KV cache cannot hold) as a 400
    naming ``field``; others as they are."""
    if isinstance(e, CacheCapacityError):  # the field to change; for max_tokens, which prompt of a batch
        err = to_openai_error(e)
        if e.field == "prompt_token_ids":
            return OpenAIError(400, f"{field}: {err.message}", field)
        return OpenAIError(400, f"{field}: {err.message}" if field.endswith("]") else err.message, err.param)
    if re.match(r"(prompts?|prompt_token_ids)\b", str(e)):  # not prompt_logprobs
        return OpenAIError(400, f"{field}: {e}", field)
    return e


class ClientGone(Exception):
    """The client disconnected before the response started."""


async def until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def watched(request: Request, work: Awaitable[Any]) -> Any:
    """``await work``, cancelled (and ``ClientGone`` raised) if the client disconnects first. If
    this call is cancelled itself (the server stopping at once), the work is cancelled and the
    cancellation goes on: nobody is told the client left."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        watch.cancel()
        await _cancelled(task)
        raise
    watch.cancel()
    if not task.done():  # the client went away first
        await _cancelled(task)
        raise ClientGone()
    return task.result()


async def _cancelled(task: asyncio.Future[Any]) -> None:
    task.cancel()
    with contextlib.suppress(BaseException):
        await task


class Acceptance:
    """Which of a call's requests the engine took, their checks passed (``of(i)``: request i's
    ``AsyncLLM.generate(on_accepted=)``); ``all`` is set once it took every one of them."""

    def __init__(self, num_requests: int) -> None:
        self.taken = [False] * num_requests
        self.all = asyncio.Event()

    def of(self, i: int) -> Callable[[], None]:
        def accepted() -> None:
            self.taken[i] = True
            if all(self.taken):  # (a call's prompts are few)
                self.all.set()

        return accepted


class Generation:
    """The requests of one call (``gens[i]`` = ``AsyncLLM.generate`` of request i), started by
    ``start``; ``outputs()`` merges them as ``(i, output)``; ``close()`` ends whatever is left
    (aborting it) and frees the call's admission; idempotent. ``accepted``: each generator reports
    to it (a request the engine took counts in the metrics as it ends, even with no output yet);
    with several requests, ``start`` returns once the engine took them all."""

    def __init__(self, gens: list[AsyncIterator[RequestOutput]], state: ServerState, params: Any,
                 accepted: Acceptance | None = None) -> None:
        self.gens = gens
        self.state = state
        self.closed = False
        self.failed = False  # a request's error ended the call: its others are not the client's aborts
        self.n = params.n  # each request's sequences, as admitted
        self.first: list[RequestOutput | None] = [None] * len(gens)
        self._firsts: list[asyncio.Future[None]] = []  # fetching them; outputs() awaits those not done
        self._accepted = accepted
        self.timers = [RequestTimer(params.n, params.max_tokens) for _ in gens]
        self.deltas = params.output_kind == RequestOutputKind.DELTA  # a stream's outputs hold new text only
        self._texts: dict[tuple[str, int], str] = {}  # (--enable-log-outputs) a streamed choice's text so far

    async def start(self) -> None:
        """Waits until every request has its first output, or (``accepted``) the engine took every
        request: a request it refuses is an error before any byte of a response is sent, and one
        prompt's first output need not wait for another's. The first error (the lowest request
        index among those that failed together) ends the call at once: the other requests stop
        waiting and are aborted, as vLLM answers a batch with a bad prompt without running the rest."""
        async def first(i: int) -> None:
            self.first[i] = await anext(self.gens[i])  # type: ignore[arg-type]

        tasks = self._firsts = [asyncio.ensure_future(first(i)) for i in range(len(self.gens))]
        several = self._accepted is not None and len(tasks) > 1
        taken = asyncio.ensure_future(self._accepted.all.wait()) if several else None  # type: ignore[union-attr]
        waiting: set[asyncio.Future[Any]] = {*tasks, *([taken] if taken else [])}
        try:
            while not (all(t.done() for t in tasks) or (taken is not None and taken.done())):
                done, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if any(t.exception() is not None for t in done if t is not taken):
                    break
        except BaseException:  # this call cancelled: no generator may still be running
            await self._stop_firsts()
            raise
        finally:
            if taken is not None:
                taken.cancel()
        failed = [t.exception() for t in tasks if t.done() and not t.cancelled() and t.exception() is not None]
        if failed:
            self.failed = True
            await self.close()
            raise failed[0]  # type: ignore[misc]

    async def _stop_firsts(self) -> None:
        for t in self._firsts:
            t.cancel()
        await asyncio.gather(*self._firsts, return_exceptions=True)

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.state.admitted -= len(self.gens) * self.n
        for i, timer in enumerate(self.timers):
            timer.seen = timer.seen or (self._accepted is not None and self._accepted.taken[i])
            self.state.metrics.on_close(timer, failed=self.failed)
        try:
            await self._stop_firsts()  # a generator still fetching its first output cannot be closed
        finally:  # (also when this close is cancelled: every request is aborted)
            for g in self.gens:
                with contextlib.suppress(BaseException):
                    await g.aclose()  # type: ignore[attr-defined]

    def _seen(self, i: int, out: RequestOutput) -> RequestOutput:
        self.state.metrics.on_output(out, self.timers[i])
        if self.state.config.log_outputs:
            self._log_outputs(out)
        return out

    def _log_outputs(self, out: RequestOutput) -> None:
        """``--enable-log-outputs``: each choice's text (cut to ``--max-log-len``) once it finishes;
        a stream's deltas are gathered until then."""
        for c in out.outputs:
            key = (out.request_id, c.index)
            text = self._texts.pop(key, "") + c.text if self.deltas else c.text
            if c.finish_reason is None:
                self._texts[key] = text
                continue
            n = self.state.config.max_log_len
            logger.info("%s: output %d: %r, finish_reason: %s", out.request_id, c.index,
                        text if n is None else _cut(text, n), c.finish_reason)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every output of every request, as each arrives (the first ones already there first)."""
        # (a first fetch that failed after start() returned raises below, from its pump)
        fetched = [t.done() and not t.cancelled() and t.exception() is None for t in self._firsts]
        pending = 0
        for i, out in enumerate(self.first):
            if fetched[i]:
                assert out is not None
                yield i, self._seen(i, out)
            pending += not fetched[i] or not out.finished  # type: ignore[union-attr]
        if pending == 0:
            return
        if len(self.gens) == 1 and fetched[0]:
            try:
                async for out in self.gens[0]:
                    yield 0, self._seen(0, out)
            except Exception:  # the request's error (a client that left is not one)
                self.failed = True
                raise
            return
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                if not fetched[i]:
                    await self._firsts[i]
                    await queue.put((i, self.first[i]))
                    if self.first[i].finished:  # type: ignore[union-attr]
                        await queue.put((i, None))
                        return
                async for out in self.gens[i]:
                    await queue.put((i, out))
            except BaseException as e:  # handed to the consumer, which raises it
                await queue.put((i, e))
                return
            await queue.put((i, None))

        tasks = [asyncio.ensure_future(pump(i)) for i, out in enumerate(self.first)
                 if not fetched[i] or not out.finished]  # type: ignore[union-attr]
        try:
            while pending:
                i, item = await queue.get()
                if item is None:
                    pending -= 1
                elif isinstance(item, BaseException):
                    self.failed = True
                    raise item
                else:
                    yield i, self._seen(i, item)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def finals(self) -> list[RequestOutput]:
        """The last output of each request (FINAL_ONLY requests: their only one)."""
        last: list[RequestOutput | None] = list(self.first)
        async for i, out in self.outputs():
            last[i] = out
        return last  # type: ignore[return-value]


async def run_generation(request: Request, state: ServerState, gens: list[AsyncIterator[RequestOutput]],
                         params: Any, respond: Callable[[Generation], Awaitable[Any]],
                         engine_error: Callable[[Exception], Exception] | None = None,
                         accepted: Acceptance | None = None) -> Any:
    """Starts the requests (watched for a disconnect) and hands them to ``respond``, which
    returns the response; errors become OpenAI errors and every generator is closed. ``params``:
    the requests' ``SamplingParams`` (their ``n`` and ``max_tokens`` go to the metrics).
    ``engine_error`` renames the errors of the start it knows (a grammar that does not compile,
    told as the request's ``guided_regex``...; the room check's, in the request's own names);
    prompt errors were named by ``generate_checked``. ``accepted``: see ``Generation``."""
    gen = Generation(gens, state, params, accepted)
    try:
        try:
            await watched(request, gen.start())
        except (ValueError, OpenAIError) as e:
            if engine_error is not None:
                raise engine_error(e) from None
            raise
        response = await respond(gen)
        if not isinstance(response, SSEResponse):  # the stream closes it when it ends
            await gen.close()
        return response
    except ClientGone:
        await gen.close()
        return JSONResponse(error_body(OpenAIError(400, "the client disconnected")), status_code=499)
    except BaseException as e:
        await gen.close()
        if isinstance(e, Exception):
            return error_response(e)
        raise


async def stream_events(gen: Generation, chunks: Callable[[int, RequestOutput], list[Any]],
                        tail: Callable[[], list[Any]]) -> AsyncIterator[str]:
    """The SSE body: ``chunks(i, output)`` per output, then ``tail()``, then ``[DONE]``; an error
    on the way is sent as an ``{"error": ...}`` event before ``[DONE]``."""
    try:
        async for i, out in gen.outputs():
            events = chunks(i, out)
            if events:
                yield "".join(map(sse, events))  # one write per output, however many chunks it makes
        for c in tail():
            yield sse(c)
    except Exception as e:
        yield sse(error_body(to_openai_error(e)))
    finally:
        await gen.close()
    yield "data: [DONE]\n\n"
