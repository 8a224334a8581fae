"""``POST /v1/responses``: OpenAI's Responses API, served as vLLM serves it for models without a
Harmony format. The ``instructions`` (a system message, none when empty) and the ``input`` (a
string, or a list of ``message``, ``function_call`` and ``function_call_output`` items) become a
chat conversation, which takes the chat path (``serving_chat``: the template, tools, ``text.format``
as a structured output, or vLLM's ``structured_outputs``; the sampling fields vLLM's
ResponsesRequest takes pass on as they are; as vLLM's: ``truncation: "auto"`` keeps the prompt's
last tokens that fit, a last assistant message ``in_progress`` or ``incomplete`` is continued,
``tool_choice: "none"`` shows the template no tools, ``reasoning.effort`` is the template's
``reasoning_effort``); one sample is generated. Its answer is the response's ``output``: with
``--reasoning-parser``, a ``reasoning`` item holding the answer's reasoning as one ``reasoning_text``
part (when it has some); a ``message`` item with one ``output_text`` part (when there is text, or
nothing else), then one ``function_call`` item per tool call (its ``call_id`` is ``call_…``, as
vLLM's). A finish by length makes the response ``incomplete`` (reason ``max_output_tokens``).

As vLLM without ``VLLM_ENABLE_RESPONSES_API_STORE``, nothing is stored: ``store`` is ignored,
``background`` (which needs the store) is a 400, a ``previous_response_id`` and a
``GET /v1/responses/{id}`` are 404s.
Streaming sends named events (``event: <type>``, each with its ``sequence_number``):
``response.created``, ``response.in_progress``; the reasoning's ``output_item.added``,
``reasoning_text.delta``s, ``reasoning_text.done`` and ``output_item.done``; the message's ``output_item.added``,
``content_part.added``, ``output_text.delta``s, ``output_text.done``, ``content_part.done`` and
``output_item.done``; each call's ``output_item.added``, ``function_call_arguments.delta`` and
``.done``, ``output_item.done``; then ``response.completed`` (its status ``incomplete`` if cut short: vLLM's). An
error on the way is an ``error`` event, which ends the stream. There is no ``[DONE]``.
Costs: as a chat completion.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from ferrokv.checks import is_text, shown
from ferrokv.entrypoints.openai.protocol import REASONING_EFFORTS, ChatRequest, checked_content, parse_chat_request
from ferrokv.entrypoints.openai.protocol_fields import (OpenAIError, _bool, _lax_numbers, _logprobs, _object, bad,
                                                        error_body)
from ferrokv.entrypoints.openai.serving import (Acceptance, Generation, JSONBody, ServerState, SSEResponse,
                                               dumps, engine_request_id, generate_checked, run_generation,
                                               to_openai_error, watched)
from ferrokv.entrypoints.openai.serving_chat import ChatAnswer
from ferrokv.outputs import CompletionOutput

__all__ = ["create_response", "parse_responses_request"]

# The request's fields that mean the same on the chat path (vLLM's extras among them).
_PASSED_ON = ("model", "stream", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
              "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos", "min_tokens",
              "logit_bias", "skip_special_tokens", "priority", "cache_salt", "request_id", "chat_template",
              "chat_template_kwargs", "parallel_tool_calls", "user", "structured_outputs", "include_stop_str_in_output")
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_LOGPROBS_INCLUDE = "message.output_text.logprobs"
_INCLUDABLE = ("code_interpreter_call.outputs", "computer_call_output.output.image_url", "file_search_call.results",
               "message.input_image.image_url", _LOGPROBS_INCLUDE, "reasoning.encrypted_content")  # vLLM's
_SERVICE_TIERS = (None, "auto", "default", "flex", "scale", "priority")  # vLLM's
_PARTIAL = ("in_progress", "incomplete")  # an assistant message of this status is continued (vLLM's)


@dataclass(slots=True)
class ResponsesRequest:
    chat: ChatRequest
    origins: list[str]  # the request field each chat message came from ("instructions", "input[2]")
    echoed: dict[str, Any]  # the request's own fields the response repeats

    def renamed(self, e: Exception) -> Exception:
        """An error of the chat path (a 400 or the template's ``ValueError``) in this API's names."""
        return _renamed(to_openai_error(e), self.origins) if isinstance(e, (OpenAIError, ValueError)) else e


def _renamed(e: OpenAIError, origins: list[str]) -> OpenAIError:
    """An error of the chat path, told in the Responses API's names."""
    def fix(s: str) -> str:
        s = re.sub(r"messages\[(\d+)\]", lambda m: origins[int(m[1])] if int(m[1]) < len(origins) else m[0], s)
        s = re.sub(r"\bmessages\b", "input", s)
        # A replayed call is one message of one call; its output a tool message.
        s = re.sub(r"(input\[\d+\])\.tool_calls\[0\]\.function\.", r"\1.", s)
        s = re.sub(r"(input\[\d+\])\.tool_call_id", r"\1.call_id", s)
        # Chat's named tool_choice shape (a placeholder or a real name) in this API's flat one.
        s = re.sub(r"""\{(['"])type\1: \1function\1, \1function\1: \{\1name\1: ([^{}]*?)\}\}""",
                   r"{\1type\1: \1function\1, \1name\1: \2}", s)
        s = re.sub(r"\bmax_tokens\b", "max_output_tokens", s)
        s = s.replace("lower max_output_tokens or n,", "lower max_output_tokens,")  # a response has no n
        s = re.sub(r"response_format(\.json_schema)?", "text.format", s)
        return re.sub(r"(tools\[\d+\]|tool_choice)\.function\b", r"\1", s)
    return e.renamed(fix)


def _string(value: Any, where: str) -> str:
    if not is_text(value):
        raise bad(where, f"{where} must be a string of valid Unicode, got {shown(value)}")
    return value


def _repeatable(value: Any, where: str) -> Any:
    """``value`` (a field the response repeats), checked to render as strict JSON text: no
    NaN/Infinity, no lone surrogate (a 400 naming the field, before anything runs)."""
    if isinstance(value, float) and not math.isfinite(value) or isinstance(value, str) and not is_text(value):
        raise bad(where, f"{where} must hold only finite numbers and valid Unicode, got {shown(value)}")
    if isinstance(value, Mapping):
        for k, v in value.items():
            _repeatable(k, where)
            _repeatable(v, where)
    elif isinstance(value, list):
        for v in value:
            _repeatable(v, where)
    return value


def _input_item(item: Any, where: str) -> dict[str, Any] | None:
    """One ``input`` item as a chat message (None: one the conversation leaves out)."""
    if not isinstance(item, Mapping):
        raise bad(where, f"{where} must be an object (a message or a function call item), got {shown(item)}")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise bad(f"{where}.role", f"{where}.role must be one of {sorted(_ROLES)}, got {shown(role)}")
        if item.get("content") is None:  # required in OpenAI's message items (a string or a list of parts)
            raise bad(f"{where}.content", f"{where}.content must be a string or a list of content parts, got "
                                          f"{shown(item.get('content'))}")
        return {"role": _ROLES[role], "content": item["content"]}
    if kind == "function_call":
        call = {"id": _string(item.get("call_id"), f"{where}.call_id"), "type": "function",
                "function": {"name": _string(item.get("name"), f"{where}.name"),
                             "arguments": _string(item.get("arguments"), f"{where}.arguments")}}
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if kind == "function_call_output":
        output = item.get("output")  # a string, or a list of text parts
        return {"role": "tool", "tool_call_id": _string(item.get("call_id"), f"{where}.call_id"),
                "content": checked_content(output, f"{where}.output", "tool") if isinstance(output, list)
                else _string(output, f"{where}.output")}
    if kind == "reasoning":
        return None  # as vLLM: earlier reasoning does not reach the template
    raise bad(f"{where}.type", f"{where}.type must be 'message', 'function_call', 'function_call_output' or "
                               f"'reasoning', got {shown(kind)}")


def _conversation(instructions: Any, value: Any) -> tuple[list[dict[str, Any]], list[str]]:
    messages, origins = [], []
    if instructions is not None and _string(instructions, "instructions"):  # as vLLM: "" adds no system turn
        messages.append({"role": "system", "content": instructions})
        origins.append("instructions")
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
        origins.append("input")
    elif isinstance(value, list) and value:
        for i, item in enumerate(value):
            m = _input_item(item, f"input[{i}]")
            if m is not None:
                messages.append(m)
                origins.append(f"input[{i}]")
    else:
        raise bad("input", f"input must be a string or a non-empty list of items, got {shown(value)}")
    if origins[-1:] in ([], ["instructions"]):
        raise bad("input", "input must hold at least one message (reasoning items are left out)")
    return messages, origins


def _text_format(text: Any) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``."""
    if text is None:
        return None
    if not isinstance(text, Mapping):
        raise bad("text", f"text must be an object such as {{'format': {{'type': 'text'}}}}, got {shown(text)}")
    fmt = text.get("format")
    if not isinstance(fmt, Mapping) or fmt.get("type") != "json_schema":
        return fmt  # type: ignore[return-value]  # checked as response_format
    if not isinstance(fmt.get("name"), str) or not fmt["name"]:  # OpenAI's and vLLM's: required
        raise bad("text.format.name", f"text.format.name must name the schema, got {shown(fmt.get('name'))}")
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}


def _chat_tools(tools: Any) -> list[Any] | None:
    """Responses' flat function tools (``{"type": "function", "name", "parameters"}``) in chat's shape."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad("tools", f"tools must be a list of function tools, got {shown(tools)}")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, Mapping) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, Mapping) else t
            raise bad(f"tools[{i}]", f"tools[{i}] must be a function tool ({{'type': 'function', 'name': ...}}): "
                                     f"this server runs no built-in tools, got {shown(kind)}")
        out.append({"type": "function", "function": {k: v for k, v in t.items() if k != "type"}})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    """Responses' ``tool_choice`` in chat's shape (a string is checked there)."""
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, Mapping) and choice.get("type") == "function" and "function" not in choice:
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise bad("tool_choice.name", f"tool_choice.name must name the function to call, got {shown(name)}")
        return {"type": "function", "function": {"name": name}}
    raise bad("tool_choice", "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}, "
                             f"got {shown(choice)}")


def _one_of(body: Mapping[str, Any], name: str, allowed: tuple[Any, ...], default: Any, where: str = "") -> Any:
    v = body.get(name, default)
    if v not in allowed:
        raise bad(where + name, f"{where + name} must be one of {list(allowed)}, got {shown(v)}")
    return default if v is None else v


def _echoed(body: Mapping[str, Any], top: int | None, params: Any) -> dict[str, Any]:
    """The request's fields a response repeats, checked as vLLM's pydantic model checks them."""
    for name in ("metadata", "reasoning", "text", "tools", "tool_choice", "instructions"):
        _repeatable(body.get(name), name)
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, Mapping) and all(
            isinstance(k, str) and isinstance(v, str) and is_text(k + v) for k, v in metadata.items())):
        raise bad("metadata", f"metadata must map strings to strings, got {shown(metadata)}")
    max_tool_calls = body.get("max_tool_calls")
    if max_tool_calls is not None and not (type(max_tool_calls) is int and max_tool_calls >= 1):
        raise bad("max_tool_calls", f"max_tool_calls must be None or an int >= 1, got {shown(max_tool_calls)}")
    text = body.get("text") or {"format": {"type": "text"}}
    _one_of(text, "verbosity", (None, "low", "medium", "high"), None, where="text.")
    _bool(body, "store", True)  # checked, then ignored: nothing is stored (vLLM's default)
    return {"instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "metadata": metadata, "parallel_tool_calls": _bool(body, "parallel_tool_calls", True),
            "previous_response_id": None, "reasoning": body.get("reasoning"), "store": False,
            "max_tool_calls": max_tool_calls,
            "service_tier": _one_of(body, "service_tier", _SERVICE_TIERS, "auto"),
            "text": text, "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
            "top_logprobs": top, "truncation": _one_of(body, "truncation", ("auto", "disabled", None), "disabled"),
            "user": body.get("user"), "background": False, "temperature": params.temperature, "top_p": params.top_p}


def _refuse_unserved(body: Mapping[str, Any]) -> list[str]:
    """The fields this server cannot serve are 400s (404s for stored responses); returns ``include``."""
    if _bool(body, "background", False):
        raise bad("background", "background is not supported: this server stores no responses (as vLLM without "
                                "VLLM_ENABLE_RESPONSES_API_STORE)")
    if (previous := body.get("previous_response_id")) is not None:
        if not isinstance(previous, str):
            raise bad("previous_response_id", f"previous_response_id must be a string, got {shown(previous)}")
        raise OpenAIError(404, f"previous_response_id: no response {shown(previous)}: this "
                               "server stores no responses", "previous_response_id")
    if body.get("prompt") is not None:
        raise bad("prompt", f"prompt (a stored prompt template) is not supported, got {shown(body['prompt'])}")
    include = body.get("include") or []
    if not isinstance(include, list) or not all(isinstance(x, str) and x in _INCLUDABLE for x in include):
        raise bad("include", f"include must be a list of {list(_INCLUDABLE)}, got {shown(include)}")
    return include


def _chat_body(body: Mapping[str, Any], messages: list[dict[str, Any]], include: list[str], top: int | None,
               effort: str | None) -> dict[str, Any]:
    """The chat request this response is made by (``parse_chat_request`` checks it)."""
    chat: dict[str, Any] = {k: body[k] for k in _PASSED_ON if k in body}
    chat["messages"] = messages
    tools, tool_choice = _chat_tools(body.get("tools")), _chat_tool_choice(body.get("tool_choice"))
    if not tools and tool_choice in ("auto", "none"):
        tool_choice = None  # vLLM's: with no tools, "auto" (the API's default) and "none" are plain text
    extra = {"max_tokens": body.get("max_output_tokens"), "response_format": _text_format(body.get("text")),
             "tools": tools or None, "tool_choice": tool_choice}
    chat.update({k: v for k, v in extra.items() if v is not None})
    if _LOGPROBS_INCLUDE in include:  # vLLM's: logprobs only when included, top_logprobs alternatives each
        chat.update(logprobs=True, top_logprobs=top or 0)
    if _one_of(body, "truncation", ("auto", "disabled", None), "disabled") == "auto":
        chat["truncate_prompt_tokens"] = -1  # vLLM's: the prompt's last tokens that fit
    last = body["input"][-1] if isinstance(body["input"], list) else None
    if isinstance(last, Mapping) and last.get("type", "message") == "message" and last.get("role") == "assistant" \
            and last.get("status") in _PARTIAL:
        chat.update(add_generation_prompt=False, continue_final_message=True)  # the answer goes on
    if effort is not None:
        chat["reasoning_effort"] = effort  # the chat path's, as vLLM's build_chat_params gives it the template
    return chat


def _reasoning_effort(body: Mapping[str, Any]) -> str | None:
    reasoning = body.get("reasoning")
    if reasoning is not None and not (isinstance(reasoning, Mapping) and reasoning.get("effort") in
                                      (None, *REASONING_EFFORTS)):
        raise bad("reasoning", f"reasoning must be an object such as {{'effort': 'low'}} (effort one of "
                               f"{list(REASONING_EFFORTS)}), got {shown(reasoning)}")
    return None if reasoning is None else reasoning.get("effort")


def parse_responses_request(body: Any, defaults: Mapping[str, Any], max_logprobs: int,
                            tool_call_parser: str | None) -> ResponsesRequest:
    body = _lax_numbers(_object(body), ("max_output_tokens", "top_logprobs", "top_k", "seed", "min_tokens",
                                        "priority", "max_tool_calls"))
    include = _refuse_unserved(body)
    top = _logprobs(body, "top_logprobs", max_logprobs)
    messages, origins = _conversation(body.get("instructions"), body.get("input"))
    chat = _chat_body(body, messages, include, top, _reasoning_effort(body))
    try:
        req = parse_chat_request(chat, defaults=defaults, max_logprobs=max_logprobs, tool_call_parser=tool_call_parser)
    except OpenAIError as e:
        raise _renamed(e, origins) from None
    if body.get("tool_choice") == "none":
        req.template["tools"] = None  # vLLM's construct_tool_dicts: the template sees no tools
    return ResponsesRequest(req, origins, _echoed(body, top, req.params))


class _Response:
    """One response's ids and items, as the chat path's answer (``ChatAnswer``) fills them."""

    def __init__(self, req: ResponsesRequest, call: ChatAnswer, rid: str, cache_block: int | None) -> None:
        self.req = req
        self.call = call
        self.cache_block = cache_block  # the KV block size with prefix caching on, else None
        self.id = rid
        self.msg_id = f"msg_{uuid.uuid4().hex}"
        self.rs_id = f"rs_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.seq = -1
        self.token_ids: list[int] = []  # the answer's tokens so far (its usage counts the reasoning's)
        self.reasoning_parts: list[str] | None = None  # the streamed reasoning, once some came
        self.reasoning_status: str | None = None  # its item's, once closed (by content or calls after it, or the end)

    @property
    def msg_index(self) -> int:
        """The message item's place in ``output``: after the reasoning item, when there is one."""
        return 0 if self.reasoning_parts is None else 1

    def reasoning_item(self, text: str, status: str | None) -> dict[str, Any]:
        return {"type": "reasoning", "id": self.rs_id, "summary": [],
                "content": [{"type": "reasoning_text", "text": text}], "encrypted_content": None, "status": status}

    def body(self, status: str, output: list[Any]) -> dict[str, Any]:
        incomplete = status == "incomplete"
        return {"id": self.id, "object": "response", "created_at": self.created_at, "model": self.call.head["model"],
                "status": status, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "output": output, **self.req.echoed,
                "usage": self._usage() if status in ("completed", "incomplete") else None}

    def _usage(self) -> dict[str, Any]:
        u = self.call.usage()
        # Written to the cache: the prompt's full blocks this request computed (the prefix cache keeps them).
        block = self.cache_block
        written = max(0, u["prompt_tokens"] // block * block - self.call.cached) if block else 0
        return {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
                "total_tokens": u["total_tokens"],
                "input_tokens_details": {"cached_tokens": self.call.cached, "cache_write_tokens": written},
                "output_tokens_details": {"reasoning_tokens": self.call.reasoning_tokens(self.token_ids)}}

    def text_part(self, text: str, c: CompletionOutput) -> dict[str, Any]:
        lp = self.call.logprobs(c)
        part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
        if self.call.req.logprobs:
            part["logprobs"] = lp["content"] if lp else []
        return part

    def message(self, status: str, parts: list[Any]) -> dict[str, Any]:
        return {"type": "message", "id": self.msg_id, "status": status, "role": "assistant", "content": parts}

    @staticmethod
    def function_call(call: Mapping[str, Any], status: str) -> dict[str, Any]:
        f = call["function"]
        args = f["arguments"] if isinstance(f["arguments"], str) else json.dumps(f["arguments"], ensure_ascii=False)
        return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": f"call_{uuid.uuid4().hex}",
                "name": f["name"],
                "arguments": args, "status": status}

    def output(self, c: CompletionOutput) -> list[Any]:
        m = self.call.message(c)
        status = _status(c)
        calls = [self.function_call(tc, status) for tc in m.get("tool_calls") or ()]
        text = m["content"] or ""
        # An answer of reasoning alone has no message (vLLM's).
        reasoning = m.get("reasoning")
        done = _reasoning_status(bool(text or calls), status)
        thought = [] if reasoning is None else [self.reasoning_item(reasoning, done)]
        items = [self.message(status, [self.text_part(text, c)])] if text or not (calls or thought) else []
        return thought + items + calls

    def event(self, kind: str, **fields: Any) -> str:
        self.seq += 1
        return f"event: {kind}\ndata: {dumps({'type': kind, 'sequence_number': self.seq, **fields})}\n\n"


def _status(c: CompletionOutput) -> str:
    """The response's, and its items' (a cut one's text or call ends early)."""
    return "incomplete" if c.finish_reason == "length" else "completed"


async def create_response(request: Request, state: ServerState, body: Any) -> Any:
    req = parse_responses_request(body, state.llm.default_sampling_params, state.llm.engine.args.max_logprobs,
                                  state.tool_call_parser)
    chat = req.chat
    model = state.check_model(chat.model)
    template = state.template_for(chat.template)
    state.admit(1, chat.params.n)
    rid = f"resp_{request.headers.get('x-request-id') or chat.request_id or uuid.uuid4().hex}"
    call = ChatAnswer(chat, model, int(time.time()), "assistant", rid, state.reasoning,
                      template.get("chat_template_kwargs"))
    args = state.llm.engine.args
    resp = _Response(req, call, rid, args.block_size if args.enable_prefix_caching else None)
    engine_id = engine_request_id(rid)
    accepted = Acceptance(1)  # (the metrics count a request the engine took, ended before any output)

    async def prompt_then_generate() -> Any:
        ids = await state.llm.encode_chat(chat.messages, chat.add_generation_prompt, **template)
        async for out in generate_checked(state.llm, {"prompt_token_ids": ids}, chat.params, engine_id, "input",
                                          asked_max_tokens=chat.asked_max_tokens, priority=chat.priority,
                                          cache_salt=chat.cache_salt, on_accepted=accepted.of(0)):
            yield out

    async def respond(gen: Generation) -> Any:
        if chat.stream:
            return SSEResponse(_stream(gen, resp), gen)
        (out,) = await watched(request, gen.finals())
        call.count(out)
        c = out.outputs[0]
        resp.token_ids = list(c.token_ids)
        output = resp.output(c)
        return JSONBody(resp.body(_status(c), output))

    def engine_error(e: Exception) -> Exception:
        return req.renamed(chat.engine_error(e))

    return await run_generation(request, state, [prompt_then_generate()], chat.params, respond, engine_error,
                                accepted)


async def _stream(gen: Generation, resp: _Response) -> Any:
    call = resp.call
    text: list[str] = []
    lps: list[Any] = []
    sent = 0  # logprobs sent so far: a token that completes no character yet goes with the next delta
    try:
        yield resp.event("response.created", response=resp.body("in_progress", []))
        yield resp.event("response.in_progress", response=resp.body("in_progress", []))
        last: CompletionOutput | None = None
        async for _, out in gen.outputs():
            call.count(out)
            c = last = out.outputs[0]
            resp.token_ids += c.token_ids
            answer = call.delta(c)
            delta = answer.get("content") or ""
            lps += (call.logprobs(c) or {}).get("content") or []
            if answer.get("reasoning"):
                yield _reasoning_delta(resp, answer["reasoning"])
                if not delta:
                    sent = len(lps)  # the reasoning's tokens: listed in the message's done event, as vLLM's
            if delta:
                if not text:
                    yield _close_reasoning(resp, _reasoning_status(True, _status(c))) + _open_message(resp)
                text.append(delta)
                yield _delta(resp, delta, lps[sent:])
                sent = len(lps)
        assert last is not None
        yield "".join(_close(resp, last, "".join(text), lps, sent))
    except Exception as e:
        err = to_openai_error(e)
        yield resp.event("error", code=str(err.status), message=err.message, param=err.param)
    finally:
        await gen.close()


def _reasoning_status(followed: bool, status: str) -> str:
    """The reasoning item's status: complete once text or calls follow it, else the answer's."""
    return "completed" if followed else status


def _reasoning_delta(resp: _Response, delta: str) -> str:
    """The reasoning item's next text (its item opened first)."""
    opened = ""
    if resp.reasoning_parts is None:
        resp.reasoning_parts = []
        opened = resp.event("response.output_item.added", output_index=0, item=resp.reasoning_item("", "in_progress"))
    resp.reasoning_parts.append(delta)
    return opened + resp.event("response.reasoning_text.delta", item_id=resp.rs_id, output_index=0, content_index=0,
                               delta=delta)


def _close_reasoning(resp: _Response, status: str) -> str:
    """The reasoning item's last events, once (none when there was no reasoning)."""
    if resp.reasoning_parts is None or resp.reasoning_status is not None:
        return ""
    resp.reasoning_status = status
    text = "".join(resp.reasoning_parts)
    return (resp.event("response.reasoning_text.done", item_id=resp.rs_id, output_index=0, content_index=0, text=text)
            + resp.event("response.output_item.done", output_index=0, item=resp.reasoning_item(text, status)))


def _open_message(resp: _Response) -> str:
    i = resp.msg_index
    return (resp.event("response.output_item.added", output_index=i, item=resp.message("in_progress", []))
            + resp.event("response.content_part.added", item_id=resp.msg_id, output_index=i, content_index=0,
                         part={"type": "output_text", "text": "", "annotations": []}))


def _delta(resp: _Response, delta: str, logprobs: list[Any]) -> str:
    return resp.event("response.output_text.delta", item_id=resp.msg_id, output_index=resp.msg_index, content_index=0,
                      delta=delta, logprobs=logprobs)


def _close(resp: _Response, c: CompletionOutput, text: str, lps: list[Any], sent: int) -> list[str]:
    """The events after the last token: the message's ends, the calls, then ``response.completed``
    (also for an incomplete response, as vLLM ends every stream and the openai client expects)."""
    status = _status(c)
    calls = [resp.function_call(tc, status) for tc in resp.call.answered_calls(0)]
    events = [_close_reasoning(resp, _reasoning_status(bool(calls), status))]  # (text after it closed it already)
    parts = resp.reasoning_parts
    output = [] if parts is None else [resp.reasoning_item("".join(parts), resp.reasoning_status)]
    i = resp.msg_index
    if text or not (calls or output):
        if not text:
            events.append(_open_message(resp))
        if sent < len(lps):
            events.append(_delta(resp, "", lps[sent:]))
        part = {"type": "output_text", "text": text, "annotations": []}
        if resp.call.req.logprobs:
            part["logprobs"] = lps
        item = resp.message(status, [part])
        events += [resp.event("response.output_text.done", item_id=resp.msg_id, output_index=i, content_index=0,
                              text=text, logprobs=lps),
                   resp.event("response.content_part.done", item_id=resp.msg_id, output_index=i, content_index=0,
                              part=part),
                   resp.event("response.output_item.done", output_index=i, item=item)]
        output.append(item)
    for fc in calls:
        i = len(output)
        events += [resp.event("response.output_item.added", output_index=i, item={**fc, "arguments": "",
                                                                                 "status": "in_progress"}),
                   resp.event("response.function_call_arguments.delta", item_id=fc["id"], output_index=i,
                              delta=fc["arguments"]),
                   resp.event("response.function_call_arguments.done", item_id=fc["id"], output_index=i,
                              arguments=fc["arguments"]),
                   resp.event("response.output_item.done", output_index=i, item=fc)]
        output.append(fc)
    events.append(resp.event("response.completed", response=resp.body(status, output)))
    return events


def not_found(response_id: str) -> JSONBody:
    """``GET``/``DELETE /v1/responses/{id}`` and its ``cancel``: nothing is stored (vLLM's 404)."""
    err = OpenAIError(404, f"response {response_id!r} not found: this server stores no responses", "response_id")
    return JSONBody(error_body(err), status_code=404)
