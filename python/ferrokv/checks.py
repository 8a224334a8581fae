"""Checks of values a user hands in, shared by every layer that takes them (``SamplingParams``,
``EngineArgs``, ``LLMEngine``, chat messages), so that each rule is written once.

Invariants: every ``check_*`` raises ``ValueError`` whose message names the field and the offending
value (shortened to ``_SHOWN`` characters), and otherwise returns the value; ``check_same_device``
raises ``DeviceMismatchError`` naming both sides and both devices. Importing this module imports
neither torch nor the core, so ``ferrokv --help`` stays fast.
Costs: O(len(value)) for text (one UTF-8 encode), O(1) otherwise.
"""

from __future__ import annotations

import math
import numbers
import re
from typing import Any

__all__ = [
    "DeviceMismatchError", "PoolingUnsupportedError", "as_float", "check_finite", "check_int", "check_same_device",
    "check_text", "is_text", "rename_field", "shown",
]

_SHOWN = 60  # characters of a bad value quoted in a message


def shown(value: Any) -> str:
    """``repr(value)``, cut to ``_SHOWN`` characters (a bad prompt can be megabytes)."""
    r = repr(value)
    return r if len(r) <= _SHOWN else r[: _SHOWN - 3] + "..."


def check_text(name: str, value: Any) -> str:
    """``value`` must be a ``str`` that UTF-8 can encode (no lone surrogate such as ``'\\ud800'``):
    the tokenizer and the core both need real Unicode text."""
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a str, got {type(value).__name__} {shown(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{name} must be valid Unicode text, got {shown(value)} with a lone surrogate "
            f"{value[e.start]!r} at index {e.start}"
        ) from None
    return value


def is_text(value: Any) -> bool:
    """``check_text``'s test without the error: a str UTF-8 can encode."""
    try:
        check_text("", value)
    except ValueError:
        return False
    return True


def check_int(name: str, value: Any, lo: int, hi: int) -> int:
    """``value`` must be an int (not a bool) in ``[lo, hi]``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {shown(value)}")
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {shown(value)}")
    return int(value)


def as_float(name: str, value: Any) -> float:
    """``value`` must be a real number (not a bool) that a float holds (an int too large for one,
    e.g. 10**400, is an error, not an ``OverflowError``); returned as a float, maybe infinite."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {shown(value)}")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{name} must be a finite number, got {shown(value)}") from None


def check_finite(name: str, value: Any) -> float:
    """``value`` must be a finite real number (not a bool); returned as a float."""
    f = as_float(name, value)
    if not math.isfinite(f):
        raise ValueError(f"{name} must be a finite number, got {shown(value)}")
    return f


def rename_field(e: BaseException, old: str, new: str, old_value: str | None = None,
                 new_value: str | None = None) -> None:
    """Rewrites, in place, ``old=`` (followed by ``old_value`` when given) in ``e``'s message as
    ``new=`` (``new_value``), and its ``field``/``value`` attributes where it has them (the core's
    ``InvalidArgumentError``); re-raise ``e`` itself afterwards. The exception keeps its type and
    everything else: never rebuild one as ``type(e)(message)``, since not every exception type
    takes one argument (``UnicodeEncodeError`` takes five)."""
    pattern = r"(?<!\w)" + re.escape(old) + "=" + (re.escape(old_value) + r"(?!\w)" if old_value is not None else "")
    repl = f"{new}=" + (new_value if new_value is not None else "")
    if e.args and isinstance(e.args[0], str):
        e.args = (re.sub(pattern, lambda _: repl, e.args[0]), *e.args[1:])
    if getattr(e, "field", None) == old and (old_value is None or getattr(e, "value", None) == old_value):
        e.field = new  # type: ignore[attr-defined]
        if new_value is not None:
            e.value = new_value  # type: ignore[attr-defined]


class PoolingUnsupportedError(ValueError, NotImplementedError):
    """A pooling call (``encode``, ``embed``, ...) on ferrokv's generative engine: a ValueError as
    vLLM raises on a generative model, and a NotImplementedError as ferrokv raised before."""


class DeviceMismatchError(RuntimeError):
    """Two things that must live on one device (a generator and the tensor it fills, a model and
    its KV cache) do not; the message names both and both devices."""


def _canonical(device: Any) -> tuple[str, int]:
    import torch

    dev = torch.device(device)
    index = dev.index
    if index is None and dev.type == "cuda":
        index = torch.cuda.current_device()  # "cuda" means the current CUDA device
    return dev.type, index or 0


def check_same_device(what: str, device: Any, other_what: str, other_device: Any) -> None:
    """Raises ``DeviceMismatchError`` unless ``device`` and ``other_device`` are one device
    (``cuda`` and ``cuda:<current>`` are the same)."""
    if device != other_device and _canonical(device) != _canonical(other_device):
        raise DeviceMismatchError(
            f"{what} is on {device} but {other_what} is on {other_device}; they must be on the same device"
        )
