"""LLMEngine: requests in, ``RequestOutput``s out, one scheduler step at a time.

One ``step()``: the Rust scheduler picks the batch, the model runner computes logits for the
rows that sample, the sampler (or the beam-search logic) picks tokens, the scheduler appends
them and decides stops, and this module detokenizes and builds the outputs.

Invariants: every request is validated in full before the scheduler sees it, so bad input
raises ``ValueError`` naming the field and leaves the engine as it was (its ``SamplingParams``
are checked again and copied: an assignment before ``add_request`` is caught, one after it does
not reach the request; an error of the core keeps its type, with the caller's request id in it);
a request ended in Python (stop string, abort, finished beam search) is ended in the scheduler at
once, so its KV blocks are freed. The sampler's shared generator is on the engine's device.
Failures: any exception (``KeyboardInterrupt`` included) between ``schedule()`` and ``update()``
cancels the step (``Scheduler.cancel_step``): no token is appended, the requests go on at the
next ``step()`` as if the step had never been planned (a beam search that moved in Python during
the step is aborted); one after ``update()`` aborts the step's requests, whose Python state is
then half-applied. The exception is re-raised.
Threads: one thread drives the engine (``add_request``/``step``; ``EngineLoop`` is that thread
for ``LLM``); an engine lock serializes every scheduler call, since the scheduler's methods
release the GIL while they hold it borrowed. ``abort_request`` and the getters (``stats()``,
``num_free_blocks``, ``kv_cache_usage``, ``has_unfinished_requests``) are safe from any thread
and never wait for a step: an abort is queued and applied when the step in progress ends (before
the lock is released), a getter reads a snapshot refreshed whenever the lock is released.
Costs per step: the model forward, plus O(rows) Python work for sampling metadata and
detokenization; nothing that scales with the number of waiting or finished requests (the full
``stats()`` snapshot, O(blocks), is refreshed only after someone asked for it).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from ferrokv._core import Scheduler, SchedulerStateError, UnknownRequestError
from ferrokv.beam_search import BeamSearchState
from ferrokv.checks import check_finite, check_int, check_text, rename_field
from ferrokv.detokenizer import IncrementalDetokenizer, decode_token
from ferrokv.engine_args import DTYPE_ALIASES, EngineArgs
from ferrokv.kv_cache import KVCacheSpec, PagedKVCache
from ferrokv.model_runner import ModelRunner
from ferrokv.outputs import CompletionOutput, RequestOutput, make_logprobs_entry
from ferrokv.sampler import Sampler, SamplingMetadata, SamplingRow, compute_logprobs, make_generator
from ferrokv.sampling_params import SamplingParams

logger = logging.getLogger("ferrokv")

_DTYPES = {name: getattr(torch, canonical) for name, canonical in DTYPE_ALIASES.items()}
_CPU_DEFAULT_KV_BYTES = 1 << 30
# The core takes a request's priority as a 32-bit signed int.
_PRIORITY_MIN, _PRIORITY_MAX = -(1 << 31), (1 << 31) - 1


@dataclass(slots=True)
class _Seq:
    seq_id: int
    index: int
    token_ids: list[int]
    detok: IncrementalDetokenizer
    generator: torch.Generator | None
    logprobs: list[dict] | None
    cumulative_logprob: float | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class _Request:
    request_id: str
    core_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: dict[int, _Seq] = field(default_factory=dict)
    done_seqs: list[_Seq] = field(default_factory=list)
    num_cached_tokens: int = 0
    beam: BeamSearchState | None = None
    finished: bool = False


@dataclass(slots=True)
class _StepUndo:
    """What a step changed in Python before ``update()``, undone if the step is cancelled."""

    new_seqs: list[tuple[_Request, int]] = field(default_factory=list)  # samples forked at this update
    beams: list[_Request] = field(default_factory=list)  # beam searches that moved (cannot be put back)


_F = TypeVar("_F", bound=Callable[..., Any])


def _exclusive(method: _F) -> _F:
    """Runs an ``LLMEngine`` method holding the engine lock (released by ``_release``)."""

    @functools.wraps(method)
    def locked(self: LLMEngine, *args: Any, **kwargs: Any) -> Any:
        self._lock.acquire()
        try:
            return method(self, *args, **kwargs)
        finally:
            self._release()

    return locked  # type: ignore[return-value]


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but no CUDA device is available")
    return dev


def _resolve_dtype(name: str, config: Mapping[str, Any], device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # half precision matmuls are slow (and bf16 is inexact) on CPUs
    cfg = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16").replace("torch.", "")
    return _DTYPES.get(cfg, torch.bfloat16) if cfg in ("float16", "bfloat16") else torch.bfloat16


class LLMEngine:
    """Owns the tokenizer, the model runner, the KV cache and the Rust scheduler."""

    def __init__(self, args: EngineArgs) -> None:
        from transformers import AutoTokenizer

        from ferrokv.model_loader import load_config, load_model, resolve_model_path, resolve_tokenizer_path

        args.validate()
        self.args = args
        t0 = time.perf_counter()
        hub = dict(revision=args.revision, download_dir=args.download_dir)
        self.model_path: Path = resolve_model_path(args.model, **hub)
        # Resolved before the weights load, so a bad tokenizer fails fast.
        tokenizer_path = resolve_tokenizer_path(args.tokenizer, **hub) if args.tokenizer else self.model_path
        config = load_config(self.model_path)
        self.device = _resolve_device(args.device)
        self.dtype = _resolve_dtype(args.dtype, config, self.device)
        backend = args.attention_backend
        if backend == "auto":
            backend = "triton" if self.device.type == "cuda" else "torch"
        self.model = load_model(self.model_path, dtype=self.dtype, device=self.device, attn_backend=backend)
        self.model_config = self.model.config
        self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
        self.vocab_size = int(self.model_config.vocab_size)
        self.eos_token_ids = self._eos_ids(config)

        max_len = args.max_model_len or int(self.model_config.max_position_embeddings)
        self.max_model_len = max_len
        spec = KVCacheSpec(
            num_layers=self.model_config.num_hidden_layers,
            num_kv_heads=self.model_config.num_key_value_heads,
            head_dim=self.model_config.head_dim,
            block_size=args.block_size,
            dtype=self.dtype,
        )
        num_blocks = self._num_blocks(spec)
        self.kv_cache = PagedKVCache(spec, num_blocks, args.num_cpu_blocks, self.device)
        budget = args.max_num_batched_tokens or (8192 if self.device.type == "cuda" else 2048)
        budget = max(budget, args.max_num_seqs)
        self.scheduler = Scheduler(
            num_blocks,
            block_size=args.block_size,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_len,
            enable_prefix_caching=args.enable_prefix_caching,
            preemption_mode=args.preemption_mode,
            num_cpu_blocks=args.num_cpu_blocks,
            policy=args.scheduling_policy,
        )
        self.runner = ModelRunner(self.model, self.kv_cache, self.device)
        # On the model's device: unseeded rows draw their uniforms where the logits are.
        self.sampler = Sampler(seed=args.seed, device=self.device)
        self._requests: dict[int, _Request] = {}
        self._by_name: dict[str, int] = {}
        self._next_core_id = itertools.count()
        self._beams_done: list[_Request] = []
        self.peak_used_blocks = 0
        # Threads (module docs): the lock guards the scheduler; aborts from any thread queue in
        # the inbox; the snapshot serves getters while another thread holds the lock.
        self._lock = threading.Lock()
        self._abort_inbox: deque[str] = deque()
        self._aborted_outputs: list[RequestOutput] = []
        self.on_abort: Callable[[RequestOutput], None] | None = None
        """Called with the final output (``finish_reason`` "abort") of each request that
        ``abort_request`` or a failed step ended, from the thread that applied it, after the
        engine lock is released (``EngineLoop`` routes them). None: aborted requests report nothing."""
        self._stats: dict[str, int] = self.scheduler.stats()
        self._stats_wanted = False
        self._num_free_blocks: int = self.scheduler.num_free_blocks
        self._num_blocks = num_blocks  # a scheduler getter would borrow it, failing mid-step
        tokens_capacity = (num_blocks - 1) * args.block_size
        logger.info(
            "model %s (%s, %s, %s) loaded in %.1fs; KV cache: %d blocks x %d tokens, "
            "%.1f KiB per block (M_KV = 2 * %d layers * %d kv heads * %d head_dim * %d tokens * %d bytes), "
            "%d tokens in all, max concurrency %.1f at max_model_len=%d",
            args.model or self.model_path.name, self.model_config.architecture, str(self.dtype).replace("torch.", ""),
            self.device, time.perf_counter() - t0, num_blocks, args.block_size, spec.bytes_per_block / 1024,
            spec.num_layers, spec.num_kv_heads, spec.head_dim, args.block_size,
            torch.empty((), dtype=self.dtype).element_size(), tokens_capacity, tokens_capacity / max_len, max_len,
        )

    # ------------------------------------------------------------------------------------------
    def _eos_ids(self, config: Mapping[str, Any]) -> tuple[int, ...]:
        ids: list[int] = []
        for v in (self.tokenizer.eos_token_id, config.get("eos_token_id")):
            for x in v if isinstance(v, list) else [v]:
                if isinstance(x, int) and x not in ids and 0 <= x < self.vocab_size:
                    ids.append(x)
        gen = self.model_path / "generation_config.json"
        if gen.is_file():
            from ferrokv.model_loader import read_json

            v = read_json(gen).get("eos_token_id")
            for x in v if isinstance(v, list) else [v]:
                if isinstance(x, int) and x not in ids and 0 <= x < self.vocab_size:
                    ids.append(x)
        return tuple(ids)

    def _num_blocks(self, spec: KVCacheSpec) -> int:
        a = self.args
        per_block = spec.bytes_per_block
        if a.num_kv_blocks is not None:
            return a.num_kv_blocks
        if a.kv_cache_memory is not None:
            budget = a.kv_cache_memory
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = int(total * a.gpu_memory_utilization) - used
        else:
            budget = _CPU_DEFAULT_KV_BYTES
        n = budget // per_block
        if self.device.type == "cpu" and a.kv_cache_memory is None:
            # No point in reserving more than every sequence at full length could use.
            n = min(n, a.max_num_seqs * math.ceil(self.max_model_len / a.block_size) + 1)
        if n < 2:
            raise ValueError(
                f"kv_cache_memory: {budget} bytes hold {n} KV blocks of {per_block} bytes; at least 2 are needed"
            )
        return int(n)

    # ------------------------------------------------------------------------------------------
    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def _prompt_ids(self, prompt: Any) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer.encode(check_text("prompt", prompt)))
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if isinstance(ids, (str, bytes)) or not isinstance(ids, (Sequence, np.ndarray)):
                    raise ValueError(f"prompt_token_ids must be a list of ints, got {type(ids).__name__}")
                out = []
                for i, t in enumerate(ids):
                    if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                        raise ValueError(f"prompt_token_ids[{i}] must be an int, got {t!r}")
                    out.append(int(t))
                return prompt.get("prompt"), out
            if "prompt" in prompt and isinstance(prompt["prompt"], str):
                return prompt["prompt"], list(self.tokenizer.encode(check_text("prompt", prompt["prompt"])))
        raise ValueError(
            f"prompt must be a str or a dict with 'prompt_token_ids' (or 'prompt'), got {type(prompt).__name__}"
        )

    def _validate_ids(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("prompt_token_ids: the prompt is empty (at least one token is needed)")
        for i, t in enumerate(ids):
            if not 0 <= t < self.vocab_size:
                raise ValueError(
                    f"prompt_token_ids[{i}]={t} is outside the vocabulary [0, {self.vocab_size})"
                )
        if len(ids) > self.max_model_len:
            raise ValueError(
                f"prompt_token_ids: the prompt has {len(ids)} tokens, more than max_model_len={self.max_model_len}"
            )

    def _checked_prompt(self, request_id: Any, prompt: Any) -> tuple[str, str | None, list[int]]:
        """The request id as a string (checked not to be in use) and the prompt's text and
        validated token ids."""
        request_id = str(request_id)
        if request_id in self._by_name:
            raise ValueError(f"request_id={request_id!r} is already in use")
        text, ids = self._prompt_ids(prompt)
        self._validate_ids(ids)
        return request_id, text, ids

    @_exclusive
    def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        """Queues a request; raises ValueError (naming the field) and changes nothing on bad input.

        The request keeps its own copy of ``params``, checked again here: fields may have been
        assigned since construction, and a later assignment must not reach a running request."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        params = dataclasses.replace(params)  # a copy, through SamplingParams.validate
        request_id, text, ids = self._checked_prompt(request_id, prompt)
        if params.n > self.args.max_num_seqs:
            raise ValueError(f"n={params.n} is larger than max_num_seqs={self.args.max_num_seqs}")
        # The core stops at max_model_len anyway; capping here keeps huge values in its int range.
        room = max(self.max_model_len - len(ids), 1)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        self._submit(request_id, text, ids, params, max_tokens, priority, cache_salt, beam=None)

    def _submit(self, request_id: str, text: str | None, ids: list[int], params: SamplingParams,
                max_tokens: int, priority: int, cache_salt: str | None, beam: BeamSearchState | None) -> None:
        check_int("priority", priority, _PRIORITY_MIN, _PRIORITY_MAX)
        if cache_salt is not None:
            check_text("cache_salt", cache_salt)
        core_id = next(self._next_core_id)
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        stop_ids = list(params.stop_token_ids or [])
        if not params.ignore_eos:
            stop_ids += [e for e in self.eos_token_ids[1:] if e not in stop_ids]
        try:
            self._add_to_scheduler(core_id, ids, params, max_tokens, priority, cache_salt, beam, eos, stop_ids)
        except ValueError as e:
            # The core names its own integer id; name the caller's instead.
            rename_field(e, "request_id", "request_id", str(core_id), repr(request_id))
            raise
        req = _Request(request_id, core_id, text, ids, params, beam=beam)
        seq_id = self.scheduler.request_seq_ids(core_id)[0]
        req.seqs[seq_id] = self._new_seq(req, seq_id, 0)
        self._requests[core_id] = req
        self._by_name[request_id] = core_id

    def _add_to_scheduler(self, core_id: int, ids: list[int], params: SamplingParams, max_tokens: int,
                          priority: int, cache_salt: str | None, beam: BeamSearchState | None,
                          eos: int | None, stop_ids: list[int]) -> None:
        self.scheduler.add_request(
            core_id, np.asarray(ids, dtype=np.int64), max_tokens,
            n=params.n, priority=priority, eos_token_id=eos, stop_token_ids=stop_ids,
            min_tokens=min(params.min_tokens, max_tokens), ignore_eos=params.ignore_eos or beam is not None,
            cache_salt=cache_salt,
            reserve_seqs=beam.beam_width if beam is not None else 0,
        )

    def _new_seq(self, req: _Request, seq_id: int, index: int, tokens: list[int] | None = None) -> _Seq:
        p = req.params
        gen = make_generator(p.seed, index) if p.seed is not None and not p.is_greedy else None
        want_lp = p.logprobs is not None
        detok = IncrementalDetokenizer.from_params(self.tokenizer, p, req.prompt_token_ids)
        seq = _Seq(seq_id, index, [], detok, gen, [] if want_lp else None, 0.0 if want_lp else None)
        for t in tokens or []:
            seq.token_ids.append(t)
            seq.detok.append(t)
        return seq

    def abort_request(self, request_id: str | Sequence[str]) -> None:
        """Ends the requests (unknown or finished ids are ignored) and frees their blocks; they
        report no more outputs (``on_abort`` aside). Safe from any thread: applied at once when no
        step is in progress, else when the step in progress ends."""
        # One id (any type add_request took, e.g. an int) or an iterable of them.
        ids = [request_id] if isinstance(request_id, (str, int)) else list(request_id)
        self._abort_inbox.extend(str(rid) for rid in ids)
        self._drain_aborts()

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    def stats(self) -> dict[str, int]:
        """The scheduler's counters: live when no other thread holds the engine, else the
        snapshot taken when the lock was last released (refreshed at the end of the current step)."""
        self._stats_wanted = True
        if self._lock.acquire(blocking=False):
            self._release()
        return dict(self._stats)

    @property
    def num_free_blocks(self) -> int:
        """Free KV blocks (cached prefix blocks count as free); a snapshot while a step runs."""
        if self._lock.acquire(blocking=False):
            self._release()
        return self._num_free_blocks

    @property
    def kv_cache_usage(self) -> float:
        """The fraction of usable KV blocks in use (0.0 to 1.0); a snapshot while a step runs."""
        return 1.0 - self.num_free_blocks / (self._num_blocks - 1)  # block 0 is the null block

    # ------------------------------------------------------------------------------------------
    # The engine lock (module docs, "Threads")
    def _release(self) -> None:
        """Releases the engine lock, first applying queued aborts and refreshing the getters'
        snapshot; then reports aborted requests and drains aborts queued meanwhile."""
        try:
            self._apply_aborts()
            self._num_free_blocks = self.scheduler.num_free_blocks
            if self._stats_wanted:
                self._stats_wanted = False
                self._stats = self.scheduler.stats()
        finally:
            aborted, self._aborted_outputs = self._aborted_outputs, []
            self._lock.release()
        if self.on_abort is not None:
            for o in aborted:
                self.on_abort(o)
        self._drain_aborts()

    def _drain_aborts(self) -> None:
        # Whoever queued an abort tries the lock; if another thread holds it, that thread sees the
        # abort in _release (queued before this failed try, so before that release).
        if self._abort_inbox and self._lock.acquire(blocking=False):
            self._release()

    def _apply_aborts(self) -> None:
        while self._abort_inbox:
            core_id = self._by_name.get(self._abort_inbox.popleft())
            if core_id is not None:
                self._abort_now(self._requests[core_id])

    def _abort_now(self, req: _Request) -> None:
        """Ends a request in Python and in the scheduler (lock held)."""
        self._finish(req)
        if self.on_abort is not None:
            self._aborted_outputs.append(self._aborted_output(req))
        try:
            self.scheduler.abort(req.core_id)
        except UnknownRequestError:
            pass  # ended by the scheduler already (a capacity abort, a cancelled reshaped step)

    def _aborted_output(self, req: _Request) -> RequestOutput:
        if req.beam is not None:  # an unfinished beam search has no hypotheses to report
            return RequestOutput(request_id=req.request_id, prompt=req.prompt,
                                 prompt_token_ids=list(req.prompt_token_ids), outputs=[], finished=True,
                                 num_cached_tokens=req.num_cached_tokens)
        for s in req.seqs.values():
            s.finish_reason = "abort"
            s.detok.flush()
        return self._output(req)

    # ------------------------------------------------------------------------------------------
    @_exclusive
    def step(self) -> list[RequestOutput]:
        """One scheduler step; returns outputs of the requests that progressed or finished.

        On any exception the step is cancelled or its requests aborted (module docs), and the
        exception is re-raised."""
        out = self.scheduler.schedule()
        self.peak_used_blocks = max(self.peak_used_blocks, self.scheduler.num_blocks - 1 - self.scheduler.num_free_blocks)
        undo = _StepUndo()
        try:
            logits = self.runner.execute(out)
            sampled, row_lp = self._sample(out, logits, undo)
            finished = self.scheduler.update(out, sampled)
        except BaseException:
            self._cancel_step(out, undo)
            raise
        try:
            return self._apply_step(out, sampled, row_lp, finished)
        except BaseException:
            self._abort_step_requests(out)
            raise

    def _cancel_step(self, out: Any, undo: _StepUndo) -> None:
        """Undoes a step whose forward pass, sampling or ``update()`` raised."""
        try:
            self.scheduler.cancel_step(out)
        except SchedulerStateError:
            # update() had returned (an interrupt landing right after it): its results are lost,
            # so the step's requests cannot go on in step with the scheduler.
            self._abort_step_requests(out)
            return
        for req, seq_id in undo.new_seqs:
            req.seqs.pop(seq_id, None)
        for req in undo.beams:
            if not req.finished:
                self._abort_now(req)
        # No reset_prefix_cache(): the only KV a cancelled step may have written is in its new
        # tokens' slots, i.e. in blocks the step allocated (released by cancel_step) or past the
        # computed part of a sequence's own last block (rewritten when it is recomputed), plus
        # the destinations of its copy/swap-in ops, whose requests cancel_step recomputes. Prefix
        # blocks are registered only by update(), so no cached block holds a cancelled step's KV.

    def _abort_step_requests(self, out: Any) -> None:
        for cid in set(out.req_ids.tolist()):
            req = self._requests.get(cid)
            if req is not None:
                self._abort_now(req)

    def _sample(self, out: Any, logits: torch.Tensor | None, undo: _StepUndo) -> tuple[np.ndarray, Any]:
        """The step's tokens, one per logits row (0 for rows of ended requests), and the rows'
        logprobs; beam searches choose theirs (forking and dropping sequences)."""
        sampled = np.zeros(out.num_rows, dtype=np.int32)
        row_lp = None
        if not out.num_rows:
            return sampled, row_lp
        row_req = out.row_req_ids.tolist()
        row_seq = out.row_seq_ids.tolist()
        row_idx = out.row_sample_index.tolist()
        sample_rows: list[int] = []
        beam_rows: dict[int, list[int]] = {}
        for r, (cid, sid, idx) in enumerate(zip(row_req, row_seq, row_idx)):
            req = self._requests.get(cid)
            if req is None:
                continue
            if req.beam is not None:
                beam_rows.setdefault(cid, []).append(r)
                continue
            if sid not in req.seqs:  # a sample of an n > 1 request, forked at update
                req.seqs[sid] = self._new_seq(req, sid, idx)
                undo.new_seqs.append((req, sid))
            sample_rows.append(r)
        if sample_rows:
            rows = [self._sampling_row(self._requests[row_req[r]], row_seq[r]) for r in sample_rows]
            md = SamplingMetadata.build(rows, self.vocab_size, self.eos_token_ids, device=logits.device)
            sel = logits if len(sample_rows) == out.num_rows else logits[torch.tensor(sample_rows, device=logits.device)]
            so = self.sampler(sel, md)
            sampled[np.asarray(sample_rows)] = so.token_ids
            row_lp = (sample_rows, so.logprobs)
        for cid, rs in beam_rows.items():
            undo.beams.append(self._requests[cid])
            self._beam_step(self._requests[cid], rs, row_seq, logits, sampled)
        return sampled, row_lp

    def _apply_step(self, out: Any, sampled: np.ndarray, row_lp: Any, finished: list[Any]) -> list[RequestOutput]:
        """Appends the step's tokens in Python (text, logprobs, stop strings), ends what the
        scheduler ended, and builds the outputs of the requests that progressed or finished."""
        touched: dict[int, _Request] = {}
        if out.num_rows:
            self._append_tokens(out, sampled, row_lp, {f.seq_id: f for f in finished}, touched)
        for f in finished:
            req = self._requests.get(f.request_id)
            if req is None or req.beam is not None:
                continue
            seq = req.seqs.get(f.seq_id)
            if seq is None:
                if f.reason == "abort" and f.seq_id not in {s.seq_id for s in req.done_seqs}:
                    # Aborted by the scheduler before this engine saw the sequence (capacity).
                    req.done_seqs.append(self._aborted_seq(req, f.seq_id, f.sample_index))
                    touched[f.request_id] = req
                continue
            seq.finish_reason = f.reason
            seq.stop_reason = f.stop_token_id
            if f.reason != "stop":
                seq.detok.flush()
            req.seqs.pop(seq.seq_id)
            req.done_seqs.append(seq)
            touched[f.request_id] = req
            if f.request_finished and not req.seqs:
                self._finish(req)
        for req in self._beams_done:
            touched[req.core_id] = req
        self._beams_done = []
        outputs = []
        for req in touched.values():
            if req.beam is None and not req.seqs and not req.finished:
                self._finish(req)
            outputs.append(self._output(req))
        return outputs

    def _append_tokens(self, out: Any, sampled: np.ndarray, row_lp: Any, ended: dict[int, Any],
                       touched: dict[int, _Request]) -> None:
        lp_by_row = {}
        if row_lp is not None and row_lp[1] is not None:
            rows, lpr = row_lp
            for j, br in enumerate(lpr.rows.tolist()):
                lp_by_row[rows[br]] = (lpr, j)
        for r, (cid, sid) in enumerate(zip(out.row_req_ids.tolist(), out.row_seq_ids.tolist())):
            req = self._requests.get(cid)
            if req is None or req.beam is not None:
                continue
            seq = req.seqs.get(sid)
            if seq is None:
                continue
            tok = int(sampled[r])
            seq.token_ids.append(tok)
            if r in lp_by_row:
                lpr, j = lp_by_row[r]
                n = int(lpr.num_top[j])
                seq.logprobs.append(make_logprobs_entry(
                    tok, float(lpr.sampled_logprobs[j]), int(lpr.sampled_ranks[j]),
                    lpr.top_ids[j, :n], lpr.top_logprobs[j, :n],
                    decode=lambda t: decode_token(self.tokenizer, t)))
                seq.cumulative_logprob += float(lpr.sampled_logprobs[j])
            f = ended.get(seq.seq_id)
            # The stopping EOS / stop token id stays out of the text (vLLM semantics).
            if not (f is not None and f.reason == "stop"):
                seq.detok.append(tok)
            touched[cid] = req
            if f is None and seq.detok.stopped:
                seq.finish_reason, seq.stop_reason = "stop", seq.detok.stop_reason
                self._end_seq(req, seq)

    def _aborted_seq(self, req: _Request, seq_id: int, index: int) -> _Seq:
        s = self._new_seq(req, seq_id, index)
        s.finish_reason = "abort"
        return s

    def _sampling_row(self, req: _Request, seq_id: int) -> SamplingRow:
        seq = req.seqs[seq_id]
        return SamplingRow(req.params, seq.token_ids, req.prompt_token_ids, seq.generator)

    def _end_seq(self, req: _Request, seq: _Seq) -> None:
        """Ends a sequence decided in Python (stop string) in the scheduler too."""
        req.seqs.pop(seq.seq_id, None)
        req.done_seqs.append(seq)
        try:
            self.scheduler.drop_sequence(seq.seq_id)
        except ValueError:
            pass  # already gone
        if not req.seqs:
            self._finish(req)

    def _finish(self, req: _Request) -> None:
        req.finished = True
        self._requests.pop(req.core_id, None)
        self._by_name.pop(req.request_id, None)

    def _output(self, req: _Request) -> RequestOutput:
        if req.beam is not None:
            return self._beam_output(req)
        comps = []
        for s in sorted([*req.done_seqs, *req.seqs.values()], key=lambda s: s.index):
            comps.append(CompletionOutput(
                index=s.index, text=s.detok.text, token_ids=list(s.token_ids),
                cumulative_logprob=s.cumulative_logprob, logprobs=s.logprobs,
                finish_reason=s.finish_reason, stop_reason=s.stop_reason,
            ))
        if req.num_cached_tokens == 0:
            try:
                req.num_cached_tokens = self.scheduler.num_cached_tokens(req.core_id)
            except ValueError:
                pass
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=list(req.prompt_token_ids),
            outputs=comps, finished=req.finished, num_cached_tokens=req.num_cached_tokens,
        )

    # ------------------------------------------------------------------------------------------
    # Beam search
    @_exclusive
    def add_beam_request(self, request_id: str, prompt: Any, beam_width: int, max_tokens: int,
                         length_penalty: float = 1.0, ignore_eos: bool = False) -> None:
        for name, v in (("beam_width", beam_width), ("max_tokens", max_tokens)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if beam_width > self.args.max_num_seqs:
            raise ValueError(f"beam_width={beam_width} is larger than max_num_seqs={self.args.max_num_seqs}")
        length_penalty = check_finite("length_penalty", length_penalty)
        request_id, text, ids = self._checked_prompt(request_id, prompt)
        max_tokens = min(max_tokens, self.max_model_len - len(ids)) if len(ids) < self.max_model_len else 1
        eos = () if ignore_eos else self.eos_token_ids
        state = BeamSearchState(beam_width, max_tokens, length_penalty, tuple(eos))
        params = SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self._submit(request_id, text, ids, params, max_tokens, 0, None, beam=state)

    def _beam_step(self, req: _Request, rows: list[int], row_seq: list[int], logits: torch.Tensor,
                   sampled: np.ndarray) -> None:
        st = req.beam
        seq_ids = [row_seq[r] for r in rows]
        lp = compute_logprobs(logits[torch.tensor(rows, device=logits.device)]).cpu()
        res = st.step(seq_ids, lp)
        if res.done:
            self.scheduler.abort(req.core_id)
            self._finish(req)
            self._beams_done.append(req)
            return
        used: set[int] = set()
        new_beams: dict[int, tuple[float, list[int]]] = {}
        for parent_row, tok, cum in res.next_beams:
            parent = seq_ids[parent_row]
            _, toks = st.beams.get(parent, (0.0, []))
            if parent not in used:
                used.add(parent)
                sampled[rows[parent_row]] = tok
                new_beams[parent] = (cum, toks + [tok])
            else:
                child = self.scheduler.fork_sequence(parent, tok)
                new_beams[child] = (cum, toks + [tok])
        for sid in seq_ids:
            if sid not in used:
                self.scheduler.drop_sequence(sid)
        st.beams = new_beams

    def _beam_output(self, req: _Request) -> RequestOutput:
        comps = []
        eos = set(req.beam.eos_token_ids)
        for i, h in enumerate(req.beam.hypotheses() if req.finished else []):
            comps.append(CompletionOutput(
                index=i, text=self.tokenizer.decode(h.token_ids, skip_special_tokens=True),
                token_ids=list(h.token_ids), cumulative_logprob=h.cumulative_logprob, logprobs=None,
                finish_reason="stop" if h.token_ids and h.token_ids[-1] in eos else "length", stop_reason=None,
            ))
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=list(req.prompt_token_ids),
            outputs=comps, finished=req.finished, num_cached_tokens=req.num_cached_tokens,
        )
