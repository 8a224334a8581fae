"""The threads grammar compiles run on: a small pool whose threads have a large stack.

llguidance validates and builds a grammar recursively, one native stack frame per link of a chain
of rules or ``$ref``s; a flat chain of a few thousand links (a 50-100 KB request) overflows a
default 8 MiB thread stack and kills the process (SIGSEGV, nothing logged). On these threads
(``COMPILE_STACK_BYTES``) a grammar up to ``MAX_GRAMMAR_CHARS`` characters of llguidance text fits
with room to spare, and ``ferrokv.structured_outputs`` refuses a larger one before building it.
Compiles also stay off the pool that tokenizes prompts, so a slow grammar delays only other grammars.

Invariants: ``submit_compile(fn, *args)`` runs ``fn`` on a pool thread; a task there never waits
for another task (the compiler shares a build through its future, waited for elsewhere). The pool
is made on first use and again in a forked child (its threads do not survive a fork); a pool that
cannot start (no address space for the stacks) raises ``RuntimeError`` then and at every later
call, and leaves no thread behind. Costs: the stack is address space, reserved, not memory
committed; a compile waits for one of ``COMPILE_THREADS`` threads.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["COMPILE_STACK_BYTES", "COMPILE_THREADS", "MAX_GRAMMAR_CHARS", "submit_compile"]

# Measured: the deepest chains need ~170 bytes of stack per character of grammar text (a chain of Lark
# rules); llguidance's own symbol limit ends longer ones before any recursion.
MAX_GRAMMAR_CHARS = 2 << 20
COMPILE_STACK_BYTES = 512 << 20
COMPILE_THREADS = 2
_NAME = "ferrokv-grammar"
_T = TypeVar("_T")


def _make_pool() -> ThreadPoolExecutor:
    """A pool whose threads are all started now, under the large stack size (the setting is
    process-wide and read when a thread starts)."""
    pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix=_NAME)
    old = threading.stack_size()
    started = threading.Barrier(COMPILE_THREADS)
    try:
        threading.stack_size(COMPILE_STACK_BYTES)
        # Each task waits for the others, so that every thread of the pool is started here.
        for f in [pool.submit(started.wait, 60.0) for _ in range(COMPILE_THREADS)]:
            f.result()
    except (RuntimeError, ValueError, threading.BrokenBarrierError) as e:  # no address space for such stacks
        started.abort()  # a thread that did start stops waiting, and the pool ends
        pool.shutdown(wait=False, cancel_futures=True)
        raise RuntimeError(f"cannot start the grammar compile threads with a {COMPILE_STACK_BYTES >> 20} MiB "
                           f"stack: {e}") from e
    finally:
        threading.stack_size(old)
    return pool


_pool: ThreadPoolExecutor | None = None
_pool_error: RuntimeError | None = None
_pool_lock = threading.Lock()


def _get_pool() -> ThreadPoolExecutor:
    global _pool, _pool_error
    with _pool_lock:
        if _pool_error is not None:
            raise RuntimeError(str(_pool_error))
        if _pool is None:
            try:
                _pool = _make_pool()
            except RuntimeError as e:
                _pool_error = e
                raise
        return _pool


def _forget_pool_in_child() -> None:
    global _pool, _pool_error, _pool_lock
    _pool, _pool_error, _pool_lock = None, None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool_in_child)


def submit_compile(fn: Callable[..., _T], *args: Any) -> Future[_T]:
    """``fn(*args)`` on a compile thread; its future."""
    return _get_pool().submit(fn, *args)
