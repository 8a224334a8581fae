"""Beam search mapped onto the scheduler: a step's result applied as forks and drops, and a
finished search's output.

``advance`` (``advance_beams``: each search of a step) runs ``BeamSearchState.step`` on the
request's rows of the step and maps it onto the scheduler (a surviving parent keeps its own row
and gets its token in ``sampled``, extra children are forked with theirs, parents without
children are dropped); a search that is done is ended in the scheduler at once, so its blocks
are freed. Invariants: called between a step's sampling and its ``update`` (the forks carry this
step's token). Costs per step: one log_softmax over the request's rows and O(beam width)
scheduler calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ferrokv.beam_search import ROOT_BEAM, Beam, BeamSearchState, extend
from ferrokv.beam_search_params import BeamSearchParams
from ferrokv.output_processor import RequestState, fill_metrics
from ferrokv.outputs import CompletionOutput, Logprob, RequestOutput
from ferrokv.sampler import compute_logprobs
from ferrokv.sampling_params import SamplingParams

__all__ = ["advance", "advance_beams", "beam_output", "beam_request", "beam_seq_slots", "check_beam_width"]


def check_beam_width(beam_width: int, max_num_seqs: int) -> None:
    if beam_seq_slots(beam_width) > max_num_seqs:
        raise ValueError(f"beam_width={beam_width} needs {beam_seq_slots(beam_width)} sequence slots (its beams "
                         f"and one step's forks), more than max_num_seqs={max_num_seqs}")


def beam_request(p: BeamSearchParams, prompt_len: int, max_model_len: int,
                 eos_token_ids: tuple[int, ...]) -> tuple[BeamSearchState, SamplingParams]:
    """A search's state and the greedy, EOS-blind parameters its sequences run with in the core
    (the search decides the tokens and the ends), ``max_tokens`` capped at the context left."""
    max_tokens = min(p.max_tokens, max_model_len - prompt_len)  # the prompt is shorter (validate_prompt_ids)
    eos = () if p.ignore_eos else eos_token_ids
    state = BeamSearchState(p.beam_width, max_tokens, p.length_penalty, tuple(eos))
    return state, SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def beam_seq_slots(beam_width: int) -> int:
    """Sequence slots a search holds in the scheduler: its beams, and the forks of one step made
    before the step drops the beams without children (all of them from one parent: width - 1);
    a dropped sequence keeps its batch row until the step's update."""
    return 2 * beam_width - 1


def advance_beams(scheduler: Any, requests: dict[int, RequestState], beam_ids: set[int], out: Any,
                  logits: torch.Tensor, sampled: np.ndarray, moved: list[RequestState],
                  on_done: Callable[[RequestState], None]) -> None:
    """One step of every beam search among the step's rows (``advance``): each request that moved
    is appended to ``moved`` before it moves; ``on_done`` is called with each that is done (ended
    in the scheduler) as soon as it is, so a later search that fails loses none of it."""
    row_req = out.row_req_ids
    mask = np.isin(row_req, np.fromiter(beam_ids, dtype=np.int64))
    if not mask.any():
        return
    rows = np.flatnonzero(mask)
    row_seq = out.row_seq_ids.tolist()
    for cid in np.unique(row_req[rows]).tolist():
        req = requests[cid]
        moved.append(req)
        if advance(scheduler, req, rows[row_req[rows] == cid].tolist(), row_seq, logits, sampled):
            on_done(req)


def advance(scheduler: Any, req: RequestState, rows: list[int], row_seq: list[int], logits: torch.Tensor,
            sampled: np.ndarray) -> bool:
    """Moves ``req``'s beam search one step; True when it is done (and ended in the scheduler)."""
    st = req.beam
    seq_ids = [row_seq[r] for r in rows]
    lp = compute_logprobs(logits[torch.tensor(rows, device=logits.device)]).cpu()
    res = st.step(seq_ids, lp)
    if res.done:
        ended = scheduler.finish_request(req.core_id)
        if ended:
            req.final_times = ended[-1].times
            req.num_cached_tokens = ended[-1].num_cached_tokens
        return True
    used: set[int] = set()
    new_beams: dict[int, Beam] = {}
    for parent_row, tok, cum in res.next_beams:
        parent = seq_ids[parent_row]
        beam = extend(st.beams.get(parent, ROOT_BEAM), tok, cum)
        if parent not in used:
            used.add(parent)
            sampled[rows[parent_row]] = tok
            new_beams[parent] = beam
        else:
            new_beams[scheduler.fork_sequence(parent, tok)] = beam
    for sid in seq_ids:
        if sid not in used:
            scheduler.drop_sequence(sid)
    st.beams = new_beams
    return False


def beam_output(req: RequestState, decode: Callable[[list[int], bool], str]) -> RequestOutput:
    """The output of a beam search: its hypotheses, best first, once it has finished."""
    comps = []
    eos = set(req.beam.eos_token_ids)
    for i, h in enumerate(req.beam.hypotheses() if req.finished else []):
        comps.append(CompletionOutput(
            index=i, text=decode(h.token_ids, True), token_ids=list(h.token_ids),
            cumulative_logprob=h.cumulative_logprob,
            logprobs=[{t: Logprob(lp)} for t, lp in zip(h.token_ids, h.token_logprobs)],
            finish_reason="stop" if h.token_ids and h.token_ids[-1] in eos else "length", stop_reason=None,
        ))
    return RequestOutput(
        request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
        outputs=comps, finished=req.finished, num_cached_tokens=req.num_cached_tokens,
        metrics=fill_metrics(req.stats, req.final_times, sum(len(c.token_ids) for c in comps)),
    )
