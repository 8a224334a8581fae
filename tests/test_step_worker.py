"""The step worker (``ferrokv.step_worker``): jobs run in order on its thread (or inline), a
job's exception reaches its waiter, and the thread ends when the worker is closed or dropped, so
that an engine leaves no thread behind."""
from __future__ import annotations

import gc
import threading

import pytest
import torch

from ferrokv.step_worker import StepWorker

CPU = torch.device("cpu")


def test_threaded_jobs_run_in_order_on_the_worker_thread():
    worker = StepWorker(True, CPU)
    seen: list[tuple[int, str]] = []
    jobs = [worker.submit(lambda i=i: seen.append((i, threading.current_thread().name)) or i) for i in range(5)]
    assert [j.wait() for j in jobs] == list(range(5))
    assert seen == [(i, "ferrokv-step") for i in range(5)]
    worker.close()


def test_a_jobs_exception_is_raised_by_wait_and_the_worker_goes_on():
    for threaded in (True, False):
        worker = StepWorker(threaded, CPU)
        bad = worker.submit(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            bad.wait()
        bad.join()  # ended: returns at once, raises nothing
        assert worker.submit(lambda: 7).wait() == 7
        worker.close()


def test_inline_runs_on_the_calling_thread():
    worker = StepWorker(False, CPU)
    assert worker.submit(lambda: threading.current_thread()).wait() is threading.current_thread()
    assert worker._thread is None


def test_close_ends_the_thread_and_a_later_submit_starts_another():
    worker = StepWorker(True, CPU)
    assert worker.submit(lambda: 1).wait() == 1
    first = worker._thread
    worker.close()
    first.join(10)
    assert not first.is_alive()
    assert worker.submit(lambda: 2).wait() == 2
    assert worker._thread is not first and worker._thread.is_alive()
    worker.close()
    worker.close()  # idempotent


def test_a_dropped_worker_ends_its_thread():
    """The thread must not keep its worker alive (it did: its target was a bound method), or
    every engine built with overlap on a CPU left a thread behind."""
    worker = StepWorker(True, CPU)
    result = worker.submit(lambda: torch.zeros(3)).wait()
    thread = worker._thread
    del worker
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()
    assert result.shape == (3,)  # the waiter's result outlives the worker
