"""From a step's arrays to ``RequestOutput``s: each request's output state and output kinds.

The scheduler core is the one home of a sequence's tokens and the text layer (``ferrokv.text``)
the home of its text; this module keeps only what a request hands to its caller and cannot get
from them cheaply: per sequence its logprobs (computed by the sampler, one entry per token), a
CUMULATIVE output's token list and text (shared by its successive outputs and grown, as vLLM
does: nothing in the engine reads them back) and how many tokens were handed out; per request
its finished completions and timestamps (``RequestStateStats``).

Invariants: a request gets an output at a step only if it progressed or ended in it, and a
``FINAL_ONLY`` request only when it has finished; a ``DELTA`` output holds only the tokens,
text and logprobs since its previous output (concatenated, they equal the ``CUMULATIVE``
ones); a finished completion's tokens and text are the core's and the text layer's.
Costs per step: nothing for a ``FINAL_ONLY`` request until it ends (then O(its output) once),
O(1) per streaming row and per row that asked for logprobs; no step copies a request's prompt
or output (``prompt_token_ids`` is the request's own list, shared by its outputs).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ferrokv.beam_search import BeamSearchState
from ferrokv.outputs import (
    CompletionOutput,
    ListPrefix,
    RequestOutput,
    RequestOutputKind,
    RequestStateStats,
    TextSoFar,
    make_logprobs_entry,
)
from ferrokv.sampling_params import SamplingParams

__all__ = [
    "RequestState", "SeqState", "aborted_output", "append_logprobs", "build_outputs", "end_completion", "fill_metrics", "final_completion", "new_stats",
    "prompt_of_row", "request_times", "seq_of_row", "split_outputs", "stream_rows",
]

_CUMULATIVE, _DELTA, _FINAL = RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY


@dataclass(slots=True)
class SeqState:
    """One live sequence's sampling and output state (its tokens are the core's)."""

    index: int
    logprobs: list[dict] | None  # one entry per generated token, when the request asked
    cumulative_logprob: float | None
    token_ids: list[int] | None = None  # CUMULATIVE only: the list its outputs share
    text: TextSoFar | None = None  # CUMULATIVE only: the text so far
    num_emitted: int = 0  # tokens handed out in outputs (streaming kinds)
    step_tokens: list[int] | None = None  # DELTA: what this step added, until the output is built
    step_text: str = ""


@dataclass(slots=True)
class RequestState:
    request_id: str
    core_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    kind: RequestOutputKind
    stats: RequestStateStats
    seqs: dict[int, SeqState] = field(default_factory=dict)
    # Sequences that ended: a row of the step in flight when one ended (overlap) adds nothing.
    ended_seqs: set[int] = field(default_factory=set)
    done: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_generated_done: int = 0  # tokens of its sequences that ended
    final_times: Any = None  # the core's timestamps, from its last record once it has ended
    live_times: Any = None  # the core's timestamps once its first token is out (request_times)
    beam: BeamSearchState | None = None
    finished: bool = False
    prompt_logprobs: list[Any] | None = None  # [None, entries...] when the request asked (ferrokv.prompt_logprobs)
    num_prompt_logprobs_sent: int = 0  # DELTA: entries handed out

    def new_seq(self, index: int) -> SeqState:
        """A sequence's output state (not registered: see ``seq_state``)."""
        want_lp = self.params.logprobs is not None
        seq = SeqState(index, [] if want_lp else None, 0.0 if want_lp else None)
        if self.kind == _CUMULATIVE:
            seq.token_ids, seq.text = [], TextSoFar()
        return seq

    def seq_state(self, seq_id: int, index: int) -> SeqState:
        """Sequence ``seq_id``'s output state, made when first needed (a sequence that has
        handed nothing out has none)."""
        seq = self.seqs.get(seq_id)
        if seq is None:
            seq = self.seqs[seq_id] = self.new_seq(index)
        return seq


def new_stats() -> RequestStateStats:
    return RequestStateStats(arrival_time=time.time())


def fill_metrics(stats: RequestStateStats, times: tuple[float, float, float, float, float] | None,
                 num_generated: int) -> RequestStateStats:
    """The request's stats with the core's timestamps (queued, scheduled, first token, last
    token, finished) copied in; a new object, so outputs already handed out keep theirs."""
    if times is None:
        return RequestStateStats(num_generated, stats.arrival_time)
    queued, scheduled, first, last, finished = times
    return RequestStateStats(num_generated, stats.arrival_time, queued, scheduled, first, last, finished,
                             first - queued if first else 0.0)


def append_logprobs(seq_of_row: Callable[[int], tuple[RequestState, SeqState] | None], lpr: Any,
                    sampled: np.ndarray, decode: Callable[[int], str]) -> None:
    """Appends the step's logprob entries (``lpr``: the sampler's ``LogprobsResult``, whose
    ``rows`` are logits rows) to their sequences."""
    for j, r in enumerate(lpr.rows.tolist()):
        found = seq_of_row(r)
        if found is None:
            continue
        req, seq = found
        n = int(lpr.num_top[j])
        lp = float(lpr.sampled_logprobs[j])
        seq.logprobs.append(make_logprobs_entry(
            int(sampled[r]), lp, int(lpr.sampled_ranks[j]), lpr.top_ids[j, :n], lpr.top_logprobs[j, :n],
            decode=decode if req.params.detokenize else None))
        seq.cumulative_logprob += lp


def stream_rows(requests: dict[int, RequestState], req_ids: list[int], seq_ids: list[int], indices: list[int],
                tokens: list[int], deltas: list[str], touched: dict[int, RequestState]) -> None:
    """Applies the streaming rows' new tokens and text deltas (per row: its request's core id,
    its sequence id and sample index, its token, its text delta; rows of sequences that go on,
    of CUMULATIVE and DELTA requests: the text layer lists only those)."""
    for cid, sid, idx, tok, delta in zip(req_ids, seq_ids, indices, tokens, deltas):
        req = requests.get(cid)
        if req is None:
            continue
        seq = req.seq_state(sid, idx)
        if seq.token_ids is not None:  # CUMULATIVE
            seq.token_ids.append(tok)
            seq.text.append(delta)
        else:
            if seq.step_tokens is None:
                seq.step_tokens, seq.step_text = [], ""
            seq.step_tokens.append(tok)
            seq.step_text += delta
        touched[cid] = req


def final_completion(req: RequestState, seq: SeqState, f: Any) -> CompletionOutput:
    """The completion of a sequence that ended (``f``: the core's ``FinishedSequence``, its text
    filled in by the text layer): its whole output, or for DELTA what was not handed out yet."""
    tokens = f.output_token_ids
    logprobs = seq.logprobs
    text = f.text if f.text is not None else ""
    if seq.token_ids is not None:  # CUMULATIVE (the sequence's list stops growing here)
        seq.token_ids.extend(tokens[len(seq.token_ids):])
        tokens = seq.token_ids
    elif req.kind == _DELTA:
        tokens = tokens[seq.num_emitted:]
        text = f.text_delta if f.text_delta is not None else ""
        if logprobs is not None:
            logprobs = logprobs[seq.num_emitted:]
    return CompletionOutput(
        index=seq.index, text=text, token_ids=tokens, cumulative_logprob=seq.cumulative_logprob,
        logprobs=logprobs, finish_reason=f.reason, stop_reason=f.stop_reason,
    )


def _live_completion(req: RequestState, seq: SeqState) -> CompletionOutput | None:
    """A live sequence's completion in a streaming output (None: nothing new for DELTA)."""
    if req.kind == _CUMULATIVE:
        n = seq.num_emitted = len(seq.token_ids)
        # Positional: these run once per streaming output per step. Snapshots: the sequence's
        # lists grow on the engine's thread while a consumer may read this output on its own.
        return CompletionOutput(seq.index, seq.text.snapshot(), ListPrefix(seq.token_ids, n), seq.cumulative_logprob,
                                None if seq.logprobs is None else ListPrefix(seq.logprobs, n))
    if seq.step_tokens is None:
        return None
    start = seq.num_emitted
    seq.num_emitted += len(seq.step_tokens)
    out = CompletionOutput(seq.index, seq.step_text, seq.step_tokens, seq.cumulative_logprob,
                           None if seq.logprobs is None else seq.logprobs[start:seq.num_emitted])
    seq.step_tokens, seq.step_text = None, ""
    return out


def _by_index(c: CompletionOutput) -> int:
    return c.index


def build_outputs(touched: Iterable[RequestState], ended_now: dict[int, list[CompletionOutput]],
                  times_of: Callable[[RequestState], Any]) -> list[RequestOutput]:
    """The step's outputs: one per touched request that has something for its kind.
    ``ended_now``: per request, the completions that ended at this step (already in ``done``)."""
    outputs = []
    for req in touched:
        kind = req.kind
        if kind == _FINAL and not req.finished:
            continue
        if kind == _DELTA:
            comps = list(ended_now.get(req.core_id, ()))
        else:
            comps = list(req.done)
        generated = req.num_generated_done
        for seq in req.seqs.values():
            c = _live_completion(req, seq)
            if c is not None:
                comps.append(c)
            generated += seq.num_emitted
        if len(comps) > 1:
            comps.sort(key=_by_index)
        # times_of first: it also records the request's cache hits, which this output carries.
        metrics = fill_metrics(req.stats, times_of(req), generated)
        outputs.append(RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, _prompt_logprobs_out(req),
                                     comps, req.finished, metrics, num_cached_tokens=req.num_cached_tokens))
    return outputs


def _prompt_logprobs_out(req: RequestState) -> list[Any] | None:
    """What an output carries of the prompt logprobs: all of them, or for DELTA those not
    handed out yet (vLLM's semantics)."""
    plp = req.prompt_logprobs
    if plp is None or req.kind != _DELTA:
        return plp
    new = plp[req.num_prompt_logprobs_sent:]
    req.num_prompt_logprobs_sent = len(plp)
    return new


def end_completion(req: RequestState, f: Any, ended_now: dict[int, list[CompletionOutput]]) -> None:
    """Records the completion of a sequence that ended (``f``, a ``FinishedSequence``)."""
    seq = req.seqs.pop(f.seq_id, None)
    req.ended_seqs.add(f.seq_id)
    if seq is None:  # it never handed anything out, or the scheduler ended it unseen (capacity abort)
        seq = req.new_seq(f.sample_index)
    c = final_completion(req, seq, f)
    req.done.append(c)
    req.num_generated_done += len(f.output_token_ids)
    ended_now.setdefault(req.core_id, []).append(c)
    if f.request_finished:
        req.final_times = f.times
        req.num_cached_tokens = f.num_cached_tokens


def aborted_output(req: RequestState, ended: list[Any], times_of: Callable[[RequestState], Any]) -> RequestOutput:
    """The final output of an aborted request (``ended``: the abort's records)."""
    if req.beam is not None:  # an unfinished beam search has no hypotheses to report
        return RequestOutput(request_id=req.request_id, prompt=req.prompt,
                             prompt_token_ids=req.prompt_token_ids, outputs=[], finished=True,
                             num_cached_tokens=req.num_cached_tokens,
                             metrics=fill_metrics(req.stats, None, req.num_generated_done))
    now: dict[int, list[CompletionOutput]] = {}
    for f in ended:
        end_completion(req, f, now)
    # Sequences the scheduler had ended already, and samples not forked yet (a request aborted
    # while it waited has one sequence): every one of the n is reported, as vLLM does.
    reported = {c.index for c in req.done}
    live = {seq.index: seq for seq in req.seqs.values()}
    req.seqs.clear()
    for index in range(req.params.n):
        if index in reported:
            continue
        seq = live.get(index) or req.new_seq(index)
        c = CompletionOutput(index=seq.index, text=seq.text.snapshot() if seq.text is not None else "",
                             token_ids=list(seq.token_ids or []),
                             cumulative_logprob=seq.cumulative_logprob, logprobs=seq.logprobs,
                             finish_reason="abort")
        req.done.append(c)
        now.setdefault(req.core_id, []).append(c)
    return build_outputs([req], now, times_of)[0]


def split_outputs(outputs: list[RequestOutput], request_ids: set[str]) -> tuple[list[RequestOutput], list[RequestOutput]]:
    """(those of these requests, the others), each in order."""
    taken = [o for o in outputs if o.request_id in request_ids]
    return taken, [o for o in outputs if o.request_id not in request_ids] if taken else outputs


def request_times(scheduler: Any, req: RequestState) -> Any:
    """The core's timestamps of a request: from its last record once it has ended; read from
    the core until its first token (with its cache hits), then only the last-token time moves,
    and it is this step's (the request got a token in it)."""
    if req.finished:
        return req.final_times
    if req.live_times is None:
        try:
            req.num_cached_tokens = scheduler.num_cached_tokens(req.core_id)
            times = scheduler.request_times(req.core_id)
        except ValueError:
            return None
        if times[2]:
            req.live_times = times
        return times
    queued, scheduled, first, _, _ = req.live_times
    return queued, scheduled, first, scheduler.clock_ts, 0.0


def prompt_of_row(requests: dict[int, RequestState], out: Any) -> Callable[[int], Sequence[int]]:
    """Logits row of step ``out`` -> its request's prompt ids (empty once the request ended)."""
    def prompt_of(r: int) -> Sequence[int]:
        req = requests.get(int(out.row_req_ids[r]))
        return () if req is None else req.prompt_token_ids

    return prompt_of


def seq_of_row(requests: dict[int, RequestState], out: Any) -> Callable[[int], tuple[RequestState, SeqState] | None]:
    """Logits row of step ``out`` -> (its request, its sequence's output state, made on first
    use); None for an ended request or sequence, or a beam search."""
    row_req, row_seq, row_idx = out.row_req_ids, out.row_seq_ids, out.row_sample_index

    def find(r: int) -> tuple[RequestState, SeqState] | None:
        req = requests.get(int(row_req[r]))
        seq_id = int(row_seq[r])
        if req is None or req.beam is not None or seq_id in req.ended_seqs:
            return None
        return req, req.seq_state(seq_id, int(row_idx[r]))

    return find
