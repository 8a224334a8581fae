"""What a request's caller receives from the engine loop (``ferrokv.engine_loop``): the items on its
sink (``StreamItem``), the sink protocol, and the errors it raises (``caller_error``).

A sink is anything with a non-blocking ``put(item: StreamItem)``; it may also have a ``flush()`` and an
``accepted`` callable (the engine loop's module docs say when each is called). ``to_sink`` is how the loop
calls them: a sink that broke must not stop the loop.
Costs: O(1) per item.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ferrokv._core import FerrokvError
from ferrokv.outputs import RequestOutput

logger = logging.getLogger("ferrokv")

__all__ = ["EngineDeadError", "EngineGenerateError", "OutputSink", "StreamItem", "caller_error", "to_sink"]


class EngineDeadError(FerrokvError, RuntimeError):
    """The engine loop was shut down, or failed (``failed``): it takes no more requests."""

    def __init__(self, message: str, failed: bool = False) -> None:
        super().__init__(message)
        self.failed = failed


class EngineGenerateError(FerrokvError, RuntimeError):
    """A request ended by a failed engine step (vLLM's name); the step's exception is its
    ``__cause__``, and its message repeats it."""


@dataclass(slots=True, frozen=True)
class StreamItem:
    """One item on a request's sink: an output, or the error that ended the request."""

    request_id: str
    output: RequestOutput | None = None  # None exactly when error is set
    error: BaseException | None = None
    refused: bool = False  # the error is the request's own refusal when added (bad input), not a failed step

    @property
    def finished(self) -> bool:
        return self.error is not None or self.output is None or self.output.finished


def caller_error(item: StreamItem) -> BaseException:
    """What a caller waiting on a sink raises for its error ``item``: a refusal (bad input) as it is; a
    failure shared by many requests (a failed step, the loop's end; a ``KeyboardInterrupt`` or ``SystemExit``
    that engine code raised on the loop's thread) as an exception of the caller's own, so that raising it in
    each caller never chains every caller's frames onto one object's traceback (nor races across threads)."""
    e = item.error
    assert e is not None
    if item.refused and isinstance(e, Exception):
        return e
    own: Exception
    if isinstance(e, EngineDeadError):
        own = EngineDeadError(str(e), e.failed)
        own.__cause__ = e.__cause__
    else:
        own = EngineGenerateError(f"request {item.request_id!r} ended by a failed engine step "
                                  f"({type(e).__name__}: {e})")
        own.__cause__ = e
    return own


class OutputSink(Protocol):
    def put(self, item: StreamItem, /) -> None: ...  # optional: flush() and accepted, see the module docs


def to_sink(request_id: str | None, call: Callable[..., None], *args: Any) -> None:
    """``call(*args)``, a sink's ``put``, ``accepted`` or ``flush`` (``request_id`` None: of several
    requests): a sink that broke (e.g. its event loop closed) is logged and must not stop the loop."""
    try:
        call(*args)
    except Exception:
        logger.exception("engine loop: the sink of request %r failed", request_id)
