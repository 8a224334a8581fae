"""The OpenAI wire format's errors and field readers: ``OpenAIError`` (what the server answers
with ``{"error": {message, type, param, code}}``) and one reader per kind of field.

Invariants: a reader returns the field's value (or the default when it is absent or ``null``) or
raises ``OpenAIError(400, ...)`` naming the field and its value. Numbers and booleans are read as
vLLM's pydantic models read them (lax mode: ``"2"`` and ``2.0`` for an int, ``"yes"`` for a bool).
Costs: O(size of the field) per read.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Mapping
from typing import Any

from ferrokv.checks import check_text, shown

__all__ = ["OpenAIError", "bad", "error_body"]

_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                405: "MethodNotAllowedError", 413: "RequestTooLargeError", 415: "UnsupportedMediaTypeError",
                503: "ServiceUnavailableError"}


class OpenAIError(Exception):
    """An error the server answers with ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str | None = None,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or _ERROR_TYPES.get(status, "InternalServerError")
        self.retry_after = retry_after  # seconds, sent as Retry-After (the openai client's retries honour it)

    def renamed(self, fix: Callable[[str], str]) -> OpenAIError:
        """This error told in other names: ``fix`` applied to its message and its param."""
        return OpenAIError(self.status, fix(self.message), None if self.param is None else fix(self.param), self.type,
                           self.retry_after)


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


def _logprobs(body: Mapping[str, Any], name: str, max_logprobs: int, whole_vocab: bool = True) -> int | None:
    """A logprobs count, within the engine's ``max_logprobs`` (-1: no cap), as vLLM checks it;
    ``whole_vocab``: -1 asks for every token (``prompt_logprobs``, ``top_logprobs``), which only
    an uncapped server serves."""
    v = _opt(body, name)
    if v is None:
        return None
    uncapped = max_logprobs == -1
    lowest = -1 if uncapped and whole_vocab else 0
    if _is_int(v) and lowest <= v and (uncapped or v <= max_logprobs):
        return v
    bound = "an integer >= 0" if uncapped else f"an integer in [0, {max_logprobs}]"
    every = " or -1 (every token)" if lowest == -1 else ""
    more = "; -1 (every token) needs --max-logprobs -1" if whole_vocab and not uncapped and v == -1 else ""
    raise bad(name, f"{name} must be {bound}{every} (the server's --max-logprobs), got {shown(v)}{more}")


def _bool(body: Mapping[str, Any], name: str, default: bool | None, where: str = "") -> bool:
    """A boolean field, read as pydantic's lax mode reads one (``_lax_bool``); ``where``: the path
    of ``body`` in the request (``stream_options.``), for the error."""
    v = _lax_bool(_opt(body, name, default))
    if not isinstance(v, bool):
        raise bad(where + name, f"{where + name} must be a boolean, got {shown(v)}")
    return v


def _lax_bool(v: Any) -> Any:
    """pydantic's lax booleans: 0/1 and strings such as "yes", "off", "true" as bools; anything
    else as it is (the field's check then names it)."""
    if isinstance(v, str) and v.lower() in _BOOL_TEXT:
        return _BOOL_TEXT[v.lower()]
    if isinstance(v, (int, float)) and not isinstance(v, bool) and v in (0, 1):
        return bool(v)
    return v


def _str(body: Mapping[str, Any], name: str) -> str | None:
    """A string field; one UTF-8 cannot carry (a lone surrogate) is refused too, since responses
    repeat some (``request_id``, ``user``)."""
    v = _opt(body, name)
    if v is not None:
        try:
            check_text(name, v)
        except ValueError as e:
            raise bad(name, str(e).replace(" a str,", " a string,")) from None
    return v


def _object(body: Any, what: str = "the request body") -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise bad(None, f"{what} must be a JSON object, got {shown(body)}")  # type: ignore[arg-type]
    return body


# Numeric fields, which vLLM's pydantic models read leniently: an integral float or a numeric
# string for an int ("n": "2", "max_tokens": 4.0), a numeric string for a float.
_INT_FIELDS = ("n", "best_of", "max_tokens", "max_completion_tokens", "top_k", "seed", "min_tokens", "top_logprobs",
               "prompt_logprobs", "priority", "truncate_prompt_tokens")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                 "length_penalty")
_BOOL_FIELDS = ("stream", "echo", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
                "spaces_between_special_tokens", "add_generation_prompt", "continue_final_message",
                "add_special_tokens", "return_tokens_as_token_ids", "return_token_ids", "use_beam_search",
                "parallel_tool_calls", "background", "store", "early_stopping", "include_reasoning")
_BOOL_TEXT = {t: True for t in ("1", "on", "t", "true", "y", "yes")} | {f: False for f in ("0", "off", "f", "false",
                                                                                         "n", "no")}
_INT_TEXT = re.compile(r"\s*[-+]?\d+\s*")


def _lax_numbers(body: Mapping[str, Any], ints: tuple[str, ...] = _INT_FIELDS,
                 bools: tuple[str, ...] = _BOOL_FIELDS) -> dict[str, Any]:
    """``body`` with its numeric and boolean fields read as vLLM's pydantic reads them (lax
    mode); anything else is left for the field's own check, which names it."""
    out = dict(body)
    for name in ints:
        v = out.get(name)
        if isinstance(v, bool) or (isinstance(v, float) and v.is_integer()):
            out[name] = int(v)
        elif isinstance(v, str) and _INT_TEXT.fullmatch(v):
            with contextlib.suppress(ValueError):  # more digits than Python converts
                out[name] = int(v)
    for name in _FLOAT_FIELDS:
        v = out.get(name)
        if isinstance(v, (str, bool)):
            with contextlib.suppress(ValueError):
                out[name] = float(v)
    for name in bools:
        if name in out:
            out[name] = _lax_bool(out[name])
    return out
