"""LLMEngine: requests in, ``RequestOutput``s out, one scheduler step at a time.

One ``step()``: the Rust scheduler picks the batch and hands out, per logits row, the sampling parameters it
keeps for each request (``ferrokv.step_sampling``); the model runner's inputs are staged (``prepare``); the
step job (forward pass + sampler, ``ferrokv.step_worker``) runs; beam searches choose their tokens; ``update``
appends the tokens and decides stops. Requests that ask for them also get their prompt positions' logprobs
(``ferrokv.prompt_logprobs``) and a grammar's token mask (``ferrokv.structured_outputs``) in the job; both
advance only once ``update`` ran. The text layer (``ferrokv.text``) then detokenizes them and ends sequences
on stop strings, and ``ferrokv.output_processor`` builds the outputs each request's ``output_kind`` asks for.
The core is the one home of a sequence's tokens and sampling parameters.

Overlap (``EngineArgs.overlap``, on with a GPU): a step's text and outputs are made during the next step's
forward pass, so ``step()`` returns the previous step's outputs (one more ``step()``, with nothing scheduled,
flushes the last; ``has_unfinished_requests`` stays true until then), or hands them to ``deliver`` right then
(``EngineLoop``: to their callers while the GPU works). A sequence that reached a stop string is then already
in the next step: its token there is dropped. Outputs are the same with overlap on and off.

Invariants: every request is validated in full before the scheduler sees it, so bad input raises
``ValueError`` naming the field and leaves the engine as it was (its ``SamplingParams`` are checked again and
copied: an assignment before ``add_request`` is caught, one after it does not reach the request; an error of
the core keeps its type, with the caller's request id in it); a request ended by the caller (abort) or by a
finished beam search is ended in the scheduler at once, so its KV blocks are freed.
Failures: any exception (``KeyboardInterrupt`` included) between ``schedule()`` and ``update()`` waits for the
step job to end, then cancels the step (``Scheduler.cancel_step``): no token is appended, the requests go on
at the next ``step()`` as if the step had never been planned (a beam search that moved in Python during the
step is aborted). One while a step's text and outputs are made (after its ``update()``) aborts that step's
requests, whose Python state is then half-applied; the next ``step()`` reports them (finish_reason "abort"),
after the outputs made before the failure (a ``deliver`` that raised gets its own again). The exception is
re-raised.
Threads: one thread drives the engine (``add_request``/``step``; ``EngineLoop`` is that thread for ``LLM``);
an engine lock serializes every scheduler call, since the scheduler's methods release the GIL while they hold
it borrowed; the step job touches no scheduler state. ``abort_request`` and the getters (``stats()``,
``num_free_blocks``, ``kv_cache_usage``, ``has_unfinished_requests``) are safe from any thread and never wait
for a step: an abort is queued and applied when the step in progress ends (before the lock is released), a
getter reads a snapshot refreshed whenever the lock is released. An interrupt (Ctrl-C) anywhere cannot leave
the lock held (``ferrokv.engine_lock``) or a step in flight (one between ``schedule()`` returning and the step
holding its output is cancelled too); an engine call from inside another on the same thread is a
``RuntimeError``.
Costs per step: the model forward, plus O(1) Python calls for scheduling, inputs, sampling metadata and
``update`` (arrays and the core; with the Rust text layer no Python per row), O(1) Python per streaming row,
logprobs row and penalty row that joined or moved, and O(its output) once per ending sequence; nothing that
grows with output length, or with the number of waiting or finished requests (the ``stats()`` snapshot's
counters are refreshed as each step ends; its O(blocks) usage counts only after someone asked for them).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ferrokv._core import SchedulerStateError, UnknownRequestError
from ferrokv.beam_engine import advance_beams, beam_output, beam_request, beam_seq_slots, check_beam_width
from ferrokv.beam_search import BeamSearchState
from ferrokv.beam_search_params import BeamSearchParams
from ferrokv.checks import rename_field
from ferrokv.detokenizer import decode_token
from ferrokv.engine_args import EngineArgs
from ferrokv.engine_lock import EngineLock, exclusive as _exclusive
from ferrokv.engine_setup import CacheConfigView, ModelConfigView, load_engine
from ferrokv.held_outputs import HeldOutputs
from ferrokv.inputs import (check_logprobs_cap, check_no_lora, check_priority, checked_prompt_ids, prompt_cache_salt,
                            request_id_str, request_ids, request_max_tokens, tokenization_options, with_truncation)
from ferrokv.logit_rules import bad_words_token_ids, check_token_rules, has_logit_bias
from ferrokv import prompt_logprobs
from ferrokv.model_runner import ModelRunner
from ferrokv.output_processor import (RequestState, aborted_output, append_logprobs, build_outputs, end_completion,
                                      new_stats, prompt_of_row, request_times, seq_of_row, stream_rows)
from ferrokv.outputs import CompletionOutput, RequestOutput, RequestOutputKind
from ferrokv.prompt_logprobs import PromptLogprobRequests, PromptLogprobsPlan
from ferrokv.step_profile import StepProfile
from ferrokv.structured_outputs import CompiledGrammar, GrammarStep, StructuredOutputsParams
from ferrokv.step_sampling import StepSampler, core_sampling_kwargs
from ferrokv.step_worker import StepWorker
from ferrokv.sampling_params import SamplingParams
from ferrokv.text import make_text_layer

logger = logging.getLogger("ferrokv")


@dataclass(slots=True)
class _Pending:
    """A step whose ``update()`` ran and whose text and outputs are still to be made."""

    out: Any  # its SchedulerOutput
    sampled: np.ndarray  # int64 [R]: its tokens
    row_lp: Any  # its LogprobsResult, or None


@dataclass(slots=True)
class _StepUndo:
    """What a step changed in Python before ``update()``, undone if the step is cancelled."""

    beams: list[RequestState] = field(default_factory=list)  # beam searches that moved (cannot be put back)


class LLMEngine:
    """Owns the tokenizer, the model runner, the KV cache and the Rust scheduler."""

    @torch.inference_mode(False)  # the engine's tensors are written in place by steps on any thread
    def __init__(self, args: EngineArgs) -> None:
        parts = load_engine(args)  # validates args, loads the model and tokenizer, sizes the KV cache
        self.args = args
        self.model_path: Path = parts.model_path
        self.device, self.dtype = parts.device, parts.dtype
        self.model = parts.model
        self.model_config, self.cache_config = ModelConfigView(self), CacheConfigView(self)  # vLLM's llm_engine.*
        self.tokenizer = parts.tokenizer
        self.decode_token_text = functools.partial(decode_token, self.tokenizer)  # a logprob's decoded_token
        self.vocab_size = parts.vocab_size
        self.eos_token_ids = parts.eos_token_ids
        self.default_sampling_params: dict[str, Any] = parts.sampling_defaults  # ferrokv.generation_defaults
        self.max_model_len = parts.max_model_len
        self.kv_cache = parts.kv_cache
        self.scheduler = parts.scheduler
        self.text = make_text_layer(self.tokenizer, self.scheduler)
        self._times_of = functools.partial(request_times, self.scheduler)  # an output's metrics
        self.runner = ModelRunner(self.model, self.kv_cache, self.device, parts.decode_graphs)
        self.step_sampler = StepSampler(self.vocab_size, self.device, args.seed)
        self.overlap = args.resolved_overlap(self.device)
        # The forward pass runs on the step worker's thread only where torch would run it on
        # this one (the CPU) and overlap is on; on a GPU the host goes on while kernels run.
        self.worker = StepWorker(self.overlap and self.device.type == "cpu", self.device)
        self._pending: _Pending | None = None  # the step whose text and outputs are not made yet
        self._held = HeldOutputs()  # outputs made and not handed out yet (ferrokv.held_outputs)
        self._beam_ids: set[int] = set()
        self._plp_wanted = PromptLogprobRequests()
        self.grammars, self.grammar_rows, self.reasoning = parts.grammars, parts.grammar_rows, parts.reasoning
        self.profile: StepProfile | None = None
        """Set to a ``StepProfile`` to time each step's stages (benches/engine_overhead.py)."""
        self._requests: dict[int, RequestState] = {}
        self._by_name: dict[str, int] = {}
        self._next_core_id = itertools.count()
        self._beams_done: list[RequestState] = []
        self.peak_used_blocks = 0
        # Threads (module docs): the lock guards the scheduler; aborts from any thread queue in
        # its inbox; the snapshot serves getters while another thread holds the lock.
        self._guard = EngineLock(self._before_release, lambda o: self.on_abort and self.on_abort(o), self.device,
                                 returned=self._held.returned)
        self.report_aborts = self._guard.report_queued  # on report_aborts_here's thread: hands out reports
        self.on_abort: Callable[[RequestOutput], None] | None = None
        """Called with the final output of each request ``abort_request`` or a failed step ended (after those it
        still had to report, with overlap), once the lock is released, on its thread or report_aborts_here's."""
        # Called by step() before it changes anything, to refuse it by raising (EngineLoop's guard).
        self.before_step: Callable[[], None] | None = None
        # With overlap, called inside step() with the previous step's outputs as soon as they are made, while
        # this step's forward pass runs (an empty step returns them: an engine whose last outputs are out is
        # idle); step() then returns only the others. Must not call the engine; raising, it gets them all again
        # from the next step() (so it must take all or none).
        self.deliver: Callable[[list[RequestOutput]], None] | None = None
        self._stats: dict[str, int] = self.scheduler.stats()
        self._stats_wanted = False
        self._num_free_blocks: int = self.scheduler.num_free_blocks
        self._num_blocks = parts.num_blocks  # a scheduler getter would borrow it, failing mid-step

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        """vLLM's constructor spelling: ``LLMEngine.from_engine_args(EngineArgs(model=...))``."""
        return cls(engine_args)

    # ------------------------------------------------------------------------------------------
    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def get_model_config(self) -> ModelConfigView:
        return self.model_config

    def get_supported_tasks(self) -> tuple[str, ...]:
        """vLLM's: what the engine serves (text generation only)."""
        return ("generate",)

    def get_default_sampling_params(self) -> SamplingParams:
        """A request's parameters when it gives none: the model's recommendations (vLLM's)."""
        return SamplingParams(**self.default_sampling_params)

    def _checked_prompt(self, request_id: Any, prompt: Any, cache_salt: str | None, params: SamplingParams | None = None,
                        add_special: bool = True) -> tuple[str, str | None, list[int], str | None]:
        """The request id as a string (checked not to be in use), the prompt's text and validated
        token ids (``add_special``: with the tokenizer's own special tokens; truncated as
        ``params.truncate_prompt_tokens`` asks), and its cache salt (``ferrokv.inputs``)."""
        request_id = request_id_str(request_id)
        if request_id in self._by_name:
            raise ValueError(f"request_id={request_id!r} is already in use")
        text, ids = checked_prompt_ids(self.tokenizer, prompt, add_special, params, self.vocab_size, self.max_model_len)
        return request_id, text, ids, prompt_cache_salt(prompt, cache_salt)

    @_exclusive
    def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams | None = None,
        *,
        lora_request: Any = None, priority: int = 0, cache_salt: str | None = None,
        tokenization_kwargs: dict[str, Any] | None = None, arrival_time: float | None = None, trace_headers: Any = None,
    ) -> None:
        """Queues a request; raises ValueError (naming the field) and changes nothing on bad input.
        ``prompt``: a str, TextPrompt or TokensPrompt dict (``ferrokv.inputs``); ``cache_salt``, the
        prefix-cache isolation key, the keyword's or the dict's (both given: they must agree);
        ``tokenization_kwargs``: ``add_special_tokens``, ``truncate_prompt_tokens``; ``arrival_time``,
        ``trace_headers``: accepted (the core stamps arrival; no tracing). ``params`` is copied and checked again."""
        check_no_lora(lora_request)
        add_special, truncate = tokenization_options(tokenization_kwargs)
        params = params if params is not None else self.get_default_sampling_params()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        params = with_truncation(dataclasses.replace(params), truncate)  # a copy, through SamplingParams.validate
        check_token_rules(params, self.vocab_size)
        check_logprobs_cap(params.logprobs, params.prompt_logprobs, self.args.max_logprobs, self.vocab_size)
        grammar = None if params.structured_outputs is None else self.compile_grammar(params.structured_outputs)
        request_id, text, ids, cache_salt = self._checked_prompt(request_id, prompt, cache_salt, params, add_special)
        if params.n > self.args.max_num_seqs:
            raise ValueError(f"n={params.n} is larger than max_num_seqs={self.args.max_num_seqs}")
        room = self.max_model_len - len(ids)  # at least 1: validate_prompt_ids
        fitting = self.scheduler.max_fitting_tokens(len(ids), params.n) if params.max_tokens is None else 0
        max_tokens = request_max_tokens(request_id, params.max_tokens, room, fitting, params.n, params.min_tokens)
        self._submit(request_id, text, ids, params, max_tokens, priority, cache_salt, beam=None, grammar=grammar)

    def compile_grammar(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The request's grammar, compiled once per distinct params (cached, and found while a
        caller holds it: ``EngineLoop`` and ``AsyncLLM`` compile before the add); ValueError names
        the ``structured_outputs`` field. Safe from any thread but a compile thread, unlocked."""
        return self.grammars.compile(params)

    def _submit(self, request_id: str, text: str | None, ids: list[int], params: SamplingParams,
                max_tokens: int, priority: int, cache_salt: str | None, beam: BeamSearchState | None,
                grammar: CompiledGrammar | None = None) -> None:
        check_priority(priority, self.args.scheduling_policy)
        core_id = next(self._next_core_id)
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        stop_ids = list(params.stop_token_ids or [])  # in the vocabulary: check_token_rules
        # The model's other EOS ids are stop ids (vLLM's); under ignore_eos, banned under min_tokens.
        others = [e for e in self.eos_token_ids[1:] if e not in stop_ids and e < self.vocab_size]
        stop_ids, bans = (stop_ids, others) if params.ignore_eos else (stop_ids + others, [])
        try:
            self._add_to_scheduler(core_id, ids, params, max_tokens, priority, cache_salt, beam, eos, stop_ids, bans)
        except ValueError as e:
            # The core names its own integer id; name the caller's instead.
            rename_field(e, "request_id", "request_id", str(core_id), repr(request_id))
            raise
        kind = RequestOutputKind.FINAL_ONLY if beam is not None else params.output_kind
        req = RequestState(request_id, core_id, text, ids, params, kind, new_stats(), beam=beam)
        if beam is not None:
            self._beam_ids.add(core_id)
        else:  # its text, and its bias row, matchers and prompt logprobs (which _finish drops)
            self.text.add_request(core_id, params, ids, kind != RequestOutputKind.FINAL_ONLY)
            if has_logit_bias(params):
                self.step_sampler.bias.register(core_id, params)
            if grammar is not None:
                self.grammar_rows.register(core_id, grammar, ids)
            if params.prompt_logprobs is not None:
                req.prompt_logprobs = [None]
                if len(ids) > 1:
                    self._plp_wanted.add(req)
        self._requests[core_id] = req
        self._by_name[request_id] = core_id

    def _add_to_scheduler(self, core_id: int, ids: list[int], params: SamplingParams, max_tokens: int,
                          priority: int, cache_salt: str | None, beam: BeamSearchState | None,
                          eos: int | None, stop_ids: list[int], bans: list[int]) -> None:
        text = {} if beam is not None else self.text.request_kwargs(
            params, params.output_kind != RequestOutputKind.FINAL_ONLY)
        self.scheduler.add_request(
            core_id, np.asarray(ids, dtype=np.int64), max_tokens, n=params.n, priority=priority, eos_token_id=eos,
            stop_token_ids=stop_ids, min_tokens=min(params.min_tokens, max_tokens),
            ignore_eos=params.ignore_eos or beam is not None, min_tokens_bans=bans, cache_salt=cache_salt,
            reserve_seqs=beam_seq_slots(beam.beam_width) if beam is not None else 0,
            bad_words=bad_words_token_ids(self.tokenizer, params.bad_words, self.vocab_size) if params.bad_words else None,
            **text, **core_sampling_kwargs(params, self.vocab_size),
        )

    def abort_request(self, request_id: str | Sequence[str], wait: bool = False) -> None:
        """Ends the requests (unknown or finished ids are ignored) and frees their blocks; they
        report no more outputs (``on_abort`` aside). Safe from any thread: applied at once when no
        step is in progress, else when the step in progress ends; ``wait``: waits for that, so the
        aborts are applied, and ``on_abort`` called, on this thread before it returns."""
        self._guard.abort_inbox.extend(request_ids(request_id))  # all checked before any is queued
        if wait:
            self._guard.sync(wait=True)
        else:
            self._guard.drain()

    def report_aborts_here(self, wake: Callable[[], None] | None) -> None:
        """Only this thread calls ``on_abort`` now (one no Ctrl-C reaches), in ``report_aborts()``,
        which ``wake`` asks for; None: any thread again (``ferrokv.engine_lock``)."""
        self._guard.report_here(wake)

    @_exclusive
    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix block (vLLM's semantics): True when done; False, changing
        nothing, while any request is unfinished (its blocks may be cached ones). Holds the engine
        lock, so it runs between steps, from any thread. Costs: O(cached blocks)."""
        if self.has_unfinished_requests():
            logger.warning("reset_prefix_cache: requests are running; the prefix cache was not reset")
            return False
        self.scheduler.reset_prefix_cache()
        return True

    def has_unfinished_requests(self) -> bool:
        """Requests not finished, or a step whose outputs are still to be made (overlap)."""
        return bool(self._requests) or self._pending is not None or bool(self._held.kept)

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    def stats(self) -> dict[str, int]:
        """The scheduler's counters: live when no other thread holds the engine, else those of
        the last step's end (the O(blocks) KV usage counts, ``num_shared_blocks``,
        ``num_block_refs`` and ``num_used_token_slots``, then as of the previous call)."""
        self._stats_wanted = True
        self._guard.sync(wait=False)
        return dict(self._stats)

    @property
    def num_free_blocks(self) -> int:
        """Free KV blocks (cached prefix blocks count as free); a snapshot while a step runs."""
        self._guard.sync(wait=False)
        return self._num_free_blocks

    @property
    def kv_cache_usage(self) -> float:
        """The fraction of usable KV blocks in use (0.0 to 1.0); a snapshot while a step runs."""
        return 1.0 - self.num_free_blocks / (self._num_blocks - 1)  # block 0 is the null block

    # ------------------------------------------------------------------------------------------
    # The engine lock (module docs, "Threads")
    def _before_release(self) -> None:
        """Applies queued aborts and refreshes the getters' snapshot (lock held)."""
        self._apply_aborts()
        self._num_free_blocks = self.scheduler.num_free_blocks
        # The counters each time; the O(blocks) usage counts only once someone asked for them.
        fresh = self.scheduler.stats(full=self._stats_wanted)
        self._stats_wanted = False
        self._stats = {**self._stats, **fresh}  # a new dict: a getter copies the old one meanwhile

    def _apply_aborts(self) -> None:
        inbox = self._guard.abort_inbox
        if inbox and self._pending is not None:
            # The pending step's text is made first, as a serial engine made it before the abort
            # (the final output has it); its outputs of aborted requests are sorted out below.
            p, self._pending = self._pending, None
            self._held.kept += self._finish_pending(p)
        queued = list(inbox)  # those applied now; one queued meanwhile waits for the next call (the release)
        aborted = set(queued)  # finished ones too: a reused id must never get their kept outputs
        if aborted:
            taken = self._held.take(aborted, from_returning=self.on_abort is not None)
            if self.on_abort is not None:  # without a reporter, nothing more (vLLM's)
                self._guard.aborted += taken
        for _ in queued:
            core_id = self._by_name.get(inbox.popleft())
            if core_id is not None:
                self._abort_now(self._requests[core_id])

    def _abort_now(self, req: RequestState, asked: bool = True) -> None:
        """Ends a request in Python and in the scheduler (lock held). Its final output goes to
        ``on_abort``; without one, only to the next ``step()``'s, and only if not ``asked`` (a failed step's)."""
        try:
            ended = self.text.after_abort(self.scheduler.abort(req.core_id))
        except UnknownRequestError:
            ended = []  # ended by the scheduler already (a capacity abort, a cancelled reshaped step)
        self._finish(req)
        self._report_abort(req, ended, asked)

    def _report_abort(self, req: RequestState, ended: list[Any], asked: bool = False) -> None:
        """An ended request's final output: to ``on_abort`` after the outputs it still had to report
        (as a serial engine returned them before the abort came); else to the next ``step()``."""
        if self.on_abort is not None:
            taken = self._held.take({req.request_id}, from_returning=True)
            self._guard.aborted += [*taken, aborted_output(req, ended, self._times_of)]
        elif not asked:
            self._held.kept.append(aborted_output(req, ended, self._times_of))

    # ------------------------------------------------------------------------------------------
    @_exclusive
    def step(self) -> list[RequestOutput]:
        """One scheduler step; returns outputs of the requests that progressed or finished, as
        their ``output_kind`` asks (none for an unfinished ``FINAL_ONLY`` request). With overlap
        on, they are the previous step's: its text and outputs are made while this step's
        forward pass runs (module docs).

        On any exception the step is cancelled or its requests aborted (module docs), and the
        exception is re-raised."""
        prof, t0 = self.profile, time.perf_counter()
        prev, out, job, undo = self._pending, None, None, _StepUndo()
        outputs: list[RequestOutput] = []
        finishing_prev = False
        if self.before_step is not None:
            self.before_step()
        # Nothing changes before the try: an interrupt anywhere leaves the engine recoverable.
        try:
            out = self.scheduler.schedule()
            self.peak_used_blocks = max(self.peak_used_blocks, self._num_blocks - 1 - self.scheduler.num_free_blocks)
            t1 = time.perf_counter()
            md = self.step_sampler.metadata(out, prompt_of_row(self._requests, out), self.scheduler.output_tokens)
            plp = prompt_logprobs.plan(out, self._requests, self._plp_wanted) if self._plp_wanted else None
            grammar = self.grammar_rows.step(out)
            inputs = self.runner.prepare(out, None if plp is None else plp.token_indices)
            t2 = time.perf_counter()
            job = self.worker.submit(functools.partial(self._forward_and_sample, inputs, md, out.num_rows, plp, grammar))
            if prev is not None:
                finishing_prev = True
                outputs = self._finish_step(prev)  # overlapped with the forward pass, and so is their delivery
                self._pending, finishing_prev = None, False
                if self.deliver is not None and (out.num_rows or out.num_tokens):  # else: no forward pass to hide it
                    self.deliver(outputs)  # (raising, it gets them again from the next step())
                    outputs = []
            t3 = time.perf_counter()
            logits, tokens, plp_result = job.wait()
            t4 = time.perf_counter()
            sampled, row_lp = self._tokens(out, logits, tokens, undo)
            self.scheduler.update(out, sampled, defer_text=True)
            # Committed with the step's tokens (a cancelled step adds nothing), before the next step plans.
            if grammar is not None:
                grammar.accept(sampled)
            if plp is not None and plp_result is not None:
                plp.apply(plp_result, self.decode_token_text)
                self._plp_wanted.drop_complete(plp)
        except BaseException:
            self._fail_step(out, job, undo, prev if finishing_prev else None, outputs)
            raise
        t5 = time.perf_counter()
        self._held.kept += outputs  # from here on, a failure keeps them for the next step()
        pending = _Pending(out, sampled, row_lp)
        if self.overlap and (out.num_rows or out.num_tokens):
            self._pending = pending
        else:  # serial, or an empty step (nothing to overlap with; an idle engine has nothing pending)
            self._held.kept += self._finish_pending(pending)
        if prof is not None:
            prof.add(out.num_rows, t0, t1, t2, t3, t4, t5, time.perf_counter())
        # Aborts queued meanwhile are applied here, not at release, so that a failure keeps every output
        # for the next step(), in order; the pending step's outputs are made first (_apply_aborts). With
        # a reporter, an aborted request's outputs go to it before its final one, not out of this step.
        outputs = self._held.hand_out()
        if self._guard.abort_inbox:
            try:
                self._apply_aborts()
            except BaseException:
                self._held.keep_back(outputs)
                raise
        return outputs

    def _fail_step(self, out: Any, job: Any, undo: _StepUndo, half_made: _Pending | None,
                   made: list[RequestOutput]) -> None:
        """Undoes a step that raised: keeps the outputs made for the next ``step()`` (before the
        aborts' below), waits for its job, cancels it (also one whose output the interrupt kept from
        us: ``schedule()`` had returned), aborts the requests of a previous step whose text and
        outputs were half made; a previous step not yet begun stays pending."""
        self._held.kept += made
        if job is not None:
            job.join()
        if out is None:
            self.scheduler.cancel_step_in_flight()
        else:
            self._cancel_step(out, undo)
        if half_made is not None:
            self._pending = None
            self._abort_step_requests(half_made.out)

    def _forward_and_sample(self, inputs: Any, md: Any, num_rows: int, plp: PromptLogprobsPlan | None,
                            grammar: GrammarStep | None) -> tuple[torch.Tensor | None, Any, Any]:
        """The step job: the forward pass, prompt logprobs, grammar masks and sampling (tensors
        and the step's matchers only; the step worker may run it on its own thread)."""
        t0 = time.perf_counter()
        logits = self.runner.forward(inputs)
        t1 = time.perf_counter()
        plp_result = None
        if plp is not None and logits is not None:
            plp_result = prompt_logprobs.compute(logits[num_rows:], plp)
            logits = logits[:num_rows]
        if grammar is not None and logits is not None:
            grammar.mask(logits)
        tokens = None if logits is None or md is None else self.step_sampler.sample(logits, md)
        if self.profile is not None:
            self.profile.add_job(t1 - t0, time.perf_counter() - t1)
        return logits, tokens, plp_result

    def _cancel_step(self, out: Any, undo: _StepUndo) -> None:
        """Undoes a step whose forward pass, sampling or ``update()`` raised."""
        try:
            self.scheduler.cancel_step(out)
        except SchedulerStateError:
            # update() had returned (an interrupt landing right after it): its results are lost,
            # so the step's requests cannot go on in step with the scheduler.
            self._abort_step_requests(out)
            return
        for req in undo.beams:
            if not req.finished:
                self._abort_now(req, asked=False)
        # No reset_prefix_cache(): cancel_step unregisters the prefix blocks the step registered
        # (their KV was never written); the text layer saw nothing of the step.

    def _abort_step_requests(self, out: Any) -> None:
        """Aborts the requests of a step whose results were lost; its untaken deferred results,
        if any, are dropped first (the text layer forgets their sequences)."""
        self.text.after_abort(self.scheduler.take_step_results()[0])
        for cid in set(out.req_ids.tolist()) | set(out.row_req_ids.tolist()):
            req = self._requests.get(cid)
            if req is not None:
                self._abort_now(req, asked=False)

    def _tokens(self, out: Any, logits: torch.Tensor | None, tokens: Any, undo: _StepUndo) -> tuple[np.ndarray, Any]:
        """The step's tokens, one per logits row, on the host, and the rows' logprobs; beam
        searches replace theirs (forking and dropping sequences)."""
        if tokens is None:
            return np.zeros(out.num_rows, dtype=np.int64), None
        so = tokens.result()
        sampled = so.token_ids
        if self._beam_ids:  # a search that is done has ended in the scheduler, and reports as the step ends
            advance_beams(self.scheduler, self._requests, self._beam_ids, out, logits, sampled, undo.beams,
                          self._beam_done)
        return sampled, so.logprobs

    def _beam_done(self, req: RequestState) -> None:
        self._finish(req)
        self._beams_done.append(req)

    def _finish_pending(self, p: _Pending) -> list[RequestOutput]:
        """``_finish_step`` outside the overlap window: on failure the step's requests are aborted."""
        try:
            return self._finish_step(p)
        except BaseException:
            self._abort_step_requests(p.out)
            raise

    def _finish_step(self, p: _Pending) -> list[RequestOutput]:
        """The text and outputs of a step whose ``update()`` ran."""
        t0 = time.perf_counter()
        finished, rows, deltas = self.text.step_results(self.scheduler, p.out, p.sampled)
        if self.profile is not None:
            self.profile.detokenize += time.perf_counter() - t0
        return self._apply_step(p, finished, rows, deltas)

    def _apply_step(self, p: _Pending, finished: list[Any], rows: np.ndarray, deltas: list[str]) -> list[RequestOutput]:
        """Hands the step's logprobs and streaming rows to the requests' output states, ends what
        the scheduler ended, and builds the outputs."""
        (out, sampled, row_lp), t0 = (p.out, p.sampled, p.row_lp), time.perf_counter()
        touched: dict[int, RequestState] = {}
        if row_lp is not None:
            append_logprobs(seq_of_row(self._requests, out), row_lp, sampled, self.decode_token_text)
        if len(rows):
            stream_rows(self._requests, out.row_req_ids[rows].tolist(), out.row_seq_ids[rows].tolist(),
                        out.row_sample_index[rows].tolist(), sampled[rows].tolist(), deltas, touched)
        ended_now: dict[int, list[CompletionOutput]] = {}
        done = []  # released once their outputs are made: a failure before aborts them, and reports them
        for f in finished:
            req = self._requests.get(f.request_id)
            if req is None or req.beam is not None:
                continue
            end_completion(req, f, ended_now)
            touched[f.request_id] = req
            if f.request_finished:
                req.finished = True  # (its output says so)
                done.append(req)
        outputs = build_outputs(touched.values(), ended_now, self._times_of)
        beams, self._beams_done = self._beams_done, []
        try:
            outputs += [beam_output(req, self.text.decode) for req in beams]
        except BaseException:  # ended already: reported as aborted instead
            for req in beams:
                self._report_abort(req, [])
            raise
        for req in done:  # last: a failure before leaves them to be aborted, and so reported
            self._finish(req)
        if self.profile is not None:
            self.profile.outputs += time.perf_counter() - t0
        return outputs

    def _finish(self, req: RequestState) -> None:
        req.finished = True
        self._beam_ids.discard(req.core_id)
        self._plp_wanted.discard(req.core_id)
        self.grammar_rows.release(req.core_id)
        self.step_sampler.bias.release(req.core_id)
        self._requests.pop(req.core_id, None)
        self._by_name.pop(req.request_id, None)

    # ------------------------------------------------------------------------------------------
    # Beam search
    @_exclusive
    def add_beam_request(self, request_id: str, prompt: Any, beam_width: int, max_tokens: int,
                         length_penalty: float = 1.0, ignore_eos: bool = False) -> None:
        p = BeamSearchParams(beam_width=beam_width, max_tokens=max_tokens, length_penalty=length_penalty,
                             ignore_eos=ignore_eos)  # checks every field
        check_beam_width(p.beam_width, self.args.max_num_seqs)
        request_id, text, ids, cache_salt = self._checked_prompt(request_id, prompt, None)
        state, params = beam_request(p, len(ids), self.max_model_len, self.eos_token_ids)
        self._submit(request_id, text, ids, params, params.max_tokens, 0, cache_salt, beam=state)
