"""Runs a function in a child of os.fork() and reports how it went, with a deadline (a child
that hangs is killed): the tests of what an engine does in a fork child."""
from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable


def in_fork_child(fn: Callable[[], str], timeout: float = 60.0) -> tuple[int | None, str]:
    """``fn()`` in a fork child: (its exit code, 0 when it returned, None when it hung and was
    killed; what it returned, or the repr of what it raised)."""
    r, w = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # "this process is multi-threaded"
        pid = os.fork()
    if pid == 0:  # the child: report and leave at once, running nothing of the parent's teardown
        code = 3
        try:
            os.write(w, fn().encode())
            code = 0
        except BaseException as e:
            os.write(w, repr(e).encode())
        finally:
            os._exit(code)
    os.close(w)
    deadline = time.monotonic() + timeout
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    with os.fdopen(r, "rb") as f:
        said = f.read().decode()
    return (os.waitstatus_to_exitcode(done[1]) if done[0] == pid else None), said
