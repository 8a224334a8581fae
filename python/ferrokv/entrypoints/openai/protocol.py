"""The OpenAI wire format: request bodies -> checked requests (with their ``SamplingParams``);
the errors and the field readers are ``protocol_fields``'s.

Invariants: every parser takes the decoded JSON as it came (any type) and either returns a
request whose fields have the right types, or raises ``OpenAIError(400, ...)`` whose message
names the field and its value (``param`` is the field). The sampling rules live in
``SamplingParams.validate`` (and ``StructuredOutputsParams.validate``): their ``ValueError`` is
mapped here, never repeated. ``null`` means "not given" for every optional field, as OpenAI's
clients send it.

Structured outputs come from one of: OpenAI's ``response_format`` (``json_object`` or
``json_schema``), vLLM's ``structured_outputs`` object, or vLLM's older ``guided_json`` /
``guided_regex`` / ``guided_choice`` / ``guided_grammar`` (with ``guided_whitespace_pattern``);
two of them at once is a 400. Errors about the constraint, here or later from the engine (a
grammar that does not compile), are told in the request's own names (``StructuredSource``).
``logit_bias`` is OpenAI's ``{"token id": bias}``, each bias clamped to [-100, 100] as vLLM does.
Costs: O(size of the body) per request; nothing here touches torch or the engine.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

from ferrokv.checks import shown
from ferrokv.engine_args import EngineArgs
from ferrokv.entrypoints.openai.protocol_fields import (_BOOL_FIELDS, _INT_FIELDS, OpenAIError, _bool, _int, _is_int,
                                                        _lax_numbers, _logprobs, _object, _opt, _str, bad, error_body)
from ferrokv.entrypoints.openai.tool_calls import ToolChoice, ToolError, parse_tools
from ferrokv.inputs import check_documents, message_text, message_tool_fields
from ferrokv.outputs import RequestOutputKind
from ferrokv.sampling_params import SamplingParams
from ferrokv.structured_outputs import StructuredOutputsParams

__all__ = [
    "ChatRequest", "CompletionRequest", "OpenAIError", "error_body", "parse_chat_request",
    "StructuredSource", "parse_completion_request",
]

# The engine's cap when a caller gives none (EngineArgs' default).
_DEFAULT_MAX_LOGPROBS: int = EngineArgs.__dataclass_fields__["max_logprobs"].default

# Request field -> SamplingParams field, for the knobs that map one to one.
_SAMPLING_FIELDS = (
    "n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
    "skip_special_tokens", "include_stop_str_in_output", "truncate_prompt_tokens", "spaces_between_special_tokens",
)
_SAMPLING_NAMES = {f.name for f in fields(SamplingParams)}
# vLLM's reasoning_effort values (the openai SDK's ReasoningEffort).
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
# OpenAI's and vLLM's fields this server does not implement: refused when set to anything but
# their no-op value (a field that would change the output is never ignored).
_UNSUPPORTED = {"suffix": (None, ""), "best_of": (None, 1), "functions": (None, []),
                "function_call": (None, "none", "auto"), "structural_tag": (None,), "truncation_side": (None, "left"),
                "logprob_token_ids": (None, []), "thinking_token_budget": (None,), "repetition_detection": (None,),
                "prompt_embeds": (None,)}
_INSTEAD = {"functions": "; give them in tools (type 'function')", "function_call": "; use tool_choice",
            "truncation_side": " (only 'left': truncate_prompt_tokens keeps the prompt's last tokens)"}
# vLLM's request fields that change nothing here (ferrokv has one structured-output backend, no
# multimodal or disaggregated inputs, no beam length penalty on this path; include_reasoning acts
# only on a chat under a reasoning parser):
# accepted, and refused like vLLM's pydantic models refuse them when their type is wrong.
_NUMBER, _BOOLEAN = ((int, float), "a number"), ((bool,), "a boolean")
_STRING, _OBJECT = ((str,), "a string"), ((dict,), "an object")
_IGNORED_TYPES: Mapping[str, tuple[tuple[type, ...], str]] = MappingProxyType({
    "length_penalty": _NUMBER, "early_stopping": _BOOLEAN, "include_reasoning": _BOOLEAN,
    "guided_decoding_backend": _STRING, "mm_processor_kwargs": _OBJECT, "kv_transfer_params": _OBJECT,
    "vllm_xargs": _OBJECT})
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a bias; vLLM clamps to it
_TOKEN_ID_KEY = re.compile(r"\d{1,18}")
# ------------------------------------------------------------------------------------------------
# Sampling parameters
_NO_DEFAULTS: Mapping[str, Any] = MappingProxyType({})
_I64 = (1 << 63) - 1
_I32 = (1 << 31) - 1


def sampling_params(body: Mapping[str, Any], max_tokens: int | None, logprobs: int | None, kind: RequestOutputKind,
                    defaults: Mapping[str, Any], max_logprobs: int = _DEFAULT_MAX_LOGPROBS,
                    tool_choice: ToolChoice | None = None) -> tuple[SamplingParams, StructuredSource | None]:
    """The request's ``SamplingParams`` (their own checks mapped to a 400 naming the field), and
    where its structured-output constraint came from (None: it has none). ``defaults`` (the
    model's generation config, ``ferrokv.generation_defaults``) fill the fields the request left
    out, and its ``max_tokens`` caps the request's, as in vLLM. A forced tool call's schema is
    the constraint, whatever else the request asks (vLLM's precedence); calls read from free
    text keep special tokens in it (tags may be ones)."""
    for name, (*noop,) in _UNSUPPORTED.items():
        if body.get(name) not in noop:
            raise bad(name, f"{name} is not supported by this server, got {shown(body.get(name))}"
                            f"{_INSTEAD.get(name, '')}")
    for name, (types, described) in _IGNORED_TYPES.items():
        v = body.get(name)
        if v is not None and not isinstance(v, types):  # read leniently first, as the other fields (_lax_numbers)
            raise bad(name, f"{name} must be {described}, got {shown(v)}")
    kw: dict[str, Any] = {k: v for k, v in defaults.items() if k != "max_tokens"}
    kw.update((k, body[k]) for k in _SAMPLING_FIELDS if body.get(k) is not None)
    cap = defaults.get("max_tokens")
    if cap is not None:
        max_tokens = cap if max_tokens is None else min(max_tokens, cap)
    # vLLM's int64 seed; a value too low for the others: SamplingParams names their own minimum.
    bounds = (("seed", -_I64 - 1, _I64), ("top_k", None, _I32), ("min_tokens", None, _I32), ("n", None, 128))
    for name, lo, hi in bounds:
        v = kw.get(name)
        if _is_int(v) and (v > hi or (lo is not None and v < lo)):
            raise bad(name, f"{name} must be in [{lo}, {hi}], got {v}" if lo is not None
                      else f"{name} must be at most {hi}, got {v}")
    if "stop" in kw and not isinstance(kw["stop"], (str, list)):
        raise bad("stop", f"stop must be a string or a list of strings, got {shown(kw['stop'])}")
    for name, what in (("stop_token_ids", "integers"), ("allowed_token_ids", "token ids"), ("bad_words", "strings")):
        v = body.get(name)
        if v is not None and not isinstance(v, list):
            raise bad(name, f"{name} must be a list of {what}, got {shown(v)}")
    if body.get("allowed_token_ids") is not None:
        kw["allowed_token_ids"] = body["allowed_token_ids"]
    if body.get("bad_words"):  # [] is vLLM's default: no bad words
        kw["bad_words"] = body["bad_words"]
    bias = _logit_bias(body.get("logit_bias"))
    if bias:
        kw["logit_bias"] = bias
    prompt_logprobs = _logprobs(body, "prompt_logprobs", max_logprobs)
    if prompt_logprobs is not None and _bool(body, "stream", False):
        # vLLM: a stream carries no prompt logprobs, so asking for alternatives is an error
        # and prompt_logprobs=0 is accepted and not computed.
        if prompt_logprobs != 0:
            raise bad("prompt_logprobs", f"prompt_logprobs are not available with stream: true, got "
                                         f"prompt_logprobs={prompt_logprobs}")
        prompt_logprobs = None
    structured, source = _structured(body)  # checked whatever the tools say, as vLLM checks it
    if tool_choice is not None and tool_choice.forced:
        structured, source = _tool_structured(tool_choice, _str(body, "guided_whitespace_pattern"))
    if tool_choice is not None and not tool_choice.forced:
        kw["skip_special_tokens"] = False  # vLLM's hermes parser: call tags may be special tokens
    try:
        params = SamplingParams(**kw, max_tokens=max_tokens, logprobs=logprobs, output_kind=kind,
                                prompt_logprobs=prompt_logprobs, structured_outputs=structured)
    except ValueError as e:
        m = re.match(r"[A-Za-z_]+", str(e))
        name = m.group(0) if m else None
        raise bad(name if name in _SAMPLING_NAMES else None, str(e)) from None  # type: ignore[arg-type]
    return params, source


def _logit_bias(value: Any) -> dict[int, float] | None:
    """OpenAI's ``{"token id": bias}`` -> ``{id: bias clamped to [-100, 100]}`` (ids checked
    against the vocabulary by the engine)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise bad("logit_bias", f"logit_bias must be an object mapping token ids (as strings) to biases, "
                                f"got {shown(value)}")
    out = {}
    for key, bias in value.items():
        if not isinstance(key, str) or not _TOKEN_ID_KEY.fullmatch(key):
            raise bad("logit_bias", f"logit_bias keys must be token ids (integers >= 0, as strings), got {shown(key)}")
        b = _lax_float(bias)
        if math.isnan(b):
            raise bad("logit_bias", f"logit_bias[{key!r}] must be a number, got {shown(bias)}")
        out[int(key)] = min(_LOGIT_BIAS_LIMIT, max(-_LOGIT_BIAS_LIMIT, b))
    return out


def _lax_float(value: Any) -> float:
    """A number as vLLM's pydantic reads a float field in lax mode (a bool, a numeric string); NaN
    for anything else, and for an int too large for a float, which pydantic refuses."""
    if isinstance(value, (bool, int, float, str)):
        with contextlib.suppress(ValueError, OverflowError):
            return float(value)
    return math.nan


@dataclass(frozen=True, slots=True)
class StructuredSource:
    """The request field a structured-output constraint came from, and how that field names
    the ``structured_outputs.<field>`` that ``StructuredOutputsParams`` and the engine's grammar
    compiler talk about."""

    param: str
    renames: tuple[tuple[str, str], ...] = ()

    def error(self, message: str) -> OpenAIError:
        """A 400 for a ``ValueError`` about the constraint, in the request's names; one about an
        option given in a field of its own (``guided_whitespace_pattern``) names that field."""
        param = self.param
        for old, new in self.renames:
            if old not in StructuredOutputsParams.KINDS and message.startswith(f"structured_outputs.{old} "):
                param = new
            message = re.sub(rf"\bstructured_outputs\.{old}\b", new, message)
        return bad(param, message)


def _structured(body: Mapping[str, Any]) -> tuple[StructuredOutputsParams | None, StructuredSource | None]:
    """The request's structured-output constraint, from whichever field gives it (module docs)."""
    found: list[tuple[str, dict[str, Any], StructuredSource]] = []
    rf = _response_format(body.get("response_format"))
    if rf is not None:
        found.append(("response_format", rf, StructuredSource(
            "response_format.json_schema" if "json" in rf else "response_format",
            (("json", "response_format.json_schema.schema"), ("json_object", "response_format"),
             ("whitespace_pattern", "guided_whitespace_pattern")))))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, Mapping):
            raise bad("structured_outputs", f"structured_outputs must be an object (json, regex, choice, grammar or "
                                            f"json_object, and options), got {shown(so)}")
        found.append(("structured_outputs", dict(so), StructuredSource("structured_outputs")))
    for name, kind in _GUIDED.items():
        if body.get(name) is not None:
            found.append((name, {kind: body[name]}, StructuredSource(
                name, ((kind, name), ("whitespace_pattern", "guided_whitespace_pattern")))))
    if not found:
        return None, None
    if len(found) > 1:
        names = [n for n, _, _ in found]
        raise bad(names[1], f"give at most one of response_format (json_object/json_schema), structured_outputs, "
                            f"{', '.join(_GUIDED)}; got {' and '.join(names)}")
    name, spec, source = found[0]
    ws = _str(body, "guided_whitespace_pattern")
    if ws is not None and name != "structured_outputs":
        spec["whitespace_pattern"] = ws
    try:
        return StructuredOutputsParams.from_dict(spec), source
    except ValueError as e:
        raise source.error(str(e)) from None


def _tool_structured(choice: ToolChoice, whitespace: str | None) -> tuple[StructuredOutputsParams, StructuredSource]:
    """A forced call's constraint: the tools' schema, with the request's
    ``guided_whitespace_pattern`` (vLLM passes it on)."""
    source = StructuredSource("tools", (("json", "tools"), ("whitespace_pattern", "guided_whitespace_pattern")))
    try:
        return StructuredOutputsParams(json=choice.schema(), whitespace_pattern=whitespace), source
    except ToolError as e:
        raise bad(e.param, str(e)) from None
    except ValueError as e:
        raise source.error(str(e)) from None


def _response_format(value: Any) -> dict[str, Any] | None:
    """OpenAI's ``response_format`` -> ``StructuredOutputsParams`` fields (None: plain text)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise bad("response_format", f"response_format must be an object such as {{'type': 'json_object'}}, "
                                     f"got {shown(value)}")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        js = value.get("json_schema")
        if not isinstance(js, Mapping):
            raise bad("response_format.json_schema", "response_format.json_schema must be an object "
                      f"{{'name': ..., 'schema': {{...}}, 'strict': ...}}, got {shown(js)}")
        schema = js.get("schema")
        if not isinstance(schema, Mapping):
            raise bad("response_format.json_schema", "response_format.json_schema.schema must be a JSON schema "
                                                     f"object, got {shown(schema)}")
        _bool(js, "strict", False, "response_format.json_schema.")
        for key in ("name", "description"):
            if js.get(key) is not None and not isinstance(js[key], str):
                raise bad("response_format.json_schema", f"response_format.json_schema.{key} must be a string, "
                                                         f"got {shown(js[key])}")
        return {"json": dict(schema)}
    if kind == "structural_tag":
        raise bad("response_format", "response_format type 'structural_tag' is not supported by this server")
    raise bad("response_format", "response_format.type must be 'text', 'json_object' or 'json_schema', "
                                 f"got {shown(kind)}")


def _max_tokens(body: Mapping[str, Any], default: int | None, lo: int = 1) -> int | None:
    """``max_completion_tokens`` (OpenAI's newer name) wins over ``max_tokens``."""
    for name in ("max_completion_tokens", "max_tokens"):
        if body.get(name) is not None:
            v = body[name]
            if not _is_int(v) or not lo <= v <= _I32:
                raise bad(name, f"{name} must be an integer in [{lo}, {_I32}], got {shown(v)}")
            return v
    return default


# ------------------------------------------------------------------------------------------------
# Requests
@dataclass(slots=True)
class _Common:
    model: str | None
    stream: bool
    include_usage: bool
    continuous_usage: bool  # vLLM's stream_options.continuous_usage_stats: usage so far in every chunk
    params: SamplingParams
    user: str | None
    priority: int
    cache_salt: str | None
    structured: StructuredSource | None
    request_id: str | None = None  # vLLM's: the response id's base (an X-Request-Id header wins)
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:N"
    token_ids: bool = False  # vLLM's return_token_ids: the prompt's and the choices' token ids too
    # The max_tokens the request gave (completions: 16 when left out), which vLLM checks against the
    # context; None: chat left it out, so a default (generation config) is only cut to the context.
    asked_max_tokens: int | None = None

    def engine_error(self, e: Exception) -> Exception:
        """The engine's ``ValueError`` about this request's constraint (a grammar that does not
        compile), told in the request's names; any other error as it is."""
        if self.structured is not None and isinstance(e, ValueError) and str(e).startswith("structured_outputs"):
            return self.structured.error(str(e))
        return e


def _common(body: Mapping[str, Any], params: SamplingParams, structured: StructuredSource | None) -> dict[str, Any]:
    stream = _bool(body, "stream", False)
    opts = _opt(body, "stream_options", {})
    if not isinstance(opts, Mapping):
        raise bad("stream_options", f"stream_options must be a JSON object, got {shown(opts)}")
    # vLLM's: given stream_options (even {}), include_usage defaults to true (null: false).
    usage = opts.get("include_usage", True) is not None and _bool(opts, "include_usage", True, "stream_options.")
    continuous = _bool(opts, "continuous_usage_stats", False, "stream_options.")
    include_usage = body.get("stream_options") is not None and usage
    if opts and not stream:
        raise bad("stream_options", "stream_options is only allowed with stream: true")
    salt = _str(body, "cache_salt")
    if salt is not None and not salt:
        raise bad("cache_salt", "cache_salt must be a non-empty string")
    # vLLM's fields this server cannot honour are refused rather than silently ignored.
    if _opt(body, "logits_processors"):
        raise bad("logits_processors", "logits_processors is not supported by this server")
    if _bool(body, "use_beam_search", False):
        raise bad("use_beam_search", "use_beam_search is not supported by this server (LLM.beam_search is)")
    return dict(model=_str(body, "model"), stream=stream, include_usage=include_usage,
                continuous_usage=include_usage and continuous, params=params,
                user=_str(body, "user"), priority=_int(body, "priority", 0, -_I32 - 1, _I32), cache_salt=salt,
                structured=structured, request_id=_str(body, "request_id") or None,
                tokens_as_ids=_bool(body, "return_tokens_as_token_ids", False),
                token_ids=_bool(body, "return_token_ids", False))


@dataclass(slots=True)
class CompletionRequest(_Common):
    prompts: list[Any] = field(default_factory=list)  # each a str or {"prompt_token_ids": [...]}
    logprobs: int | None = None
    add_special_tokens: bool = True  # vLLM's: a text prompt gets the tokenizer's own special tokens (a BOS)
    echo: bool = False  # the prompt leads each choice (vLLM's; its logprobs too, as prompt_logprobs)
    generate: bool = True  # False: echo with max_tokens 0, the choice is the prompt alone


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


def parse_completion_request(body: Any, stream_kind: RequestOutputKind = RequestOutputKind.DELTA,
                             defaults: Mapping[str, Any] = _NO_DEFAULTS,
                             max_logprobs: int = _DEFAULT_MAX_LOGPROBS) -> CompletionRequest:
    body = _lax_numbers(_object(body), (*_INT_FIELDS, "logprobs"))
    if body.get("prompt") is None:
        raise bad("prompt", "prompt is required")
    prompts = _prompts(body["prompt"])
    logprobs = _logprobs(body, "logprobs", max_logprobs, whole_vocab=False)  # vLLM: "a positive value"
    stream = _bool(body, "stream", False)
    kind = stream_kind if stream else RequestOutputKind.FINAL_ONLY
    # vLLM's echo: the prompt leads each choice's text (and its logprobs, the prompt's); with
    # max_tokens 0 (what lm-eval's loglikelihood sends) the choice is the prompt alone.
    echo = _bool(body, "echo", False)
    # vLLM's default of 16 holds only when the field is left out: an explicit null fills the context.
    max_tokens = _max_tokens(body, None if "max_tokens" in body else 16, lo=0 if echo else 1)
    asked = 1 if max_tokens == 0 else max_tokens
    params, source = sampling_params(body, asked, logprobs, kind, defaults, max_logprobs)
    if echo and logprobs is not None and params.prompt_logprobs is None:
        params.prompt_logprobs = logprobs
    return CompletionRequest(**_common(body, params, source), asked_max_tokens=asked, prompts=prompts,
                             logprobs=logprobs, add_special_tokens=_bool(body, "add_special_tokens", True),
                             echo=echo, generate=max_tokens != 0)


@dataclass(slots=True)
class ChatRequest(_Common):
    messages: list[dict[str, str]] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0
    add_generation_prompt: bool = True
    template: dict[str, Any] = field(default_factory=dict)  # chat_token_ids' template keywords
    tool_choice: ToolChoice | None = None  # its tool calling: forced (named, "required") or "auto"
    echo: bool = False  # vLLM's: the last message's content leads each choice, when it has the answer's role
    max_tokens_field: str = "max_tokens"  # what the request called its max_tokens (errors use its name)
    include_reasoning: bool = True  # vLLM's: with a reasoning parser, false drops the answer's reasoning


def _template(body: Mapping[str, Any], tools: list[Any] | None) -> dict[str, Any]:
    """vLLM's chat-template fields of a request: ``chat_template`` (a Jinja string), ``tools``
    (checked by ``_tools``), ``documents``, ``continue_final_message``, ``reasoning_effort`` and
    ``chat_template_kwargs`` (``chat_token_ids`` checks the rest)."""
    kwargs = _opt(body, "chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise bad("chat_template_kwargs", f"chat_template_kwargs must be a JSON object, got {shown(kwargs)}")
    effort = _opt(body, "reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise bad("reasoning_effort",
                      f"reasoning_effort must be one of {list(REASONING_EFFORTS)}, got {shown(effort)}")
        # vLLM's: the template sees the effort, and thinks unless it is "none"; the caller's own kwargs win.
        kwargs = {"reasoning_effort": effort, "enable_thinking": effort != "none", **(kwargs or {})}
    documents = body.get("documents")
    try:
        check_documents(documents)
    except ValueError as e:
        raise bad("documents", str(e)) from None
    # add_special_tokens: vLLM's, off by default for chat (the template has them); on, the
    # tokenizer's own (a BOS) come on top of the template's.
    return dict(chat_template=_str(body, "chat_template"),
                continue_final_message=_bool(body, "continue_final_message", False), chat_template_kwargs=kwargs,
                tools=tools, documents=documents, add_special_tokens=_bool(body, "add_special_tokens", False))


def _tools(body: Mapping[str, Any], auto_parser: str | None = None) -> tuple[list[Any] | None, ToolChoice | None]:
    """``tools`` (for the chat template) and the request's tool calling
    (``ferrokv.entrypoints.openai.tool_calls``), each error a 400 naming its field."""
    try:
        return parse_tools(body, auto_parser)
    except ToolError as e:
        raise bad(e.param, str(e)) from None


def checked_content(content: Any, where: str, role: str) -> str | tuple[str, ...]:
    """A message's content (``message_text``: a string, text parts, or null) at the request's
    field ``where`` (``messages[2].content``), its error a 400 naming the field or its bad part."""
    try:
        return message_text(content, where, role)
    except ValueError as e:
        field = re.match(re.escape(where) + r"(\[\d+\])?", str(e))
        raise bad(field.group(0) if field else where, str(e)) from None


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise bad("messages", f"messages must be a non-empty list of {{'role': ..., 'content': ...}} objects, "
                              f"got {shown(value)}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, Mapping):
            raise bad(f"messages[{i}]", f"messages[{i}] must be an object with 'role' and 'content', got {shown(m)}")
        if not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}].role", f"messages[{i}].role must be a string, got {shown(m.get('role'))}")
        try:  # checked here for a 400 naming the field; chat_token_ids decodes the arguments, once
            tool_fields = message_tool_fields(m, f"messages[{i}]")
        except ValueError as e:  # its message starts with the field's path
            raise bad(str(e).split(" ", 1)[0], str(e)) from None
        content = checked_content(m.get("content"), f"messages[{i}].content", m["role"])
        # The arguments of replayed tool_calls stay JSON text here: chat_token_ids decodes them, once.
        out.append({"role": m["role"], "content": content,
                    **{key: m[key] if key == "tool_calls" else value for key, value in tool_fields.items()}})
    return out


def parse_chat_request(body: Any, stream_kind: RequestOutputKind = RequestOutputKind.DELTA,
                       defaults: Mapping[str, Any] = _NO_DEFAULTS, max_logprobs: int = _DEFAULT_MAX_LOGPROBS,
                       tool_call_parser: str | None = None) -> ChatRequest:
    """``tool_call_parser``: the server's ``--tool-call-parser`` when ``--enable-auto-tool-choice``
    is on (None: ``tool_choice: "auto"`` is refused)."""
    body = _lax_numbers(_object(body), bools=(*_BOOL_FIELDS, "logprobs"))
    messages = _messages(body.get("messages"))
    want_logprobs = _bool(body, "logprobs", False)
    top = _logprobs(body, "top_logprobs", max_logprobs)
    if top and not want_logprobs:  # vLLM accepts top_logprobs=0 alone
        raise bad("top_logprobs", "top_logprobs needs logprobs: true")
    kind = stream_kind if _bool(body, "stream", False) else RequestOutputKind.FINAL_ONLY
    tools, tool_choice = _tools(body, tool_call_parser)
    asked = _max_tokens(body, None)
    params, source = sampling_params(body, asked, (top or 0) if want_logprobs else None, kind, defaults,
                                     max_logprobs, tool_choice)
    template = _template(body, tools)
    # chat_template_kwargs override add_generation_prompt (vLLM's order): the answer's role follows it.
    generation_prompt = _bool({**body, **(template["chat_template_kwargs"] or {})}, "add_generation_prompt", True)
    return ChatRequest(**_common(body, params, source), asked_max_tokens=asked, messages=messages,
                       logprobs=want_logprobs,
                       top_logprobs=top or 0, add_generation_prompt=generation_prompt, template=template,
                       tool_choice=tool_choice, echo=_bool(body, "echo", False),
                       include_reasoning=_bool(body, "include_reasoning", True),
                       max_tokens_field="max_completion_tokens" if body.get("max_completion_tokens") is not None
                       else "max_tokens")
