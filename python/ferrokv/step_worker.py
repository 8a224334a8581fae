"""Runs a step's forward pass and sampling beside the engine's thread, so that the host work that
does not need the step's tokens (the previous step's text and outputs) overlaps with it.

``StepWorker.submit(fn)`` starts ``fn`` and returns a ``StepJob``; ``StepJob.wait()`` returns its
result or raises its exception. Threaded (the CPU, where torch runs the forward pass on the calling
thread): one daemon thread runs the jobs, one at a time, in order. Inline (a GPU, where kernels are
queued and the host goes on at once; or overlap turned off): ``submit`` runs ``fn`` at once and
``wait`` hands back what it did.

Invariants: at most one job is in flight (the engine waits for each before it submits the next); a
job touches no scheduler state, only tensors and numpy arrays prepared for it; ``join`` returns
only when the job has ended (a ``KeyboardInterrupt`` meanwhile is held back and re-raised after),
so a cancelled step never races the job that reads its inputs. On CUDA the thread's current device
is the engine's.
Costs per step: inline, nothing; threaded, one queue put and one lock hand-off.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["StepJob", "StepWorker"]


class StepJob:
    """One submitted job (see the module docs)."""

    __slots__ = ("_fn", "_done", "_finished", "_result", "_error")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._fn = fn
        self._done = threading.Lock()
        self._done.acquire()  # released when the job has ended
        self._finished = False
        self._result: Any = None
        self._error: BaseException | None = None

    def run(self) -> None:
        try:
            self._result = self._fn()
        except BaseException as e:  # handed to the waiter, which re-raises it
            self._error = e
        finally:
            self._fn = None
            self._finished = True
            self._done.release()

    def wait(self) -> Any:
        """The job's result; its exception is re-raised here. Interruptible."""
        if not self._finished:
            self._done.acquire()
            self._done.release()
        if self._error is not None:
            raise self._error
        return self._result

    def join(self) -> None:
        """Waits until the job has ended, whatever it raised; a ``KeyboardInterrupt`` that lands
        while waiting is re-raised once the job has ended."""
        interrupted: BaseException | None = None
        while not self._finished:
            try:
                if self._done.acquire(timeout=0.05):
                    self._done.release()
            except KeyboardInterrupt as e:
                interrupted = e
        if interrupted is not None:
            raise interrupted


class StepWorker:
    """Runs step jobs on a thread of its own (``threaded``) or inline."""

    def __init__(self, threaded: bool, device: torch.device) -> None:
        self.threaded = threaded
        self.device = device
        self._queue: queue.SimpleQueue[StepJob | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[[], Any]) -> StepJob:
        job = StepJob(fn)
        if not self.threaded:
            job.run()
            return job
        if self._thread is None:
            # The thread holds the queue, not the worker, so that a dropped worker is collected
            # (``__del__`` ends the thread).
            self._thread = threading.Thread(target=_run_jobs, args=(self._queue, self.device), name="ferrokv-step",
                                            daemon=True)
            self._thread.start()
        self._queue.put(job)
        return job

    def close(self) -> None:
        """Ends the thread (after the job in flight, if any); idempotent. A later ``submit``
        starts another."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread = None

    def __del__(self) -> None:
        self.close()


def _run_jobs(jobs: queue.SimpleQueue[StepJob | None], device: torch.device) -> None:
    """The worker thread: runs jobs until ``None``. It keeps no finished job (its result, logits
    included, is the waiter's alone)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    while True:
        job = jobs.get()
        if job is None:
            return
        job.run()
        del job
