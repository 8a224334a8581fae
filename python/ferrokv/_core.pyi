"""Type stubs for ``ferrokv._core``, the Rust scheduler over a paged KV cache.

Conventions
-----------
* Block 0 is the null block: block tables are padded with it and it is never allocated.
* ``slot = block_id * block_size + offset``; the core never pads tokens, -1 in a slot mapping is
  reserved for padding a runner adds.
* Sampling rows: one per sequence that completes its pending tokens this step. For a request
  with ``n > 1`` the last prompt row is sampled ``n`` times: ``logits_indices`` repeats that token
  index, and ``row_seq_ids`` names the ``n`` sequences (samples 1..n-1 are forked off the prompt
  sequence by ``update``, sharing its blocks copy-on-write). ``row_sample_index`` is 0..n-1.
* Block ops run before the forward pass in the order swap_out, swap_in, copy_ops.
* Sequences are listed in the scheduler's batch-row order (stable while a sequence runs; a
  finished sequence's row is taken by the last one), not in request order: match them by
  ``seq_ids``/``req_ids``.
* Arrays are created on first access. Every array except ``block_tables`` owns Rust memory
  (``flags.owndata`` is False: numpy does not own it; the Rust buffer is freed when the array is
  collected) and stays valid forever.
* ``block_tables``: when every running sequence is in the step (the usual case), it is a
  read-only view (``block_tables_is_view`` True, ``base`` the ``Scheduler``) of rows ``0..S`` of the
  scheduler's persistent batch matrix, which is never rebuilt: rows are updated in place as
  sequences gain blocks, so its row stride is the widest possible table (``max_model_len /
  block_size``), not M. It must be read between ``schedule()`` and ``update()`` (reading it later
  raises ``SchedulerStateError``) and an array obtained in time changes with later steps: copy it
  (``a.copy()``, as a device upload does) to keep it. Otherwise (some running sequence is not in
  the step) it is a compact ``[S, M]`` copy like the other arrays.
* ``block_size`` must be a power of two (the kernels tile a block by it); the batch matrix needs
  ``max_num_seqs * max_model_len / block_size <= 2**28`` entries (at most 1 GiB of address
  space, committed by the OS only as rows are used).
"""

from typing import Sequence

import numpy as np
import numpy.typing as npt

__version__: str

class FerrokvError(Exception):
    """Base class of every ferrokv error."""

class InvalidArgumentError(FerrokvError, ValueError):
    """A field has a bad value; the message names the field and the value.

    Raised by the core for a bad field, it also carries the parts of its message (else None)."""

    field: str | None
    value: str | None  # as the message writes it
    reason: str | None

class DuplicateRequestError(InvalidArgumentError): ...
class UnknownRequestError(InvalidArgumentError): ...
class UnknownSequenceError(InvalidArgumentError): ...
class PromptTooLongError(InvalidArgumentError):
    """The prompt exceeds max_model_len (``field``: "prompt_token_ids")."""

class CacheCapacityError(InvalidArgumentError):
    """The request could never fit in the KV cache, even alone (worst case over max_tokens and n);
    ``field``: "prompt_token_ids" when the prompt alone overflows it, else "max_tokens"."""

class SchedulerStateError(FerrokvError, RuntimeError):
    """Calls made out of order, e.g. ``schedule()`` twice without ``update()``."""

SCHEDULER_DEFAULTS: dict[str, int | bool | float | str]
"""``SchedulerConfig::default()``: the one source of the scheduling defaults (EngineArgs, CLI)."""
SCHEDULER_CHOICES: dict[str, list[str]]
"""The names each setting chosen by name accepts (``preemption_mode``, ``policy``)."""

TokenIds = Sequence[int] | npt.NDArray[np.int32] | npt.NDArray[np.int64]

class SchedulerOutput:
    """One scheduling step. S = num_seqs, T = num_tokens, R = num_rows, M = max blocks."""

    step_id: int
    num_seqs: int
    num_tokens: int
    num_rows: int
    num_prefill_tokens: int
    num_decode_tokens: int
    max_query_len: int  # the longest query of the step (0 when none)
    max_seq_len: int  # the longest sequence of the step (0 when none)
    block_size: int
    @property
    def req_ids(self) -> npt.NDArray[np.int64]: ...  # [S]
    @property
    def seq_ids(self) -> npt.NDArray[np.int64]: ...  # [S]
    @property
    def query_start_loc(self) -> npt.NDArray[np.int32]: ...  # [S+1], cu_seqlens of new tokens
    @property
    def seq_lens(self) -> npt.NDArray[np.int32]: ...  # [S], context length after this step
    @property
    def prompt_lens(self) -> npt.NDArray[np.int32]: ...  # [S], the length of each sequence's prompt
    @property
    def block_tables(self) -> npt.NDArray[np.int32]: ...  # [S, M], padded with block 0 (see above)
    @property
    def block_tables_is_view(self) -> bool: ...  # block_tables views the batch matrix: copy to keep
    @property
    def input_ids(self) -> npt.NDArray[np.int64]: ...  # [T]
    @property
    def positions(self) -> npt.NDArray[np.int64]: ...  # [T]
    @property
    def slot_mapping(self) -> npt.NDArray[np.int64]: ...  # [T]
    @property
    def logits_indices(self) -> npt.NDArray[np.int64]: ...  # [R], token index (may repeat)
    @property
    def row_req_ids(self) -> npt.NDArray[np.int64]: ...  # [R]
    @property
    def row_seq_ids(self) -> npt.NDArray[np.int64]: ...  # [R]
    @property
    def row_sample_index(self) -> npt.NDArray[np.int32]: ...  # [R]
    # Sampling, per logits row: the request's parameters (kept in the core, copied into each of
    # its sequences' batch rows), so a step's sampling metadata is read from arrays.
    @property
    def row_temperature(self) -> npt.NDArray[np.float32]: ...  # [R], 0 = greedy
    @property
    def row_top_k(self) -> npt.NDArray[np.int32]: ...  # [R], <= 0 = off
    @property
    def row_top_p(self) -> npt.NDArray[np.float32]: ...  # [R]
    @property
    def row_min_p(self) -> npt.NDArray[np.float32]: ...  # [R]
    @property
    def row_presence(self) -> npt.NDArray[np.float32]: ...  # [R] presence_penalty
    @property
    def row_frequency(self) -> npt.NDArray[np.float32]: ...  # [R] frequency_penalty
    @property
    def row_repetition(self) -> npt.NDArray[np.float32]: ...  # [R] repetition_penalty
    @property
    def row_num_logprobs(self) -> npt.NDArray[np.int32]: ...  # [R], -1 = none
    @property
    def row_uniform(self) -> npt.NDArray[np.float64]: ...  # [R] in [0, 1); 0.0 for greedy rows
    # (the row's draw: xxh3 of (sample index, position of the sampled token) keyed by the
    # request's seed, else by its id and ``sampling_seed``: independent of the batch)
    @property
    def row_batch_rows(self) -> npt.NDArray[np.int32]: ...  # [R] batch row; -1 = a sample forked at update
    @property
    def row_num_output(self) -> npt.NDArray[np.int32]: ...  # [R] tokens generated before this step
    @property
    def banned_rows(self) -> npt.NDArray[np.int64]: ...  # [B] bans (min_tokens, bad_words): logits row
    @property
    def banned_tokens(self) -> npt.NDArray[np.int64]: ...  # [B] ... and the token
    @property
    def bias_rows(self) -> npt.NDArray[np.int64]: ...  # [S] logits rows of has_logit_bias requests
    num_greedy_rows: int
    max_top_k: int  # largest enabled top_k, 0 if none
    any_top_p: bool  # some row has top_p < 1
    any_min_p: bool  # some row has min_p > 0
    any_penalties: bool  # some row has a non-neutral penalty
    any_logprobs: bool  # some row wants logprobs
    any_logit_bias: bool  # bias_rows is not empty
    @property
    def copy_ops(self) -> npt.NDArray[np.int32]: ...  # [K, 2] (src, dst) copy-on-write
    @property
    def swap_out(self) -> npt.NDArray[np.int32]: ...  # [K, 2] (gpu_block, cpu_block)
    @property
    def swap_in(self) -> npt.NDArray[np.int32]: ...  # [K, 2] (cpu_block, gpu_block)
    @property
    def finished_req_ids(self) -> npt.NDArray[np.int64]: ...  # ended since the previous step
    @property
    def preempted_req_ids(self) -> npt.NDArray[np.int64]: ...  # preempted in this step

class FinishedSequence:
    request_id: int
    seq_id: int
    sample_index: int
    reason: str  # "stop" | "length" | "abort"
    stop_token_id: int | None  # set when a stop_token_ids entry ended it
    stop_str_index: int | None  # set when one of the request's stop strings ended it
    request_finished: bool  # the request's last sequence: the request is gone
    num_cached_tokens: int  # its request's prompt tokens served from the prefix cache
    text: str | None  # the final text (None without a text layer)
    text_delta: str | None  # text not yet taken by a streaming output
    # (queued, scheduled, first token, last token, finished), time.monotonic() seconds (0.0 =
    # not yet); set on the record with request_finished
    times: tuple[float, float, float, float, float] | None
    @property
    def output_token_ids(self) -> list[int]:
        """The generated token ids (moved out of the core as the sequence ended)."""
    @property
    def stop_reason(self) -> int | str | None:
        """vLLM's ``stop_reason``: the stop string, else the stop token id, else None."""
    def with_text(self, text: str, text_delta: str, stop_str_index: int | None = None,
                  stop_string: str | None = None) -> FinishedSequence:
        """A copy with the text fields set (for a text layer written in Python); with
        ``stop_string``, it ended on that string (reason "stop")."""

class Scheduler:
    def __init__(
        self,
        num_blocks: int,
        # Keywords left out (or None) take the core's defaults, SCHEDULER_DEFAULTS.
        block_size: int | None = None,  # power of two
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        max_model_len: int | None = None,
        enable_prefix_caching: bool | None = None,
        preemption_mode: str | None = None,  # "recompute" | "swap"
        num_cpu_blocks: int | None = None,
        policy: str | None = None,  # "fcfs" | "priority" (lower value first)
        watermark: float | None = None,  # fraction of blocks admission keeps free
        admission_headroom: float | None = None,  # and this many blocks more per running sequence (anti-thrash)
        sampling_seed: int | None = None,  # keys unseeded requests' draws (any int, mod 2**64); None = 0
    ) -> None: ...
    def add_request(
        self,
        request_id: int,
        prompt_token_ids: TokenIds,
        max_tokens: int,
        *,
        n: int = 1,
        priority: int = 0,
        eos_token_id: int | None = None,
        stop_token_ids: TokenIds | None = None,
        min_tokens: int = 0,
        ignore_eos: bool = False,
        min_tokens_bans: TokenIds | None = None,  # banned under min_tokens too; stop nothing
        cache_salt: str | None = None,
        reserve_seqs: int = 0,  # batch slots held for life, e.g. a beam width (0 = n)
        # Text (only with a text layer attached): stop strings end sequences in update.
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        stream_text: bool = False,  # text deltas every step (take_step_results)
        # Sampling (validated; handed out per logits row as SchedulerOutput.row_*):
        temperature: float = 0.0,  # 0 = greedy
        top_k: int = 0,  # <= 0 = off
        top_p: float = 1.0,  # in (0, 1]
        min_p: float = 0.0,  # in [0, 1]
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,  # > 0
        seed: int | None = None,  # any int (mod 2**64): the request's draws depend on it alone
        logprobs: int | None = None,  # >= 0
        # Per-token logit rules: bad_words bans come out in banned_rows/banned_tokens; a request
        # with has_logit_bias lists its logits rows in bias_rows (the engine keeps the bias).
        bad_words: Sequence[TokenIds] | None = None,  # each non-empty
        has_logit_bias: bool = False,
        skip_cache_hits: bool = False,  # compute the whole prompt (prompt logprobs)
        detokenize: bool = True,  # False: no text (no stop strings), empty text deltas
    ) -> None: ...
    def attach_text(self, model: TextModel) -> None:
        """Gives the scheduler a text layer: requests added from now on are detokenized in
        ``update`` (GIL released), which ends sequences on their stop strings; every ended
        sequence's record then carries its text."""
    @property
    def clock_ts(self) -> float:
        """The core's clock (``time.monotonic()`` scale) at its last schedule, update,
        cancel_step or abort: after ``update``, when its tokens were appended."""
    def text_state(self) -> tuple[int, int]:
        """(requests, sequences) holding text state (0, 0 once every request has ended)."""
    def schedule(self) -> SchedulerOutput:
        """The next batch; runs with the GIL released. When every running sequence decodes one
        token, the step is planned over the persistent batch rows without visiting a request
        (also when the only other running requests are prefill chunks at the back of the
        order)."""
    def update(self, output: SchedulerOutput, sampled_token_ids: TokenIds, *,
               defer_text: bool = False) -> list[FinishedSequence]:
        """One token per logits row of ``output``; runs with the GIL released. Rows of aborted,
        stopped or dropped sequences are ignored. Returns the sequences that ended (incl. forks
        that ended at once and requests aborted because they outgrew the cache).

        With ``defer_text`` the tokens are appended and the step's text work (detokenization,
        stop strings, streaming deltas) and its records wait for ``take_step_results``; it
        returns []. Without it the text work runs before it returns (its streaming deltas are
        dropped: a streaming caller defers). It raises ``SchedulerStateError`` while an earlier
        deferred step's results are untaken. Any call that changes sequences (update, cancel_step, abort, stop_sequence,
        fork_sequence, drop_sequence) runs the deferred text work first; ``schedule`` does not."""
    def take_step_results(self) -> tuple[list[FinishedSequence], npt.NDArray[np.int64], list[str]]:
        """The deferred step's ended sequences (with their text), its streaming rows (indices
        into its logits rows) and their text deltas, once (GIL released); empty if none."""
    def cancel_step(self, output: SchedulerOutput) -> None:
        """Instead of ``update`` when the step's forward pass failed or was interrupted: no token is
        appended and no computed count advances; blocks the step allocated are released, requests
        whose block ops may not have run are recomputed, a request that forked or dropped a
        sequence mid-step is aborted. What the output reported is reported again."""
    def cancel_step_in_flight(self) -> bool:
        """``cancel_step`` of whichever step is in flight (for a caller interrupted before it held
        that step's output); False when no step is in flight."""
    def abort(self, request_id: int) -> list[FinishedSequence]:
        """Ends a request anywhere (waiting, running, swapped, mid-step); returns its sequences as
        aborted, with the tokens each generated."""
    def finish_request(self, request_id: int) -> list[FinishedSequence]:
        """Ends a request its caller found complete (a beam search), as ``abort`` does, but
        counted as finished; its sequences end with "length"."""
    def stop_sequence(self, seq_id: int, stop_str_index: int) -> FinishedSequence:
        """Ends a sequence because stop string ``stop_str_index`` of its request appeared in its
        text. Legal at any time (text may run a step behind): a step in flight then ignores its
        row, and a request that lost one of several sequences mid-step is aborted if that step
        is cancelled."""
    def output_tokens(self, seq_id: int) -> list[int]:
        """The tokens a live sequence has generated so far (O(output length))."""
    def fork_sequence(self, seq_id: int, next_token: int | None = None) -> int:
        """A new sequence sharing all blocks of ``seq_id`` (copy-on-write), once its prompt is computed
        (else ``SchedulerStateError``). While a step is in flight for ``seq_id``, ``next_token`` is the
        child's sampled token for that step; otherwise None."""
    def drop_sequence(self, seq_id: int) -> bool:
        """Ends a sequence and frees its blocks; True if it was its request's last."""
    def reset_prefix_cache(self) -> None: ...
    def request_seq_ids(self, request_id: int) -> list[int]: ...
    def num_cached_tokens(self, request_id: int) -> int: ...
    def request_times(self, request_id: int) -> tuple[float, float, float, float, float]:
        """(queued, scheduled, first token, last token, finished) of a live request, in
        time.monotonic() seconds; 0.0 = not yet."""
    def seq_block_table(self, seq_id: int) -> list[int]: ...
    def seq_tokens(self, seq_id: int) -> list[int]: ...
    def has_unfinished(self) -> bool: ...
    def check_invariants(self) -> None: ...
    def stats(self, full: bool = True) -> dict[str, int]:
        """Counters and KV usage; ``full=False`` leaves out the O(blocks) usage counts
        (``num_shared_blocks``, ``num_block_refs``, ``num_used_token_slots``). The steps that
        scheduled work are counted by their tokens: ``step_tokens_le_{bound}`` per bucket (vLLM's
        ``iteration_tokens_total`` bounds, then ``step_tokens_le_inf``; not cumulative) and
        ``step_tokens_sum``; a cancelled step counts in none of them."""
        ...
    @property
    def num_free_blocks(self) -> int: ...
    def max_fitting_tokens(self, prompt_len: int, n: int) -> int:
        """The most new tokens ``n`` samples of a ``prompt_len``-token prompt can ask for and be
        admitted (the worst-case check: the prompt's full blocks once, which the samples share, and
        each sample the rest of its context but its last token, never cached); 0 when not even one
        fits."""
        ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def num_running(self) -> int: ...
    @property
    def num_running_seqs(self) -> int: ...
    @property
    def num_unfinished(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def max_num_seqs(self) -> int: ...

def validate_scheduler_config(
    *,
    block_size: int,
    max_num_seqs: int,
    num_blocks: int | None,  # None: not known yet (the smallest valid count stands in)
    max_model_len: int | None,  # None: not known yet (1 stands in)
    num_cpu_blocks: int,
    preemption_mode: str,
    policy: str,
) -> None:
    """Raises ``InvalidArgumentError`` where ``Scheduler(...)`` with these settings would, using the
    core's own checks, so an engine can reject a bad value before it loads a model. The token
    budget is taken as ``max_num_seqs``; settings not listed take the core's defaults."""

class TextModel:
    """A tokenizer.json loaded once for decoding (ferrokv-text); shared by any number of
    ``SeqText``. A file that does not load raises ``InvalidArgumentError`` naming
    ``tokenizer_json``."""
    def __init__(self, tokenizer_json: str) -> None: ...
    def decode(self, ids: TokenIds, skip_special_tokens: bool = True) -> str:
        """One-shot decode, exactly ``tokenizers``' ``decode``; unknown ids decode to nothing."""
    @property
    def vocab_size(self) -> int: ...  # distinct tokens, added ones included (len(tokenizer))

class SeqText:
    """One sequence's incremental detokenizer with stop strings: the Rust port of
    ``ferrokv.detokenizer.IncrementalDetokenizer`` (same text, same deltas). ``prompt_tail``: the
    last prompt ids (up to 7 are used; the last 5 kept ones are decoding context)."""
    def __init__(
        self,
        model: TextModel,
        prompt_tail: TokenIds,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,  # stop strings are searched once more tokens than this were appended
        skip_special_tokens: bool = True,
    ) -> None: ...
    def append(self, token: int) -> int | None:
        """Appends one generated token; returns the index (into ``stop``) of the stop string it
        completed: the text is then cut and further appends raise ``RuntimeError``."""
    def flush(self) -> None:
        """End of the sequence for any reason but a stop string: releases held-back text and
        drops pending tokens (an incomplete character), as vLLM does."""
    def take_delta(self) -> str:
        """Text emitted since the previous call."""
    @property
    def text(self) -> str: ...  # all text emitted so far
    @property
    def num_tokens(self) -> int: ...  # tokens appended (skipped ones included)
    @property
    def stop_index(self) -> int | None: ...
