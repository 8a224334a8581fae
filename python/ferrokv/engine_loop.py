"""EngineLoop: one thread owns an ``LLMEngine``; callers submit requests and receive their own outputs.

Why a loop: ``LLMEngine.step()`` returns the outputs of every request in its batch, so two threads that each
stepped would consume each other's outputs (and a lock alone would not fix that). The loop is the engine's one
driver: it applies what callers queue (submits, aborts, a shutdown) between steps, steps while anything is
unfinished, and routes each ``RequestOutput`` to the sink its request was submitted with, by request id (with
overlap, one that does not end its request as soon as it is made: during the next step's forward pass, through
``LLMEngine.deliver``). ``LLM`` and ``AsyncLLM`` run their requests through it, from any number of threads.

Interface (every method is safe from any thread):

* ``submit(request_id, prompt, params, *, sink, priority=0, cache_salt=None, warm=True)`` and ``submit_beam(request_id,
  prompt, *, sink, beam_width, max_tokens, ...)`` queue a request;
* ``abort(request_ids)`` queues aborts (unknown or finished ids are ignored); an aborted id may be submitted
  again at once, as after ``abandon``;
* a request id (a str, or an int) is claimed from its submit to its terminal item: submitting an id in use
  raises ``ValueError`` at once, unless every holder of the id gave it up (``abandon(request_id, sink)``: a
  caller that stopped reading, e.g. a cancelled task): then the new request waits in the loop until the old
  one's terminal item was delivered, so that a request retried under its id right after a timeout starts at
  once, as in vLLM;
* ``stream(request_id, prompt, params)``: one request's outputs as an iterator (closing it early aborts the
  request);
* ``shutdown()`` ends the loop, and with it every request still in it; idempotent.

A sink is anything with a non-blocking ``put(item: StreamItem)``: a ``queue.SimpleQueue``, or an asyncio
adapter that calls ``loop.call_soon_threadsafe``. It is called from the loop's thread, for an output that does
not end its request possibly inside a step (overlap): it must not call the engine. A sink may also have a
``flush()``, which the loop calls after each batch of puts it made (a step's outputs, the commands applied
before it): such a sink may hold its items until then, so that an asyncio adapter wakes its event loop once
per step rather than once per output. Its ``accepted()`` (if not None) is called once the engine took the
request (its checks passed), before any of its outputs.

Invariants:

* Every submitted request gets exactly one terminal item on its sink: its finished output (``finish_reason``
  "abort" on the sequences an abort ended) or an error (a bad request, a failed step, the loop shut down).
  Before it come the progress outputs its ``output_kind`` asks for (none for ``FINAL_ONLY``: the engine builds
  none).
* Only the loop's thread adds requests and steps. It starts on the first submit as a daemon thread, so it
  never keeps the interpreter alive; ``shutdown`` ends it (``LLM`` calls it when collected, and joins the
  thread) and an ``atexit`` hook joins every loop still running. A child of ``os.fork()`` has no copy of a
  started loop's thread: there every such loop is dead (a clear ``EngineDeadError``, not a caller waiting
  forever on a sink). On CUDA its current device is the model's (the current device is per thread, and kernels
  launch on it). A caller waits on its sink, so a ``KeyboardInterrupt`` lands in the caller, which aborts its
  requests (``LLM._run``), never inside a step.
* Aborts are applied between steps (at most one step's wait), on the loop's thread (it waits for the engine
  lock a getter may hold), so an abort's output is routed before any later request of the same id starts.
  ``LLMEngine.abort_request`` is safe from any thread too; its aborts reach their sinks through
  ``LLMEngine.on_abort``, called on the loop's thread only (``LLMEngine.report_aborts_here``: an interrupt in
  the aborting thread cannot lose one).
* A step that raises (the engine has cancelled it) ends every request of the loop with that exception (a
  waiter raises ``EngineGenerateError`` from it: ``caller_error``), so nobody waits for a request the failure
  left behind, and the loop goes on; after ``MAX_FAILED_STEPS`` such steps in a row it ends
  (``EngineDeadError``, the failure its cause). An error in the loop itself ends every request with
  ``EngineDeadError`` and the loop with it.
* Requests added to the engine directly while a loop drives it are stepped but reported nowhere; another
  thread's ``engine.step()`` is refused (``RuntimeError``) while the loop holds requests.

Costs: per step one ``put`` per output the engine built, one ``flush`` per distinct flush of those sinks, and
O(1) per command; an idle loop sleeps on its inbox (a ``queue.SimpleQueue``).
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ferrokv.engine import LLMEngine
from ferrokv.inputs import request_id_str, request_ids as request_ids_of
from ferrokv.outputs import RequestOutput
from ferrokv.output_sinks import (EngineDeadError, EngineGenerateError, OutputSink, StreamItem, caller_error,
                                  to_sink)
from ferrokv.sampling_params import SamplingParams

logger = logging.getLogger("ferrokv")

# The sink side (``ferrokv.output_sinks``) is re-exported: callers import it from here too.
__all__ = ["EngineDeadError", "EngineGenerateError", "EngineLoop", "OutputSink", "StreamItem", "caller_error"]


@dataclass(slots=True)
class _Submit:
    request_id: str
    add: Callable[[LLMEngine], None]
    sink: OutputSink


@dataclass(slots=True)
class _Abort:
    request_ids: list[str]


@dataclass(slots=True)
class _Abandon:
    request_id: str
    sink: OutputSink


@dataclass(slots=True)
class _Aborted:
    output: RequestOutput


@dataclass(slots=True)
class _Record:
    sink: OutputSink


@dataclass(slots=True)
class _Claim:
    """One holder of a request id: its sink, and whether it gave the id up (``abandon``)."""

    sink: OutputSink
    abandoned: bool = False


@dataclass(slots=True)
class _Deferred:
    """A submit waiting for an earlier request of its id to end; ``aborted``: an abort of the id,
    or its holder's abandon, came meanwhile (the request is then added and aborted at once, so
    it still gets its terminal output)."""

    submit: _Submit
    aborted: bool = False


# Steps that may fail in a row before the engine is taken for broken (a poisoned device, say): the
# loop then ends, and with it every request, its health check and its server's /health.
MAX_FAILED_STEPS = 3
_SHUTDOWN = object()
_WAKE = object()  # reports of aborts are queued in the engine (LLMEngine.report_aborts)
_LOST_WAKE_S = 0.05
_running: weakref.WeakSet[EngineLoop] = weakref.WeakSet()  # loops whose thread was started


@atexit.register
def _shutdown_all() -> None:
    # The threads are daemons (nothing waits for them before atexit); joined here, so none is
    # stopped in the middle of a step when the interpreter finalizes.
    for loop in list(_running):
        loop.shutdown()


def _dead_in_fork_child() -> None:
    # Only the forking thread lives on in the child: a started loop's thread is gone, and its
    # lock may have been copied held. A fresh lock, and the loop dead.
    for loop in list(_running):
        loop._state = threading.Lock()
        if loop._dead is None:  # one shut down before the fork says so still
            loop._dead = EngineDeadError(
                f"this engine's loop ran in process {loop._pid}, and its thread does not survive os.fork(); "
                "create the LLM in the child process (or use multiprocessing's 'spawn' start method)")


os.register_at_fork(after_in_child=_dead_in_fork_child)


class EngineLoop:
    def __init__(self, engine: LLMEngine, name: str = "ferrokv-engine-loop") -> None:
        self.engine = engine
        self._name = name
        # Commands, put by any thread. A SimpleQueue is C code end to end: a KeyboardInterrupt in
        # a caller cannot land half-way through a put (threading.Event.set takes its Condition's
        # lock in Python code, and an interrupt there left it held: every caller then hung).
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._records: dict[str, _Record] = {}  # the loop thread's alone
        self._claims: dict[str, list[_Claim]] = {}  # ids submitted and not ended, by holder (under _state)
        self._deferred: dict[str, list[_Deferred]] = {}  # the loop thread's: submits of an id still in the engine
        self._flushes: set[Callable[[], None]] = set()  # the loop thread's: flush() of sinks put to since the last
        self._state = threading.Lock()  # orders starting/ending the thread against queuing
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()  # of the process whose thread runs the loop (os.fork)
        self._stepping = False  # the loop's thread is in engine.step()
        self._failed_steps = 0  # in a row
        self._dead: EngineDeadError | None = None
        self._held: list[RequestOutput] = []  # final outputs made during a step, routed once it is over
        engine.on_abort = self._on_abort
        engine.before_step = self._refuse_foreign_step

    # ------------------------------------------------------------------------------------------
    # Callers (any thread)
    def submit(self, request_id: str, prompt: Any, params: SamplingParams | None = None, *, sink: OutputSink,
               priority: int = 0, cache_salt: str | None = None, warm: bool = True) -> None:
        """Queues ``LLMEngine.add_request(request_id, prompt, params, ...)``; its error, if any,
        is the request's terminal item. Raises ``EngineDeadError`` after ``shutdown``. A
        structured-output grammar is compiled here (``warm``; an event loop compiles it before,
        without blocking: ``AsyncLLM``), waiting on the caller's thread, so that the loop finds
        it cached."""
        with self._state:  # a dead loop takes nothing: not even a grammar's compile first
            if self._dead is not None:
                raise EngineDeadError(str(self._dead), self._dead.failed)
        grammar = self.warm_grammar(params) if warm else None

        def add(engine: LLMEngine) -> None:
            _ = grammar  # its entry is held until the add, which finds it then (GrammarCompiler)
            engine.add_request(request_id, prompt, params, priority=priority, cache_salt=cache_salt)

        self._queue(_Submit(request_id_str(request_id), add, sink), start=True)

    def warm_grammar(self, params: Any) -> Any:
        """Compiles a request's structured-output grammar, waiting on the caller's thread (any),
        and returns the compiler's entry (None without a grammar): held until the loop's
        ``add_request``, it is found there. An error (an entry too) is left for ``add_request``,
        which raises it as the request's terminal item."""
        so = getattr(params, "structured_outputs", None)
        if so is None:
            return None
        try:
            return self.engine.grammars.entry(so).result()
        except Exception:
            return None

    def submit_beam(self, request_id: str, prompt: Any, *, sink: OutputSink, beam_width: int, max_tokens: int,
                    length_penalty: float = 1.0, ignore_eos: bool = False) -> None:
        """Queues ``LLMEngine.add_beam_request``; its one output comes when the search ends."""
        def add(engine: LLMEngine) -> None:
            engine.add_beam_request(request_id, prompt, beam_width, max_tokens, length_penalty, ignore_eos)

        self._queue(_Submit(request_id_str(request_id), add, sink), start=True)

    def abort(self, request_ids: str | list[str]) -> None:
        """Queues aborts, applied between steps; each request's terminal item follows. The ids
        may be submitted again at once (as after ``abandon``)."""
        ids = request_ids_of(request_ids)
        if ids:
            self._queue(_Abort(ids), start=False)

    def abandon(self, request_id: str, sink: OutputSink) -> None:
        """The holder whose sink is ``sink`` stops reading request ``request_id``: its request
        (that one only: a later request under the id is not touched) is aborted, and the id may be
        submitted again at once (module docs). Nothing happens once its terminal item was delivered."""
        held = False
        with self._state:
            for claim in self._claims.get(request_id, ()):
                if claim.sink is sink:
                    claim.abandoned = held = True
        if held:
            self._queue(_Abandon(request_id, sink), start=False)

    def stream(self, request_id: str, prompt: Any, params: SamplingParams | None = None,
               **kwargs: Any) -> Iterator[RequestOutput]:
        """Submits one request and returns an iterator of its outputs (the last one finished);
        raises the request's error; closing the iterator before the end aborts the request."""
        sink: queue.SimpleQueue[StreamItem] = queue.SimpleQueue()
        self.submit(request_id, prompt, params, sink=sink, **kwargs)
        return self._iterate(request_id_str(request_id), sink)

    def shutdown(self, wait: bool = True, timeout: float | None = None) -> None:
        """Ends the loop after the step in progress; requests still in it end with
        ``EngineDeadError``. ``wait``: join the thread (never from the thread itself), for at
        most ``timeout`` seconds (None: until it ends)."""
        with self._state:
            thread = self._thread
            if self._dead is None:
                self._dead = EngineDeadError("the engine loop was shut down")
                if thread is not None:
                    self._inbox.put(_SHUTDOWN)
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def holding(self, request_ids: set[str]) -> set[str]:
        """Those of ``request_ids`` still claimed: submitted, their terminal item not yet delivered."""
        with self._state:
            return {i for i in request_ids if self._claims.get(i)}

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _iterate(self, request_id: str, sink: queue.SimpleQueue[StreamItem]) -> Iterator[RequestOutput]:
        done = False
        try:
            while not done:
                item = sink.get()
                done = item.finished
                if item.error is not None:
                    raise caller_error(item)
                assert item.output is not None
                yield item.output
        finally:
            if not done:
                self.abandon(request_id, sink)

    def _queue(self, command: Any, start: bool) -> None:
        with self._state:
            if self._dead is not None:
                if not start:
                    return  # nothing is left to abort
                raise EngineDeadError(str(self._dead), self._dead.failed)
            claimed = None
            if isinstance(command, _Submit):
                # Claimed until its terminal item: a second submit of the id fails here, so the
                # refused caller never holds (and, cancelled, never aborts) the id of another;
                # unless every holder gave it up (module docs).
                if not all(c.abandoned for c in self._claims.get(command.request_id, ())):
                    raise ValueError(f"request_id={command.request_id!r} is already in use")
                claimed = _Claim(command.sink)
                self._claims.setdefault(command.request_id, []).append(claimed)
            elif isinstance(command, _Abort):
                # An aborted id is free again at once, as in vLLM: a request submitted under it
                # waits in the loop until the aborted one's terminal item was delivered.
                for rid in command.request_ids:
                    for claim in self._claims.get(rid, ()):
                        claim.abandoned = True
            try:
                if self._thread is None:
                    if not start:
                        return
                    self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                    self._thread.start()
                    self._pid = os.getpid()
                    _running.add(self)
                self._inbox.put(command)
            except BaseException:  # an interrupt before the put: the id was never queued
                if claimed is not None:
                    self._release(command.request_id, claimed.sink)
                raise

    def _release(self, request_id: str, sink: OutputSink) -> None:
        """Ends the claim of ``sink``'s holder on ``request_id`` (under _state)."""
        holders = self._claims.get(request_id, [])
        for i, claim in enumerate(holders):
            if claim.sink is sink:
                del holders[i]
                break
        if not holders:
            self._claims.pop(request_id, None)

    def _on_abort(self, output: RequestOutput) -> None:
        # LLMEngine.on_abort: called on the loop's thread only (report_aborts_here), so that no
        # interrupt loses a report. The loop's own aborts (abort_request(wait=True)) are routed at
        # once, to the record of the request they belong to (queued, a later request of the same
        # id could take its record first); those reported as a step ends are queued, to follow
        # the step's outputs.
        if self._thread is None or self._dead is not None:
            return
        if threading.current_thread() is self._thread and not self._stepping:
            self._apply(_Aborted(output))
        else:  # as a step ended: after the step's outputs are routed (or before the loop reported)
            self._inbox.put(_Aborted(output))

    def _refuse_foreign_step(self) -> None:
        """Another thread's ``engine.step()`` would take the outputs of this loop's requests,
        whose callers would then wait forever: refused while any is claimed (an idle or dead loop,
        e.g. in a forked child, leaves the engine to whoever steps it)."""
        if self._dead is None and self._claims and threading.current_thread() is not self._thread:
            raise RuntimeError("LLMEngine.step() was called from another thread while the engine loop drives this "
                               "engine (LLM.generate/chat/beam_search or AsyncLLM requests are running): their "
                               "outputs are the loop's; step the engine yourself only when those calls have returned")

    # ------------------------------------------------------------------------------------------
    # The loop's thread
    def _run(self) -> None:
        cause: BaseException | None = None
        try:
            self.engine.report_aborts_here(self._wake)
            while self._serve_once():
                pass
        except BaseException as e:  # a bug in the loop: end every request rather than hang them
            logger.exception("engine loop failed; every request in it ends with EngineDeadError")
            cause = e
        self._die(cause)

    def _serve_once(self) -> bool:
        """Applies queued commands, then runs one step if anything is unfinished; False once
        the loop is to end."""
        self.engine.report_aborts()  # of aborts another thread applied (it woke us)
        idle = not self.engine.has_unfinished_requests()
        while True:
            try:
                # Idle: sleep until a command comes. A request left unreported then had its abort
                # applied by another thread, whose wake an interrupt may have lost: look again soon.
                command = (self._inbox.get(timeout=_LOST_WAKE_S if self._records else None) if idle
                           else self._inbox.get_nowait())
            except queue.Empty:
                break
            idle = False
            if command is _SHUTDOWN:
                return False
            self._apply(command)
        self._flush()
        if self.engine.has_unfinished_requests():
            self._stepping = True
            self.engine.deliver = self._route_made  # this loop's step only (a caller may step an idle engine)
            try:
                outputs = self.engine.step()
            except BaseException as e:  # the engine cancelled the step (or aborted its requests)
                self.engine.deliver = None
                self._stepping = False
                self._route(self._take_held())  # requests that ended before the failure
                self._fail_all(e)
                self._flush()
                self._failed_steps += 1
                if self._failed_steps < MAX_FAILED_STEPS:
                    return True
                with self._state:
                    self._dead = EngineDeadError(f"the engine failed {self._failed_steps} steps in a row "
                                                 f"(the last with {type(e).__name__}: {e})", failed=True)
                raise
            self._failed_steps = 0
            self.engine.deliver = None
            self._stepping = False
            self._route(self._take_held() + outputs)
            self._flush()
        return True

    def _route_made(self, outputs: list[RequestOutput]) -> None:
        """``LLMEngine.deliver``: the previous step's outputs, routed while a forward pass runs,
        except those that end a request: held until the step is over, so that a caller told its
        request ended finds the engine as the step left it (and a submit its id was waiting for
        starts outside the step)."""
        self._held += [o for o in outputs if o.finished]
        self._route([o for o in outputs if not o.finished])
        self._flush()

    def _take_held(self) -> list[RequestOutput]:
        held, self._held = self._held, []
        return held

    def _wake(self) -> None:
        self._inbox.put(_WAKE)

    def _deliver(self, sink: OutputSink, item: StreamItem) -> None:
        if item.finished:
            with self._state:
                self._release(item.request_id, sink)
        to_sink(item.request_id, sink.put, item)
        self._flush_later(sink)
        rid = item.request_id
        if item.finished and rid in self._deferred and rid not in self._records:
            self._start_deferred(rid)

    def _flush_later(self, sink: OutputSink) -> None:
        flush = getattr(sink, "flush", None)
        if flush is not None:
            self._flushes.add(flush)  # bound methods of one object are equal: one flush each

    def _start_deferred(self, request_id: str) -> None:
        """Adds the next submit that waited for ``request_id``'s earlier request to end; one
        whose holder gave it up, or aborted meanwhile, is added and aborted at once (its
        terminal item releases its claim, and starts the next)."""
        waiting = self._deferred[request_id]
        entry = waiting.pop(0)
        if not waiting:
            del self._deferred[request_id]
        self._add(entry.submit)
        if entry.aborted and request_id in self._records:
            self.engine.abort_request(request_id, wait=True)  # reported through _on_abort

    def _flush(self) -> None:
        flushes, self._flushes = self._flushes, set()
        for flush in flushes:
            to_sink(None, flush)

    def _apply(self, command: Any) -> None:
        if isinstance(command, _Submit):
            rid = command.request_id
            if rid in self._records or rid in self._deferred:  # an earlier request of the id is not over
                self._deferred.setdefault(rid, []).append(_Deferred(command))
            else:
                self._add(command)
        elif isinstance(command, _Abort):
            for rid in command.request_ids:
                for entry in self._deferred.get(rid, ()):
                    entry.aborted = True
            self.engine.abort_request(command.request_ids, wait=True)  # reported through _on_abort
        elif isinstance(command, _Abandon):
            rec = self._records.get(command.request_id)
            if rec is not None and rec.sink is command.sink:
                self.engine.abort_request(command.request_id, wait=True)
            for entry in self._deferred.get(command.request_id, ()):
                if entry.submit.sink is command.sink:
                    entry.aborted = True
        elif isinstance(command, _Aborted):  # an aborted request's last outputs, its final one last
            output = command.output
            records = self._records
            rec = records.pop(output.request_id, None) if output.finished else records.get(output.request_id)
            if rec is not None:
                self._deliver(rec.sink, StreamItem(output.request_id, output))

    def _add(self, command: _Submit) -> None:
        try:
            command.add(self.engine)
        except BaseException as e:
            self._deliver(command.sink, StreamItem(command.request_id, error=e, refused=True))
            return
        self._records[command.request_id] = _Record(command.sink)
        accepted = getattr(command.sink, "accepted", None)
        if accepted is not None:
            to_sink(command.request_id, accepted)
            self._flush_later(command.sink)

    def _route(self, outputs: list[RequestOutput]) -> None:
        for o in outputs:
            rec = self._records.get(o.request_id)
            if rec is None:
                continue
            if o.finished:
                del self._records[o.request_id]
            self._deliver(rec.sink, StreamItem(o.request_id, o))

    def _fail_all(self, error: BaseException) -> None:
        records, self._records = self._records, {}
        logger.warning("engine step failed (%s: %s); ending its %d request(s)",
                       type(error).__name__, error, len(records))
        self.engine.abort_request(list(records), wait=True)  # first: a caller told of the error finds them gone
        for rid, rec in records.items():
            self._deliver(rec.sink, StreamItem(rid, error=error))  # then a submit that waited for it starts

    def _die(self, cause: BaseException | None) -> None:
        with self._state:
            if self._dead is None:
                self._dead = EngineDeadError("the engine loop failed", failed=True)
            pending = [entry.submit for waiting in self._deferred.values() for entry in waiting]
            self._deferred = {}
            while not self._inbox.empty():
                c = self._inbox.get_nowait()
                if isinstance(c, _Submit):
                    pending.append(c)
        error = EngineDeadError(str(self._dead), self._dead.failed)
        error.__cause__ = cause
        self._route(self._take_held())  # requests that ended before the loop failed
        records, self._records = self._records, {}
        self.engine.on_abort = None
        self.engine.report_aborts_here(None)
        try:
            self.engine.abort_request(list(records))  # first, as in _fail_all
        except BaseException:
            logger.exception("engine loop: aborting its requests failed")
        for c in pending:
            self._deliver(c.sink, StreamItem(c.request_id, error=error))
        for rid, rec in records.items():
            self._deliver(rec.sink, StreamItem(rid, error=error))
        self._flush()
        self.engine.worker.close()  # no step is in flight: each waits for its job
