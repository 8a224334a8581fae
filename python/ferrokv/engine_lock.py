"""The engine lock: one thread at a time in ``LLMEngine``'s scheduler calls, aborts queued from
any thread, and the reports of aborted requests (``LLMEngine`` module docs, "Threads").

Invariants: every release first runs the engine's ``before_release`` (apply queued aborts,
refresh the getters' snapshot) while still holding the lock, then hands the aborted requests'
outputs to ``report`` one at a time, then applies aborts queued meanwhile if the lock is free.
An interrupt (Ctrl-C) anywhere cannot leave the lock held: it is reentrant only so that a
release frees whatever this thread holds (the lock knows its owner) rather than what the thread
recorded taking, which an interrupt between taking it and recording it would lose; and the
release runs first thing in a ``finally``, before any Python call where a signal is checked.
A call from inside another on the same thread is a ``RuntimeError`` (it would run mid-step).
An interrupted report leaves the rest queued for the next release. ``returned`` (if given) runs on
the calling thread as each call ends, after all of that.
Reports can be confined to one thread (``report_here``): one no ``KeyboardInterrupt`` reaches
(not the main thread), so that none is lost between being taken from the queue and handed to
``report``; another thread that applies aborts then leaves their reports queued and calls the
reporter's ``wake``, and the reporter hands them out (``report_queued``).
Costs: O(1) per call, plus the queued aborts and reports.
"""

from __future__ import annotations

import functools
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["EngineLock", "exclusive"]

_T = TypeVar("_T")
_F = TypeVar("_F", bound=Callable[..., Any])


def exclusive(method: _F) -> _F:
    """Runs a method holding its object's ``_guard`` (an ``EngineLock``): ``LLMEngine``'s entry points."""

    @functools.wraps(method)
    def locked(self: Any, *args: Any, **kwargs: Any) -> Any:
        return self._guard.call(method.__name__, functools.partial(method, self, *args, **kwargs))

    return locked  # type: ignore[return-value]


class EngineLock:
    def __init__(self, before_release: Callable[[], None], report: Callable[[Any], None],
                 device: torch.device | None = None, returned: Callable[[], None] | None = None) -> None:
        # The engine's CUDA device (indexed): each call makes it its thread's current device.
        self._cuda_device = device if device is not None and device.type == "cuda" else None
        self._lock = threading.RLock()
        self._before_release = before_release
        self._report = report
        self._returned = returned  # run as each call returns (or raises) on its thread, the lock released
        self.abort_inbox: deque[str] = deque()  # request ids to abort, from any thread
        self.aborted: deque[Any] = deque()  # final outputs of aborted requests, to report
        self._reporter: int | None = None  # the one thread that reports, if set (its ident)
        self._wake: Callable[[], None] | None = None  # tells the reporter that reports are queued

    def report_here(self, wake: Callable[[], None] | None) -> None:
        """Makes the calling thread the only one that reports, told by ``wake`` that reports are
        queued (module docs); ``None``: any thread reports again."""
        self._reporter, self._wake = (None, None) if wake is None else (threading.get_ident(), wake)

    def report_queued(self) -> None:
        """Hands out the queued reports, if this thread may."""
        if self._reporter is None or self._reporter == threading.get_ident():
            while self.aborted:
                self._report(self.aborted.popleft())

    def call(self, name: str, fn: Callable[[], _T]) -> _T:
        """``fn()`` holding the lock (waiting for it); ``name`` is what an error calls it."""
        if self._lock._is_owned():  # type: ignore[attr-defined]
            raise RuntimeError(f"LLMEngine.{name}() was called from inside another engine call on the same "
                               "thread (a callback or hook): call it after that one returns")
        if self._cuda_device is not None:  # kernels launch on the calling thread's current device
            torch.cuda.set_device(self._cuda_device)
        try:
            return self._locked(fn, wait=True)  # type: ignore[return-value]
        finally:
            if self._returned is not None:
                self._returned()

    def sync(self, wait: bool) -> None:
        """Takes the lock for nothing (``wait``: for it to be free; else only if it is), so that
        queued aborts are applied, the snapshot refreshed and aborted requests reported. Inside a
        call on this thread, that call's release does it."""
        if not self._lock._is_owned():  # type: ignore[attr-defined]
            self._locked(None, wait)

    def _locked(self, fn: Callable[[], _T] | None, wait: bool) -> _T | None:
        try:
            if self._lock.acquire(blocking=wait):
                try:
                    return fn() if fn is not None else None
                finally:
                    self._before_release()
            return None
        finally:
            # Inline, not in a helper: Python checks for signals as a function starts, and an
            # interrupt there would skip the release.
            released = False
            try:
                self._lock.release()
                released = True
            except RuntimeError:  # not taken: busy (its holder applies the aborts), or interrupted first
                pass
            self._after_release(released)

    def drain(self) -> None:
        """Applies queued aborts unless another thread holds the lock: that thread sees them as
        it releases (they were queued before this try, so before that release)."""
        if self.abort_inbox:
            self.sync(wait=False)

    def _after_release(self, released: bool) -> None:
        """Reports aborted requests (or wakes the reporter), then (if this call released the
        lock) applies aborts queued meanwhile."""
        self.report_queued()
        wake = self._wake
        if self.aborted and wake is not None:
            wake()
        if released:
            self.drain()
