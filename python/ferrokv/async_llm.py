"""``AsyncLLM``: the engine for asyncio, with vLLM's names: ``generate`` is an async generator.

``AsyncLLM`` wraps the same ``EngineLoop`` as ``LLM``: requests and aborts are queued to the
loop's thread, which steps the engine (the Rust step releases the GIL, so the event loop stays
responsive) and hands each output to the request's sink. Here the sink is a ``_RequestStream``,
whose ``put`` (on the engine thread) goes through its event loop's ``_LoopDispatcher``.

Invariants:

* ``generate(prompt, sampling_params, request_id)`` yields the request's outputs in the form its
  ``output_kind`` asks (``DELTA``: pieces that concatenate to the whole, a consumer that falls
  behind getting the unread ones merged into one; ``CUMULATIVE``: a consumer that falls behind
  gets the newest output only; both as in vLLM; ``FINAL_ONLY``: one output); the last one has
  ``finished`` set. The request's error is raised, as vLLM raises it: a bad request's own
  ``ValueError``; ``EngineGenerateError`` (its ``__cause__`` the step's exception) for a failed
  step; ``EngineDeadError`` once the engine loop has ended (each caller its own exception object).
* A generator that is closed or cancelled before its last output (the client went away) aborts
  its request: the engine frees its blocks when the step in progress ends.
* ``num_in_flight`` counts the requests submitted and not yet ended (for a caller that limits
  admission or drains on it); it returns to 0 once every request has ended. A request whose
  event loop closed with its generator still open (its ``finally`` never runs) is aborted at its
  next output (a ``FINAL_ONLY`` one has none before its end), and its count comes back when its
  last item finds the loop gone or its stream is collected.
* Text prompts and chat templates are tokenized on a small thread pool, never on the event loop
  or the engine loop (HF fast tokenizers release the GIL while they encode).
* vLLM's ``EngineClient`` surface: ``get_tokenizer``, ``get_model_config``, ``check_health``,
  ``reset_prefix_cache``, ``do_log_stats``, ``is_tracing_enabled`` and ``get_supported_tasks`` are
  coroutines; ``model_config``, ``errored``/``is_stopped``/``dead_error`` properties; ``abort``
  queues the abort at once and returns a coroutine (vLLM's is one).

Costs: per engine step at most one ``call_soon_threadsafe`` per event loop (the engine loop
flushes each ``_LoopDispatcher`` once per step), O(1) per output on either side.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import logging
import os
import queue
import threading
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from typing import Any

from ferrokv.checks import PoolingUnsupportedError, check_text, shown
from ferrokv.engine import LLMEngine
from ferrokv.engine_args import EngineArgs, vllm_only_method, without_vllm_only_args
from ferrokv.engine_loop import EngineDeadError, EngineGenerateError, EngineLoop, StreamItem, caller_error
from ferrokv.inputs import (check_no_lora, is_text_prompt, prompt_keep, request_id_str, tokenization_options,
                            tokenized_prompt, with_truncation)
from ferrokv.llm import chat_token_ids
from ferrokv.metrics_reader import engine_stats
from ferrokv.outputs import RequestOutput, RequestOutputKind
from ferrokv.sampling_params import SamplingParams
from ferrokv.stats_log import StatsLog

__all__ = ["AsyncLLM", "EngineDeadError", "EngineGenerateError"]

logger = logging.getLogger("ferrokv")


class _LoopDispatcher:
    """Moves items from the engine thread onto one event loop: ``post`` appends to a deque;
    ``flush`` (the engine loop calls it after a step's puts) schedules one ``_drain`` unless one
    is pending, so a step's outputs cost one wake-up of the event loop."""

    __slots__ = ("_loop", "_items", "_pending", "_on_lost")

    def __init__(self, loop: asyncio.AbstractEventLoop,
                 on_lost: Callable[[_RequestStream, StreamItem], None]) -> None:
        # Weakly: AsyncLLM keeps its dispatchers in a map weakly keyed by their loop, and a strong
        # reference here would keep every loop that ever used the engine (and its map entry) alive.
        self._loop = weakref.ref(loop)
        self._items: collections.deque[tuple[_RequestStream, StreamItem]] = collections.deque()
        self._pending = False
        self._on_lost = on_lost  # an item no event loop will ever read (AsyncLLM._lost)

    def post(self, stream: _RequestStream, item: StreamItem) -> None:  # the engine thread
        self._items.append((stream, item))

    def flush(self) -> None:  # the engine thread
        if not self._items:
            return
        loop = self._loop()
        # A loop closed with a drain scheduled never runs it: the pending flag alone would wait forever.
        if loop is not None and not loop.is_closed():
            if self._pending:
                return
            # The drain clears the flag before it pops: an item appended meanwhile is either
            # popped by it or finds the flag clear and schedules the next drain.
            self._pending = True
            try:
                loop.call_soon_threadsafe(self._drain)
                return
            except RuntimeError:  # closed since
                pass
        self._pending = False  # the event loop is closed or gone (its client too): nobody reads these
        while self._items:
            self._on_lost(*self._items.popleft())

    def drop_if_closed(self) -> None:
        """Hands what a closed event loop was sent to ``on_lost``: a drain scheduled before it closed
        never runs, and after a request's last output no flush comes to find the loop closed."""
        loop = self._loop()
        if self._items and (loop is None or loop.is_closed()):
            self.flush()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The dispatcher's event loop (called from that loop, so it is alive)."""
        loop = self._loop()
        assert loop is not None
        return loop

    def _drain(self) -> None:  # the event loop
        self._pending = False
        items = self._items
        while items:
            stream, item = items.popleft()
            stream.deliver(item)


_ACCEPTED = StreamItem("")  # a _RequestStream's own item: the engine took its request


class _Counted:
    """What ``generate`` counted for one stream (``num_in_flight``): given back once."""

    __slots__ = ("request_id", "released")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.released = False


def _if_unreleased(queue_put: Callable[[_Counted], None], counted: _Counted) -> None:
    """A collected stream's finalizer: queues its count only if nothing gave it back (the queue
    then holds only those rare streams, however many requests nobody reads num_in_flight for)."""
    if not counted.released:
        queue_put(counted)


class _RequestStream:
    """One request's sink and its consumer's queue (``put`` on the engine thread, the rest on the
    event loop). While the consumer lags, a CUMULATIVE output replaces the unread one and a DELTA
    output is merged into it (as vLLM's output collector does), so a slow consumer reads fewer,
    larger outputs; errors are always kept."""

    __slots__ = ("request_id", "_dispatcher", "_queue", "_waiter", "_kind", "_on_accepted", "_callback_error",
                 "accepted", "counted", "abandoned", "__weakref__")

    def __init__(self, request_id: str, dispatcher: _LoopDispatcher, kind: RequestOutputKind | None,
                 on_accepted: Callable[[], None] | None = None) -> None:
        self.request_id = request_id
        self._dispatcher = dispatcher
        self._queue: collections.deque[StreamItem] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._kind = kind
        self._on_accepted = on_accepted
        self._callback_error: Exception | None = None  # on_accepted's: raised to the consumer
        # OutputSink's: told only to a caller that asked (one more item on the event loop)
        self.accepted = None if on_accepted is None else self._post_accepted
        self.counted: _Counted | None = None  # AsyncLLM's: what generate counted for it
        self.abandoned = False  # AsyncLLM's: its request given up

    def put(self, item: StreamItem) -> None:  # the engine thread (OutputSink)
        self._dispatcher.post(self, item)

    def _post_accepted(self) -> None:  # the engine thread
        self._dispatcher.post(self, _ACCEPTED)

    @property
    def flush(self) -> Any:
        """The dispatcher's: one per event loop, however many of its streams got items."""
        return self._dispatcher.flush

    def deliver(self, item: StreamItem) -> None:  # the event loop
        if item is _ACCEPTED:
            try:
                self._on_accepted()  # type: ignore[misc]
            except Exception as e:  # the caller's error: its generate raises it (and abandons the request),
                self._callback_error = e  # not the drain, which has other streams' items to hand out
                self._wake()
            return
        q = self._queue
        if q and not q[-1].finished and item.error is None and self._kind is not None:
            if self._kind == RequestOutputKind.CUMULATIVE:
                q[-1] = item  # a newer cumulative output holds everything the older one did
            else:  # DELTA (FINAL_ONLY has one output)
                q[-1].output.add(item.output, aggregate=True)  # type: ignore[union-attr,arg-type]  # vLLM's aggregation
        else:
            q.append(item)
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def get(self) -> StreamItem:
        """The next item; ``on_accepted``'s error is raised here, before any item."""
        while True:
            if self._callback_error is not None:
                raise self._callback_error
            if self._queue:
                return self._queue.popleft()
            self._waiter = self._dispatcher.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None


class _Done(Coroutine[Any, Any, None]):
    """``AsyncLLM.abort``'s result: a coroutine (``await``, ``create_task`` and
    ``run_coroutine_threadsafe`` take it, as vLLM's abort is one) that is already done, since
    the abort was queued when it was called; left alone, nothing is lost and nothing warns."""

    __slots__ = ()

    def send(self, value: Any) -> Any:
        raise StopIteration(None)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        raise typ if val is None else val

    def close(self) -> None:
        pass

    def __await__(self) -> Any:
        return iter(())


class AsyncLLM:
    """The engine driven from asyncio (module docs). ``AsyncLLM(model=None, **engine_kwargs)``
    takes ``LLM``'s arguments; ``from_engine_args(EngineArgs)`` an ``EngineArgs``."""

    def __init__(self, model: str | None = None, *, tokenizer_threads: int | None = None,
                 **engine_kwargs: Any) -> None:
        """``LLM``'s keywords: ``EngineArgs`` fields, or vLLM's that ferrokv has no use for at a
        value that means what ferrokv does (``VLLM_ONLY_ARGS``: e.g. ``enable_log_requests``;
        AsyncLLM logs no requests, ``serve`` logs prompts with ``--log-prompts``)."""
        engine_kwargs = without_vllm_only_args(engine_kwargs)
        unknown = sorted(set(engine_kwargs) - set(EngineArgs.field_names()))
        if unknown:
            raise TypeError(
                f"AsyncLLM() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; "
                f"engine arguments are: {', '.join(EngineArgs.field_names())}")
        self._init(EngineArgs(model=model, **engine_kwargs), tokenizer_threads)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, start_engine_loop: bool = True, usage_context: Any = None,
                         stat_loggers: Any = None, *, tokenizer_threads: int | None = None) -> AsyncLLM:
        """vLLM's constructor (``AsyncEngineArgs`` or ``EngineArgs``); its ``start_engine_loop`` and
        ``usage_context`` are accepted (the loop starts with the first request), ``stat_loggers``
        only empty: ferrokv calls no custom logger (its metrics are ``/metrics`` and ``do_log_stats``)."""
        if stat_loggers:
            raise ValueError(f"stat_loggers must be None or empty: custom stat loggers are not supported, got "
                             f"{shown(stat_loggers)}")
        self = cls.__new__(cls)
        self._init(engine_args, tokenizer_threads)
        return self

    def _init(self, args: EngineArgs, tokenizer_threads: int | None) -> None:
        self.engine = LLMEngine(args)
        self.engine_loop = EngineLoop(self.engine, name="ferrokv-async-engine-loop")
        threads = tokenizer_threads or min(4, os.cpu_count() or 1)
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="ferrokv-tokenize")
        self._dispatchers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopDispatcher] = \
            weakref.WeakKeyDictionary()
        self._lock = threading.Lock()  # the dispatchers and the live requests: event loops may be several
        self._in_flight = 0
        self._live: dict[str, int] = {}  # request id -> event-loop streams using it (abort_all)
        self._dropped: queue.SimpleQueue[_Counted] = queue.SimpleQueue()  # _collect_dropped
        self._stats_log = StatsLog(self.stats())
        weakref.finalize(self, _close, self.engine_loop, self._pool)

    # ------------------------------------------------------------------------------------------
    # Properties the server reads, and vLLM's EngineClient queries (coroutines there)
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    async def get_tokenizer(self, lora_request: Any = None) -> Any:
        check_no_lora(lora_request)
        return self.engine.tokenizer

    @property
    def model_config(self) -> Any:
        return self.engine.model_config

    async def get_model_config(self) -> Any:
        return self.engine.model_config

    async def do_log_stats(self) -> None:
        """Logs vLLM's stats line for the interval since the previous call (``ferrokv.stats_log``;
        the server calls it periodically)."""
        self._stats_log.log(self.stats())

    async def is_tracing_enabled(self) -> bool:
        return False

    async def get_supported_tasks(self) -> tuple[str, ...]:
        return self.engine.get_supported_tasks()

    def get_default_sampling_params(self) -> SamplingParams:
        return self.engine.get_default_sampling_params()

    @property
    def errored(self) -> bool:
        """True once the engine loop failed or was shut down (vLLM's ``errored``)."""
        return self.engine_loop._dead is not None

    @property
    def is_stopped(self) -> bool:
        return not self.is_running

    @property
    def dead_error(self) -> BaseException:
        """The error a request gets from an engine that is no longer running."""
        return self.engine_loop._dead or EngineDeadError("the engine loop is running")

    async def check_health(self) -> None:
        """Raises ``EngineDeadError`` when the engine loop is no longer running."""
        if self.engine_loop._dead is not None:
            raise EngineDeadError(str(self.engine_loop._dead), self.engine_loop._dead.failed)

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """vLLM's: False, changing nothing, while requests run (``reset_running_requests=True``,
        which would preempt them, is not supported)."""
        if reset_running_requests is not False:
            raise ValueError(f"reset_running_requests={reset_running_requests!r} is not supported: the prefix cache "
                             "is reset only while no request runs")
        return self.engine.reset_prefix_cache()

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def default_sampling_params(self) -> dict[str, Any]:
        """The model's recommended sampling fields, for what a request leaves out."""
        return self.engine.default_sampling_params

    @property
    def model_name(self) -> str:
        return self.engine.args.model or self.engine.model_path.name

    @property
    def is_running(self) -> bool:
        """True until ``shutdown`` (or a failure) ended the engine loop."""
        return self.engine_loop._dead is None

    @property
    def num_in_flight(self) -> int:
        """Requests submitted through ``generate`` and not ended yet."""
        self._collect_dropped()
        return self._in_flight

    def stats(self) -> dict[str, Any]:
        """The engine's counters and KV-cache gauges (``LLMEngine.stats``, safe from any thread:
        while a step runs, the snapshot of an earlier step's end)."""
        return engine_stats(self.engine)

    # ------------------------------------------------------------------------------------------
    # Tokenization, on the pool
    async def _in_pool(self, fn: Any, *args: Any) -> Any:
        # A dead loop (shut down, failed, or a fork child's, whose pool threads are gone too)
        # takes no work: waiting on the pool could be forever.
        await self.check_health()
        try:
            future = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        except RuntimeError:  # the pool was shut down with the engine
            raise EngineDeadError("the engine loop was shut down") from None
        try:
            return await future
        except asyncio.CancelledError:
            task = asyncio.current_task()
            cancelling = task is not None and getattr(task, "cancelling", lambda: 0)()  # Python >= 3.11
            if not cancelling and not self.is_running:  # the work was cancelled by shutdown, not by our caller
                raise EngineDeadError("the engine loop was shut down") from None
            raise

    async def _warm_grammar(self, params: Any) -> Any:
        """Compiles a request's grammar on a compile thread, never on the event loop nor on the
        tokenization pool (a slow grammar delays only other grammars); returns the compiler's
        entry (a failure is one too: the engine's ``add_request`` ends the request with it), or
        None. A build is shared: this caller's cancellation does not cancel it."""
        await self.check_health()
        try:
            return await asyncio.shield(asyncio.wrap_future(self.engine.grammars.entry(params)))
        except Exception:
            return None

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's ``encode`` runs a pooling model; ferrokv serves generative models only."""
        raise PoolingUnsupportedError("AsyncLLM.encode runs pooling models, which ferrokv does not serve "
                                      "(use generate; tokenize_text gives a text's token ids)")

    # vLLM's EngineClient members for what ferrokv has none of (sleep mode, LoRA, multimodal
    # inputs, pausing, profiling, workers): the true answer, or a refusal that says so.
    async def is_sleeping(self) -> bool:
        return False  # no sleep mode: the engine is always awake

    async def is_paused(self) -> bool:
        return False  # generation is never paused

    async def reset_mm_cache(self) -> None:
        """Nothing to reset: ferrokv takes text only."""

    async def reset_encoder_cache(self) -> None:
        """Nothing to reset: ferrokv runs no encoder."""

    async def get_vllm_config(self) -> Any:
        raise vllm_only_method("AsyncLLM", "get_vllm_config")

    async def list_loras(self) -> set[int]:
        return set()  # no adapters

    async def remove_lora(self, lora_id: int) -> bool:
        return False  # no adapter to remove

    async def add_lora(self, lora_request: Any) -> bool:
        check_no_lora(lora_request)
        return False

    async def pin_lora(self, lora_id: int) -> bool:
        return False  # no adapter to pin

    async def sleep(self, level: int = 1) -> None:
        raise vllm_only_method("AsyncLLM", "sleep")

    async def wake_up(self, tags: list[str] | None = None) -> None:
        raise vllm_only_method("AsyncLLM", "wake_up")

    async def pause_generation(self, *args: Any, **kwargs: Any) -> None:
        raise vllm_only_method("AsyncLLM", "pause_generation")

    async def resume_generation(self) -> None:
        raise vllm_only_method("AsyncLLM", "resume_generation")

    async def start_profile(self, *args: Any, **kwargs: Any) -> None:
        raise vllm_only_method("AsyncLLM", "start_profile")

    async def stop_profile(self) -> None:
        raise vllm_only_method("AsyncLLM", "stop_profile")

    async def collective_rpc(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        raise vllm_only_method("AsyncLLM", "collective_rpc")

    async def tokenize_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text``'s token ids (ValueError when it is not Unicode text: a lone surrogate)."""
        check_text("prompt", text)
        tok = self.engine.tokenizer
        return list(await self._in_pool(lambda: tok.encode(text, add_special_tokens=add_special_tokens)))

    async def encode_chat(self, messages: Any, add_generation_prompt: bool = True, **template: Any) -> list[int]:
        """The conversation through the chat template (``llm.chat_token_ids``, whose keywords
        ``chat_template``, ``continue_final_message`` and ``chat_template_kwargs`` pass on;
        ValueError names the bad message, or quotes the template's own refusal, e.g. roles that
        do not alternate)."""
        return await self._in_pool(functools.partial(chat_token_ids, self.engine.tokenizer, messages,
                                                     add_generation_prompt, **template))

    async def decode(self, token_ids: list[int]) -> str:
        return await self._in_pool(self.engine.tokenizer.decode, token_ids)

    async def tokenize_prompt(self, prompt: Any, add_special_tokens: bool = True, keep: int | None = None) -> Any:
        """A text prompt as ``{"prompt", "prompt_token_ids"}`` (``inputs.tokenized_prompt``: at
        most ``keep`` of them, cut as a ``truncate_prompt_tokens`` asks), tokenized on the pool;
        other forms are passed on (the engine checks them)."""
        if not is_text_prompt(prompt):  # nothing to tokenize: not worth a trip to the pool
            return prompt
        return await self._in_pool(tokenized_prompt, self.engine.tokenizer, prompt, add_special_tokens, keep)

    # ------------------------------------------------------------------------------------------
    # Requests
    def _dispatcher(self) -> _LoopDispatcher:
        loop = asyncio.get_running_loop()
        d = self._dispatchers.get(loop)
        if d is None:
            with self._lock:
                d = self._dispatchers.setdefault(loop, _LoopDispatcher(loop, self._lost))
        return d

    def _lost(self, stream: _RequestStream, item: StreamItem) -> None:
        """An item of a stream whose event loop closed with its generator still open (whose
        ``finally`` then never runs): the request is abandoned, and its end gives its count back."""
        if item.finished and item is not _ACCEPTED:
            self._give_back(stream.counted)
        elif not stream.abandoned:
            stream.abandoned = True
            self.engine_loop.abandon(stream.request_id, stream)

    def _give_back(self, counted: _Counted | None) -> None:
        """Gives back what ``generate`` counted for a stream, once."""
        with self._lock:
            if counted is None or counted.released:
                return
            counted.released = True
            self._in_flight -= 1
            left = self._live.pop(counted.request_id) - 1
            if left:
                self._live[counted.request_id] = left

    def _collect_dropped(self) -> None:
        """Gives back the counts of streams collected with their generator's ``finally`` never run
        (dropped after their event loop closed; queued by a finalizer, which must not lock), and
        those whose end a closed event loop was sent (its waiters keep it, and so its dispatcher)."""
        with self._lock:
            dispatchers = list(self._dispatchers.values())
        for d in dispatchers:
            d.drop_if_closed()
        while not self._dropped.empty():
            self._give_back(self._dropped.get_nowait())

    async def generate(self, prompt: Any, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *, lora_request: Any = None, priority: int = 0,
                       cache_salt: str | None = None, prompt_text: str | None = None,
                       tokenization_kwargs: dict[str, Any] | None = None, trace_headers: Any = None,
                       data_parallel_rank: int | None = None,
                       on_accepted: Callable[[], None] | None = None) -> AsyncIterator[RequestOutput]:
        """Submits one request and yields its outputs (module docs); raises its error. Closing
        or cancelling the generator before the last output aborts the request. vLLM's
        ``prompt_text`` and ``trace_headers`` are accepted (no tracing), ``data_parallel_rank``
        as None or 0 (one engine), ``tokenization_kwargs``' ``add_special_tokens`` (a text prompt's
        tokenization) and ``truncate_prompt_tokens``. ferrokv's ``on_accepted`` is called (on the event
        loop) once the engine took the request, its checks passed, before its first output; an exception it
        raises is raised here, and the request aborted."""
        check_no_lora(lora_request)
        if data_parallel_rank not in (None, 0):
            raise ValueError(f"data_parallel_rank={data_parallel_rank!r}: ferrokv runs one engine (give None or 0)")
        add_special_tokens, truncate = tokenization_options(tokenization_kwargs)
        params = sampling_params if sampling_params is not None else self.engine.get_default_sampling_params()
        if isinstance(params, SamplingParams):  # anything else is refused by the engine's add
            params = with_truncation(params, truncate)
        # An id of our own never matches one a caller chose (vLLM makes callers give one).
        rid = f"ferrokv-{uuid.uuid4().hex}" if request_id is None else request_id_str(request_id)
        kind = params.output_kind if isinstance(params, SamplingParams) else None
        prompt = await self.tokenize_prompt(prompt, add_special_tokens, prompt_keep(params, self.max_model_len))
        # Held until the request ends, so that the engine's add finds the grammar (GrammarCompiler).
        grammar = None
        if getattr(params, "structured_outputs", None) is not None:
            grammar = await self._warm_grammar(params.structured_outputs)
        stream = _RequestStream(rid, self._dispatcher(), kind, on_accepted)
        self.engine_loop.submit(rid, prompt, params, sink=stream, priority=priority, cache_salt=cache_salt, warm=False)
        stream.counted = _Counted(rid)
        with self._lock:
            self._in_flight += 1
            self._live[rid] = self._live.get(rid, 0) + 1
        weakref.finalize(stream, _if_unreleased, self._dropped.put, stream.counted)
        ended = False
        try:
            while not ended:
                item = await stream.get()
                ended = item.finished
                if item.error is not None:
                    raise caller_error(item)
                yield item.output
        finally:
            self._give_back(stream.counted)
            if not ended:  # closed or cancelled early: the client is gone, and the id is free again
                self.engine_loop.abandon(rid, stream)
            del grammar  # (held until here)

    def abort(self, request_id: str | Iterable[str], internal: bool = False) -> Coroutine[Any, Any, None]:
        """Ends the requests (unknown or finished ids are ignored); each one's generator then
        yields its final output, ``finish_reason`` "abort". The abort is queued at once, from
        any thread; the result is a coroutine, as vLLM's abort is one (``await llm.abort(rid)``,
        ``create_task``, ``run_coroutine_threadsafe``). ``internal`` (vLLM's): ids are the
        caller's either way (ferrokv never renames them)."""
        self.engine_loop.abort(request_id)
        return _Done()

    def abort_all(self) -> None:
        """Aborts every request in flight (the server's drain deadline)."""
        self._collect_dropped()
        with self._lock:
            ids = list(self._live)
        self.engine_loop.abort(ids)

    def shutdown(self, timeout: float | None = None) -> None:
        """Ends the engine loop (requests still in it end with ``EngineDeadError``) and the
        tokenizer pool; idempotent. ``timeout`` (vLLM's): the most seconds to wait for the loop's
        thread to end its step (None: as long as it takes)."""
        _close(self.engine_loop, self._pool, timeout)


def _close(loop: EngineLoop, pool: concurrent.futures.ThreadPoolExecutor, timeout: float | None = None) -> None:
    loop.shutdown(wait=True, timeout=timeout)
    pool.shutdown(wait=False, cancel_futures=True)
