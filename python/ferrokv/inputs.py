"""Prompt forms (vLLM's ``PromptType``): what a request's prompt may be, turned into validated ids.

A prompt is a ``str`` (tokenized), a ``TextPrompt`` dict (``{"prompt": str}``) or a
``TokensPrompt`` dict (``{"prompt_token_ids": list or array of ints}``; its ``prompt`` text, if
any, is kept for the output). Either dict may carry ``cache_salt``, the prefix-cache isolation key:
``prompt_cache_salt`` combines it with a ``cache_salt=`` keyword (equal or one-sided; differing is
an error), so it is never dropped. ``batch_prompts`` is ``LLM.generate``'s batching
(``parse_and_batch_prompt``): a bare list of ints is ONE prompt, a list of lists of ints a batch.
Invariants: every error is a ``ValueError`` naming the field and the offending value, raised
before anything reaches the engine; an unknown key is an error, ``multi_modal_data`` and
``mm_processor_kwargs`` are "not supported"; valid ids are non-empty, inside the vocabulary and at
most ``max_model_len`` long. Costs: O(prompt length).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypedDict, Union

import numpy as np

from ferrokv.checks import check_int, check_text, is_text, shown

logger = logging.getLogger("ferrokv")

__all__ = ["PromptType", "TextPrompt", "TokensPrompt", "batch_prompts", "check_logprobs_cap", "check_no_lora",
           "check_priority", "check_tools", "checked_prompt_ids", "is_text_prompt", "message_text",
           "message_tool_fields", "prompt_cache_salt", "prompt_ids", "prompt_keep", "request_id_str", "request_ids",
           "template_kwargs", "tokenization_options", "tokenized_prompt", "truncation_length", "validate_prompt_ids",
           "with_truncation"]


class _Text(TypedDict):
    prompt: str


class TextPrompt(_Text, total=False):
    """vLLM's text prompt dict (a plain dict at run time): the text, tokenized by the engine."""

    cache_salt: str


class _Tokens(TypedDict):
    prompt_token_ids: list[int]


class TokensPrompt(_Tokens, total=False):
    """vLLM's token-id prompt dict; ``prompt`` is the text the ids came from, kept for outputs."""

    prompt: str
    cache_salt: str


PromptType = Union[str, TextPrompt, TokensPrompt]
"""vLLM's ``PromptType``: what a request's prompt may be."""

PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")
"""The keys of a prompt dict that ferrokv implements."""
# vLLM's prompt keys for what a text model has none of: accepted empty (vLLM's text path then),
# refused otherwise.
_UNSUPPORTED_KEYS = ("multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids", "token_type_ids")


def _check_keys(prompt: Mapping[Any, Any]) -> None:
    for key in prompt:
        if key in _UNSUPPORTED_KEYS:
            value = prompt[key]
            if value is None or isinstance(value, (Mapping, list, tuple)) and not value:
                continue
            raise ValueError(f"prompt[{key!r}]: multi-modal inputs are not supported by ferrokv (text models only), "
                             f"got {shown(prompt[key])}")
        if key not in PROMPT_KEYS:
            raise ValueError(f"prompt has an unknown key {key!r}; the keys are: {', '.join(PROMPT_KEYS)}")


def _token_list(ids: Any, name: str = "prompt_token_ids") -> list[int]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (Sequence, np.ndarray)):
        raise ValueError(f"{name} must be a list of ints, got {type(ids).__name__}")
    # The common cases in C (a prompt can be 100k tokens, checked holding the engine); anything
    # else, and the error naming the first bad entry, by the loop below.
    if isinstance(ids, np.ndarray) and ids.ndim == 1 and ids.dtype.kind in "iu":
        return ids.tolist()
    if isinstance(ids, list) and set(map(type, ids)) <= {int}:
        return list(ids)
    out = []
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise ValueError(f"{name}[{i}] must be an int, got {t!r}")
        out.append(int(t))
    return out


def prompt_ids(tokenizer: Any, prompt: Any, add_special_tokens: bool = True,
               keep: int | None = None) -> tuple[str | None, list[int]]:
    """The prompt's text (None when only ids were given) and its token ids (a text tokenized with
    the tokenizer's own special tokens, such as a BOS, unless ``add_special_tokens`` is False);
    ``keep`` (``truncation_length``): at most that many, a text cut as the tokenizer cuts it on the
    left (vLLM's: the special tokens it adds stay, before the text's last tokens), ids given cut to
    their last ones."""
    if isinstance(prompt, str):
        return prompt, _encoded(tokenizer, check_text("prompt", prompt), add_special_tokens, keep)
    if isinstance(prompt, Mapping):
        _check_keys(prompt)
        text = prompt.get("prompt")
        if text is not None:
            check_text("prompt['prompt']", text)
        if "prompt_token_ids" in prompt:
            ids = _token_list(prompt["prompt_token_ids"])
            return text, ids if keep is None or len(ids) <= keep else ids[-keep:]
        if text is not None:
            return text, _encoded(tokenizer, text, add_special_tokens, keep)
        raise ValueError(f"prompt: a dict needs 'prompt_token_ids' or 'prompt', got keys {sorted(map(str, prompt))}")
    raise ValueError(
        f"prompt must be a str or a dict with 'prompt_token_ids' (or 'prompt'), got {type(prompt).__name__}"
    )


def _encoded(tokenizer: Any, text: str, add: bool, keep: int | None) -> list[int]:
    ids = list(tokenizer.encode(text, add_special_tokens=add))
    if keep is not None and len(ids) > keep:  # the loaded tokenizer truncates on the left (engine_setup)
        ids = list(tokenizer(text, add_special_tokens=add, truncation=True, max_length=keep)["input_ids"])
    return ids


def tokenization_options(tokenization_kwargs: Mapping[str, Any] | None) -> tuple[bool, int | None]:
    """vLLM's ``tokenization_kwargs`` as far as ferrokv tokenizes a prompt: ``add_special_tokens``
    (True when left out) and ``truncate_prompt_tokens`` (None when left out; where vLLM now takes
    ``SamplingParams.truncate_prompt_tokens``, which it overrides, checked there); any other key is
    a ``ValueError`` naming it."""
    if tokenization_kwargs is not None and not isinstance(tokenization_kwargs, Mapping):
        raise ValueError(f"tokenization_kwargs must be a dict, got {shown(tokenization_kwargs)}")
    kw = dict(tokenization_kwargs or {})
    add = kw.pop("add_special_tokens", True)
    truncate = kw.pop("truncate_prompt_tokens", None)
    if not isinstance(add, bool):
        raise ValueError(f"tokenization_kwargs['add_special_tokens'] must be a bool, got {shown(add)}")
    if kw:
        raise ValueError(f"tokenization_kwargs[{next(iter(kw))!r}] is not supported (only add_special_tokens "
                         "and truncate_prompt_tokens)")
    return add, truncate


def with_truncation(params: Any, truncate: int | None) -> Any:
    """``params`` (a ``SamplingParams``) with ``tokenization_kwargs``' ``truncate_prompt_tokens``
    (a checked copy), or as they are when it was left out."""
    return params if truncate is None else dataclasses.replace(params, truncate_prompt_tokens=truncate)


def is_text_prompt(prompt: Any) -> bool:
    """A prompt still to tokenize: a str, or a dict without ids."""
    return isinstance(prompt, str) or (isinstance(prompt, Mapping) and "prompt_token_ids" not in prompt)


def tokenized_prompt(tokenizer: Any, prompt: Any, add_special_tokens: bool = True, keep: int | None = None) -> Any:
    """A text prompt (``is_text_prompt``) as ``{"prompt", "prompt_token_ids"}`` (at most ``keep``
    of them, ``prompt_ids``), its ``cache_salt`` kept; other forms as they are (the engine checks
    them)."""
    if not is_text_prompt(prompt):
        return prompt
    text, ids = prompt_ids(tokenizer, prompt, add_special_tokens, keep)
    out = {"prompt": text, "prompt_token_ids": ids}
    if isinstance(prompt, Mapping) and "cache_salt" in prompt:
        out["cache_salt"] = prompt["cache_salt"]  # the engine combines it with the keyword's
    return out


def prompt_cache_salt(prompt: Any, cache_salt: str | None) -> str | None:
    """The request's cache salt: the prompt dict's ``cache_salt`` and the keyword, which must
    agree when both are given; an empty one is no salt (vLLM salts only with a non-empty one)."""
    salt = prompt.get("cache_salt") if isinstance(prompt, Mapping) else None
    if salt is not None:
        check_text("prompt['cache_salt']", salt)
    if cache_salt is not None:
        check_text("cache_salt", cache_salt)
    if salt is not None and cache_salt is not None and salt != cache_salt:
        raise ValueError(f"prompt['cache_salt']={salt!r} differs from cache_salt={cache_salt!r}; give one of them")
    return (salt if salt is not None else cache_salt) or None


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def batch_prompts(prompts: Any) -> list[Any]:
    """One prompt or a batch of them, as a list of prompts (``LLM.generate``'s input)."""
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if isinstance(prompts, np.ndarray):
        prompts = prompts.tolist()
    if isinstance(prompts, (bytes, bytearray)):  # not token ids: text would be a str
        raise ValueError(f"prompts must be a str, a dict or a list of them, got {shown(prompts)}")
    try:
        items = list(prompts)
    except TypeError:
        raise ValueError(f"prompts must be a str, a dict or a list of them, got {shown(prompts)}") from None
    if not items:
        raise ValueError("prompts: the list is empty (give at least one prompt)")
    if all(_is_int(x) for x in items):
        return [{"prompt_token_ids": items}]  # a bare list of ints: one tokenized prompt
    out: list[Any] = []
    for i, p in enumerate(items):
        if isinstance(p, np.ndarray) or (isinstance(p, (list, tuple)) and all(_is_int(x) for x in p)):
            out.append({"prompt_token_ids": _token_list(p, f"prompts[{i}]")})
        elif isinstance(p, (str, Mapping)):
            out.append(p)
        else:
            raise ValueError(f"prompts[{i}] must be a str, a dict or a list of ints, got {shown(p)}")
    return out


def checked_prompt_ids(tokenizer: Any, prompt: Any, add_special_tokens: bool, params: Any, vocab_size: int,
                       max_model_len: int) -> tuple[str | None, list[int]]:
    """``prompt_ids``, truncated as ``params.truncate_prompt_tokens`` asks (``params`` may be
    None), then validated (``validate_prompt_ids``)."""
    keep = None if params is None else truncation_length(params.truncate_prompt_tokens, max_model_len,
                                                         params.max_tokens)
    text, ids = prompt_ids(tokenizer, prompt, add_special_tokens, keep)
    tokenized = not (isinstance(prompt, Mapping) and "prompt_token_ids" in prompt)
    validate_prompt_ids(ids, vocab_size, max_model_len, tokenized)
    return text, ids


def validate_prompt_ids(ids: list[int], vocab_size: int, max_model_len: int, tokenized: bool = False) -> None:
    """Checks a prompt's ids; an error names ``prompt_token_ids`` (the caller's ids) or, for a
    ``tokenized`` text, ``prompt``."""
    field = "prompt" if tokenized else "prompt_token_ids"
    if not ids:
        raise ValueError(f"{field}: the prompt is empty (at least one token is needed)")
    if min(ids) < 0 or max(ids) >= vocab_size:  # in C; the loop names the first one out
        for i, t in enumerate(ids):
            if not 0 <= t < vocab_size:
                where = f"{field}: its token {i} is {t}, which is" if tokenized else f"{field}[{i}]={t} is"
                raise ValueError(f"{where} outside the vocabulary [0, {vocab_size})")
    # Equal is refused too, as vLLM does: the first output token would need position max_model_len.
    if len(ids) >= max_model_len:
        more = "more than" if len(ids) > max_model_len else "as many as"
        raise ValueError(f"{field}: the prompt has {len(ids)} tokens, {more} max_model_len={max_model_len}, "
                         "which leaves no room for an output token")


def request_id_str(request_id: Any) -> str:
    """A request id as the engine keeps it: a str, or an int as its decimal string (vLLM takes only
    str); anything else is a ValueError naming it, so add and abort always agree on the id."""
    if isinstance(request_id, str):
        return request_id
    if isinstance(request_id, int) and not isinstance(request_id, bool):
        return str(request_id)
    raise ValueError(f"request_id must be a str (or an int), got {type(request_id).__name__} {shown(request_id)}")


def request_ids(value: Any) -> list[str]:
    """One request id, or any other iterable of them (vLLM's ``str | Iterable[str]``), as
    ``request_id_str`` keeps them (all checked: a bad one anywhere is a ValueError before any is
    used)."""
    many = isinstance(value, Iterable) and not isinstance(value, (str, bytes, bytearray))
    return [request_id_str(r) for r in list(value)] if many else [request_id_str(value)]


def prompt_keep(params: Any, max_model_len: int) -> int | None:
    """``truncation_length`` of ``params`` when they hold what it reads, else None: params changed
    since they were made are refused by the engine's own check, which names the field."""
    try:
        return truncation_length(params.truncate_prompt_tokens, max_model_len, params.max_tokens)
    except (AttributeError, TypeError, ValueError):
        return None


def truncation_length(truncate: int | None, max_model_len: int, max_tokens: int | None) -> int | None:
    """How many of the prompt's last tokens vLLM's ``truncate_prompt_tokens`` keeps: -1 means as
    many as leave ``max_tokens`` (at least one) of ``max_model_len`` to generate, as vLLM's
    renderer; more than ``max_model_len`` is a ValueError naming both, as vLLM's."""
    if truncate is None:
        return None
    if truncate > max_model_len:
        raise ValueError(f"truncate_prompt_tokens={truncate} is greater than max_model_len={max_model_len}: "
                         "ask for a smaller truncation")
    return max(max_model_len - (max_tokens or 1), 1) if truncate == -1 else truncate


def request_max_tokens(request_id: str, asked: int | None, room: int, fitting: int, n: int, min_tokens: int) -> int:
    """The tokens a request may generate per sample: ``asked`` capped at ``room`` (what
    ``max_model_len`` leaves after the prompt); none asked: ``room``, unless the cache holds less
    for the request's n samples at once (``fitting``: the core's ``max_fitting_tokens``; 0: not
    even one, and the core refuses the request), which is logged, since vLLM, whose samples run as
    separate requests, would give each sample ``room``."""
    if asked is not None:
        return min(asked, room)
    if not fitting or fitting >= room:
        return room
    logger.warning("request %s names no max_tokens: each of its n=%d sample(s) may generate %d tokens, what "
                   "the KV cache holds for them at once (max_model_len leaves %d)%s", request_id, n, fitting, room,
                   f"; min_tokens={min_tokens} is cut to it" if min_tokens > fitting else "")
    return fitting


def check_no_lora(lora_request: Any) -> None:
    """vLLM's ``lora_request``: None (the base model) is accepted everywhere; an adapter is not
    supported yet, a ValueError naming it."""
    if lora_request is not None:
        raise ValueError(f"lora_request must be None: LoRA adapters are not supported yet, got {shown(lora_request)}")


# OpenAI's content part types that are text, and the key holding it (vLLM reads them all as text).
_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
               "thinking": "thinking"}


def message_text(content: Any, name: str, role: Any = None) -> str | tuple[str, ...]:
    """A chat message's content: a string as it is; OpenAI's list of text parts (``{"type":
    "text", "text": ...}``, and ``input_text``, ``output_text``, ``refusal``, ``thinking``) as the
    tuple of their texts, which ``ferrokv.chat_content_format`` joins with newlines or hands on
    as parts, as vLLM does; null as "" (vLLM's; e.g. a replayed turn that only called tools); a
    bare string in the list is a text part and a text part whose text is null is skipped (both
    vLLM's). Only text is supported; ``name`` is what errors call it."""
    if content is None:
        return ""
    if isinstance(content, tuple) and all(isinstance(t, str) for t in content):  # checked already
        return tuple(check_text(f"{name}[{j}]", t) for j, t in enumerate(content))
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, str):  # vLLM's: a bare string is a text part
                parts.append(check_text(f"{name}[{j}]", part))
                continue
            kind = part.get("type") if isinstance(part, Mapping) else None
            key = _TEXT_PARTS.get(kind) if isinstance(kind, str) else None
            if key is not None and part.get(key) is None:
                logger.warning("%s[%d]: a %r part without text is skipped (as vLLM does)", name, j, part.get("type"))
                continue
            if key is None or not isinstance(part.get(key), str):
                raise ValueError(f"{name}[{j}] must be a {{'type': 'text', 'text': ...}} part (only text is "
                                 f"supported), got {shown(part)}")
            parts.append(check_text(f"{name}[{j}].{key}", part[key]))
        return tuple(parts)
    return check_text(name, content)


def message_tool_fields(m: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The tool and reasoning fields of the chat message ``where`` (``messages[3]``) that a chat
    template may use, checked: an assistant's ``tool_calls`` (each ``function.arguments`` JSON
    text parsed into an object, "" or absent as {}, as vLLM gives them to templates) and its
    ``reasoning`` (``reasoning_content`` is another name for it: the template gets both, as
    vLLM's), a tool message's ``tool_call_id``, and ``name``. A ``ValueError`` starts with the bad
    field's path."""
    out: dict[str, Any] = {}
    for key in ("tool_call_id", "name"):
        if m.get(key) is not None:
            out[key] = check_text(f"{where}.{key}", m[key])
    key = "reasoning" if m.get("reasoning") is not None else "reasoning_content"
    if m.get("role") == "assistant" and m.get(key) is not None:
        out["reasoning"] = out["reasoning_content"] = check_text(f"{where}.{key}", m[key])
    calls = m.get("tool_calls")
    if calls is None:
        return out
    if not isinstance(calls, list):
        raise ValueError(f"{where}.tool_calls must be a list, got {shown(calls)}")
    out["tool_calls"] = [_replayed_call(f"{where}.tool_calls[{j}]", c) for j, c in enumerate(calls)]
    return out


def _replayed_call(where: str, call: Any) -> dict[str, Any]:
    f = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(f, Mapping) or not isinstance(f.get("name"), str):
        raise ValueError(f"{where} must be {{'id': ..., 'type': 'function', 'function': {{'name': ..., "
                         f"'arguments': ...}}}}, got {shown(call)}")
    args = f.get("arguments")
    if isinstance(args, str) and args:
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):  # RecursionError: nested deeper than Python parses
            raise ValueError(f"{where}.function.arguments must be JSON text, got {shown(args)}") from None
    elif args in (None, ""):
        args = {}
    elif not isinstance(args, (Mapping, list)):
        raise ValueError(f"{where}.function.arguments must be JSON text, got {shown(args)}")
    return {**call, "function": {**f, "arguments": args}}


def check_documents(documents: Any) -> None:
    """vLLM's ``documents`` for a chat template (retrieval-augmented ones show them): None or a
    list of objects mapping strings to strings."""
    if documents is not None and not (isinstance(documents, list) and all(
            isinstance(d, Mapping) and all(is_text(k) and is_text(v) for k, v in d.items()) for d in documents)):
        raise ValueError(f"documents must be a list of objects mapping strings to strings, got {shown(documents)}")


def check_tools(tools: Any) -> None:
    """OpenAI's tool definitions for a chat template: None or a list of objects."""
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools)):
        raise ValueError(f"tools must be a list of tool objects, got {shown(tools)}")


# The core takes a request's priority as a 32-bit signed int.
_PRIORITY_MIN, _PRIORITY_MAX = -(1 << 31), (1 << 31) - 1


def check_priority(priority: Any, scheduling_policy: str) -> None:
    check_int("priority", priority, _PRIORITY_MIN, _PRIORITY_MAX)
    if priority != 0 and scheduling_policy != "priority":
        raise ValueError(f"priority={priority} needs scheduling_policy='priority' "
                         f"(the engine runs {scheduling_policy!r})")  # as vLLM refuses it


def check_logprobs_cap(logprobs: int | None, prompt_logprobs: int | None, max_logprobs: int, vocab_size: int) -> None:
    """A request's ``logprobs`` and ``prompt_logprobs`` (-1: the whole vocabulary) are within the
    engine's ``max_logprobs`` (-1: no limit), as vLLM checks them."""
    if max_logprobs == -1:
        return
    for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        wanted = vocab_size if value == -1 else value
        if wanted is not None and wanted > max_logprobs:
            raise ValueError(f"{name}={value} asks for {wanted} logprobs, more than max_logprobs={max_logprobs} "
                             "(raise the engine's max_logprobs, -1 for no limit)")


# apply_chat_template's own arguments and the template's messages: chat_template_kwargs may not set them.
_TEMPLATE_RESERVED = frozenset({
    "messages", "conversation", "chat_template", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})
# Arguments a request's chat_template_kwargs may override (vLLM applies them last), a default may not.
TEMPLATE_ARGS = frozenset({"add_generation_prompt", "continue_final_message", "tools", "documents"})


def template_kwargs(kwargs: Any, name: str = "chat_template_kwargs", overriding: bool = True) -> dict[str, Any]:
    """Extra variables of a chat template (vLLM's ``chat_template_kwargs``): a dict whose keys
    are names, none of them one of ``apply_chat_template``'s own arguments but the
    ``TEMPLATE_ARGS`` (when ``overriding``); ``name`` is what errors call it
    (``--default-chat-template-kwargs``, checked at startup, may not override)."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise ValueError(f"{name} must be a dict of template variables, got {shown(kwargs)}")
    reserved = sorted((_TEMPLATE_RESERVED if overriding else _TEMPLATE_RESERVED | TEMPLATE_ARGS).intersection(kwargs))
    if reserved:
        raise ValueError(f"{name} may not set {', '.join(reserved)} (arguments of their own)")
    return dict(kwargs)
