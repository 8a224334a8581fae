"""``ferrokv.engine_lock.EngineLock`` alone: re-entry is an error, an interrupt as the lock is
taken leaves it free, a non-waiting sync never waits for the holder (which applies what was
queued as it releases), and reports survive an interrupted one."""
from __future__ import annotations

import threading

import pytest

from ferrokv.engine_lock import EngineLock


class _Interrupting:
    """A lock whose first ``acquire`` takes it, then raises KeyboardInterrupt (a SIGINT landing
    right after it returns)."""

    def __init__(self, lock) -> None:
        self._lock, self.armed = lock, True

    def __getattr__(self, name):
        return getattr(self._lock, name)

    def acquire(self, *args, **kwargs):
        got = self._lock.acquire(*args, **kwargs)
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt
        return got


def make() -> tuple[EngineLock, list, list]:
    """A lock whose ``before_release`` applies (records and clears) the queued aborts, as the
    engine's does."""
    released, reported = [], []

    def before_release():
        released.append(list(guard.abort_inbox))
        guard.abort_inbox.clear()

    guard = EngineLock(before_release, reported.append)
    return guard, released, reported


def test_a_call_runs_holding_the_lock_and_releases_through_before_release():
    guard, released, _ = make()
    assert guard.call("f", lambda: guard._lock._is_owned()) is True
    assert released == [[]] and not guard._lock._is_owned()
    with pytest.raises(RuntimeError, match=r"LLMEngine\.g\(\) was called from inside another engine call"):
        guard.call("f", lambda: guard.call("g", lambda: None))
    assert not guard._lock._is_owned()


@pytest.mark.parametrize("how", ["call", "sync"])
def test_an_interrupt_as_the_lock_is_taken_leaves_it_free(how):
    guard, _, _ = make()
    guard._lock = _Interrupting(guard._lock)
    with pytest.raises(KeyboardInterrupt):
        guard.call("f", lambda: None) if how == "call" else guard.sync(wait=True)
    other = threading.Thread(target=guard.sync, kwargs={"wait": True})
    other.start()
    other.join(timeout=30)
    assert not other.is_alive(), "the lock was left held"


def test_a_sync_that_does_not_wait_leaves_queued_aborts_to_the_holder():
    guard, released, _ = make()
    inside, go_on = threading.Event(), threading.Event()

    def hold():
        inside.set()
        go_on.wait()

    holder = threading.Thread(target=guard.call, args=("step", hold))
    holder.start()
    inside.wait()
    guard.abort_inbox.append("r1")
    guard.drain()  # returns at once: the holder is busy
    assert released == []
    go_on.set()
    holder.join()
    assert released == [["r1"]]  # the holder's release applied the queued abort


def test_reports_survive_an_interrupted_one():
    reported = []

    def report(o):
        reported.append(o)
        if o == "a":
            raise KeyboardInterrupt

    guard = EngineLock(lambda: None, report)
    guard.aborted.extend(["a", "b", "c"])
    with pytest.raises(KeyboardInterrupt):
        guard.sync(wait=True)
    assert reported == ["a"] and list(guard.aborted) == ["b", "c"]
    guard.sync(wait=False)
    assert reported == ["a", "b", "c"] and not guard.aborted


def test_each_call_makes_the_engines_cuda_device_current(monkeypatch):
    """CUDA's current device is per thread, and kernels launch on it: every call, from any thread,
    sets the engine's first (stubbed here: no GPU); a CPU engine's calls touch no CUDA state."""
    import torch

    made_current = []
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    cuda = EngineLock(lambda: None, lambda _: None, torch.device("cuda", 1))
    seen = []
    cuda.call("step", lambda: seen.append(list(made_current)))
    worker = threading.Thread(target=cuda.call, args=("add_request", lambda: None))
    worker.start()
    worker.join()
    assert seen == [[torch.device("cuda", 1)]] and made_current == [torch.device("cuda", 1)] * 2
    EngineLock(lambda: None, lambda _: None, torch.device("cpu")).call("step", lambda: None)
    EngineLock(lambda: None, lambda _: None).call("step", lambda: None)
    assert len(made_current) == 2
