"""The OpenAI wire format: request bodies -> checked requests (with their ``SamplingParams``),
and the errors and response pieces the endpoints send back.

Invariants: every parser takes the decoded JSON as it came (any type) and either returns a
request whose fields have the right types, or raises ``OpenAIError(400, ...)`` whose message
names the field and its value (``param`` is the field). The sampling rules live in
``SamplingParams.validate``: its ``ValueError`` is mapped here, never repeated. ``null`` means
"not given" for every optional field, as OpenAI's clients send it.
Costs: O(size of the body) per request; nothing here touches torch or the engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from ferrokv.checks import shown
from ferrokv.outputs import RequestOutputKind
from ferrokv.sampling_params import SamplingParams

__all__ = [
    "MAX_LOGPROBS", "ChatRequest", "CompletionRequest", "OpenAIError", "error_body", "parse_chat_request",
    "parse_completion_request", "parse_detokenize_request", "parse_tokenize_request",
]

MAX_LOGPROBS = 20  # most top alternatives per token (OpenAI's and vLLM's default cap)

# Request field -> SamplingParams field, for the knobs that map one to one.
_SAMPLING_FIELDS = (
    "n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
    "skip_special_tokens", "include_stop_str_in_output",
)
_SAMPLING_NAMES = {f.name for f in fields(SamplingParams)}
# OpenAI fields this server does not implement: refused when set to anything but their no-op value.
_UNSUPPORTED = {"suffix": (None, ""), "echo": (None, False), "best_of": (None, 1), "logit_bias": (None, {}),
                "tools": (None, []), "functions": (None, []), "response_format": (None, {"type": "text"}),
                "prompt_logprobs": (None, 0)}
_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                405: "MethodNotAllowedError", 413: "RequestTooLargeError", 503: "ServiceUnavailableError"}


class OpenAIError(Exception):
    """An error the server answers with ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or _ERROR_TYPES.get(status, "InternalServerError")


def error_body(err: OpenAIError) -> dict[str, Any]:
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.status}}


def bad(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, message, param)


# ------------------------------------------------------------------------------------------------
# Field readers: each returns the value (or the default when absent/null) or raises a 400.
def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _opt(body: Mapping[str, Any], name: str, default: Any = None) -> Any:
    v = body.get(name)
    return default if v is None else v


def _int(body: Mapping[str, Any], name: str, default: Any, lo: int, hi: int) -> Any:
    v = _opt(body, name)
    if v is None:
        return default
    if not _is_int(v) or not lo <= v <= hi:
        raise bad(name, f"{name} must be an integer in [{lo}, {hi}], got {shown(v)}")
    return v


def _bool(body: Mapping[str, Any], name: str, default: bool) -> bool:
    v = _opt(body, name, default)
    if not isinstance(v, bool):
        raise bad(name, f"{name} must be a boolean, got {shown(v)}")
    return v


def _str(body: Mapping[str, Any], name: str) -> str | None:
    v = _opt(body, name)
    if v is not None and not isinstance(v, str):
        raise bad(name, f"{name} must be a string, got {shown(v)}")
    return v


def _object(body: Any, what: str = "the request body") -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise bad(None, f"{what} must be a JSON object, got {shown(body)}")  # type: ignore[arg-type]
    return body


# ------------------------------------------------------------------------------------------------
# Sampling parameters
_I64 = (1 << 63) - 1
_I32 = (1 << 31) - 1


def sampling_params(body: Mapping[str, Any], max_tokens: int | None, logprobs: int | None,
                    kind: RequestOutputKind) -> SamplingParams:
    """The request's ``SamplingParams``; their own checks, mapped to a 400 naming the field."""
    for name, (*noop,) in _UNSUPPORTED.items():
        if body.get(name) not in noop:
            raise bad(name, f"{name} is not supported by this server, got {shown(body.get(name))}")
    kw: dict[str, Any] = {k: body[k] for k in _SAMPLING_FIELDS if body.get(k) is not None}
    for name, hi in (("seed", _I64), ("top_k", _I32), ("min_tokens", _I32), ("n", 128)):
        if name in kw and _is_int(kw[name]) and not -_I64 - 1 <= kw[name] <= hi:
            raise bad(name, f"{name} must be at most {hi}, got {kw[name]}")
    if "stop" in kw and not isinstance(kw["stop"], (str, list)):
        raise bad("stop", f"stop must be a string or a list of strings, got {shown(kw['stop'])}")
    if "stop_token_ids" in kw and not isinstance(kw["stop_token_ids"], list):
        raise bad("stop_token_ids", f"stop_token_ids must be a list of integers, got {shown(kw['stop_token_ids'])}")
    try:
        return SamplingParams(**kw, max_tokens=max_tokens, logprobs=logprobs, output_kind=kind)
    except ValueError as e:
        name = str(e).split(" ", 1)[0]
        raise bad(name if name in _SAMPLING_NAMES else None, str(e)) from None  # type: ignore[arg-type]


def _max_tokens(body: Mapping[str, Any], default: int | None) -> int | None:
    """``max_completion_tokens`` (OpenAI's newer name) wins over ``max_tokens``."""
    for name in ("max_completion_tokens", "max_tokens"):
        if body.get(name) is not None:
            v = body[name]
            if not _is_int(v) or not 1 <= v <= _I32:
                raise bad(name, f"{name} must be an integer in [1, {_I32}], got {shown(v)}")
            return v
    return default


# ------------------------------------------------------------------------------------------------
# Requests
@dataclass(slots=True)
class _Common:
    model: str | None
    stream: bool
    include_usage: bool
    params: SamplingParams
    user: str | None
    priority: int
    cache_salt: str | None


def _common(body: Mapping[str, Any], params: SamplingParams) -> dict[str, Any]:
    stream = _bool(body, "stream", False)
    opts = _opt(body, "stream_options", {})
    opts = _object(opts, "stream_options")
    include_usage = _bool(opts, "include_usage", False)
    if opts and not stream:
        raise bad("stream_options", "stream_options is only allowed with stream: true")
    salt = _str(body, "cache_salt")
    if salt is not None and not salt:
        raise bad("cache_salt", "cache_salt must be a non-empty string")
    return dict(model=_str(body, "model"), stream=stream, include_usage=include_usage, params=params,
                user=_str(body, "user"), priority=_int(body, "priority", 0, -_I32 - 1, _I32), cache_salt=salt)


@dataclass(slots=True)
class CompletionRequest(_Common):
    prompts: list[Any] = field(default_factory=list)  # each a str or {"prompt_token_ids": [...]}
    logprobs: int | None = None


def _prompts(value: Any) -> list[Any]:
    """``prompt``: a string, a list of strings, a list of token ids or a list of such lists."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value):
            return list(value)
        if all(_is_int(t) for t in value):
            return [{"prompt_token_ids": value}]
        if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in value):
            return [{"prompt_token_ids": p} for p in value]
    raise bad("prompt", "prompt must be a string, a list of strings, a list of token ids or a list of "
                        f"lists of token ids (none empty), got {shown(value)}")


def parse_completion_request(body: Any, stream_kind: RequestOutputKind = RequestOutputKind.DELTA) -> CompletionRequest:
    body = _object(body)
    if body.get("prompt") is None:
        raise bad("prompt", "prompt is required")
    prompts = _prompts(body["prompt"])
    logprobs = _int(body, "logprobs", None, 0, MAX_LOGPROBS)
    kind = stream_kind if _bool(body, "stream", False) else RequestOutputKind.FINAL_ONLY
    params = sampling_params(body, _max_tokens(body, 16), logprobs, kind)
    return CompletionRequest(**_common(body, params), prompts=prompts, logprobs=logprobs)


@dataclass(slots=True)
class ChatRequest(_Common):
    messages: list[dict[str, str]] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0
    add_generation_prompt: bool = True


def _content(i: int, content: Any) -> Any:
    """A message's content: a string, or a list of ``{"type": "text", "text": ...}`` parts (joined)."""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad(f"messages[{i}].content[{j}]", f"messages[{i}].content[{j}] must be a "
                          f"{{'type': 'text', 'text': ...}} part (only text is supported), got {shown(part)}")
            parts.append(part["text"])
        return "".join(parts)
    return content


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise bad("messages", f"messages must be a non-empty list of {{'role': ..., 'content': ...}} objects, "
                              f"got {shown(value)}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, Mapping):
            raise bad(f"messages[{i}]", f"messages[{i}] must be an object with 'role' and 'content', got {shown(m)}")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str) and not (key == "content" and isinstance(m.get(key), list)):
                raise bad(f"messages[{i}].{key}", f"messages[{i}].{key} must be a string, got {shown(m.get(key))}")
        out.append({"role": m["role"], "content": _content(i, m["content"])})
    return out


def parse_chat_request(body: Any, stream_kind: RequestOutputKind = RequestOutputKind.DELTA) -> ChatRequest:
    body = _object(body)
    messages = _messages(body.get("messages"))
    want_logprobs = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", None, 0, MAX_LOGPROBS)
    if top is not None and not want_logprobs:
        raise bad("top_logprobs", "top_logprobs needs logprobs: true")
    kind = stream_kind if _bool(body, "stream", False) else RequestOutputKind.FINAL_ONLY
    params = sampling_params(body, _max_tokens(body, None), (top or 0) if want_logprobs else None, kind)
    return ChatRequest(**_common(body, params), messages=messages, logprobs=want_logprobs, top_logprobs=top or 0,
                       add_generation_prompt=_bool(body, "add_generation_prompt", True))


@dataclass(slots=True)
class TokenizeRequest:
    model: str | None
    prompt: str | None
    messages: list[dict[str, Any]] | None
    add_special_tokens: bool
    add_generation_prompt: bool


def parse_tokenize_request(body: Any) -> TokenizeRequest:
    """vLLM's ``/tokenize``: ``{model?, prompt | messages, add_special_tokens?}``."""
    body = _object(body)
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        raise bad("prompt", "give exactly one of prompt and messages")
    prompt = _str(body, "prompt")
    messages = _messages(body["messages"]) if has_messages else None
    return TokenizeRequest(_str(body, "model"), prompt, messages,
                           _bool(body, "add_special_tokens", not has_messages),
                           _bool(body, "add_generation_prompt", True))


@dataclass(slots=True)
class DetokenizeRequest:
    model: str | None
    tokens: list[int]


def parse_detokenize_request(body: Any, vocab_size: int) -> DetokenizeRequest:
    """vLLM's ``/detokenize``: ``{model?, tokens}``; every id inside the vocabulary."""
    body = _object(body)
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise bad("tokens", f"tokens must be a list of integers, got {shown(tokens)}")
    for i, t in enumerate(tokens):
        if not _is_int(t) or not 0 <= t < vocab_size:
            raise bad("tokens", f"tokens[{i}] must be an integer in [0, {vocab_size}), got {shown(t)}")
    return DetokenizeRequest(_str(body, "model"), tokens)
