"""The text layer: where generated tokens become text and stop strings end sequences.

Two implementations behind one interface, chosen once per engine by ``make_text_layer``:

* ``RustText`` (the normal path): the model's ``tokenizer.json`` is loaded by the Rust
  ``tokenizers`` crate (``ferrokv._core.TextModel``, from the ``ferrokv-text`` crate) and
  attached to the scheduler, which keeps each step's rows and tokens after ``update``;
  ``Scheduler.take_step_results`` then detokenizes them and ends sequences on stop strings itself,
  with the GIL released, fed from the tokens the core keeps.
* ``PythonText``: for a tokenizer the Rust crate cannot load (a slow-only tokenizer): the
  Python ``IncrementalDetokenizer`` per sequence, a stop string ending its sequence through
  ``Scheduler.stop_sequence``.

Both give the same text (vLLM's semantics: ``ferrokv.detokenizer``) and the same results:
``step_results`` (called once per step after its ``update``, possibly while the next step is in
flight: a sequence stopped on a string then loses that step's token) returns the step's finished
records with ``text``/``text_delta``/``stop_reason`` set, and its streaming rows (rows of
CUMULATIVE/DELTA requests whose sequence got a token and goes on) with their text deltas;
``after_abort`` fills in the records of an abort. Costs per step: ``RustText`` one call; ``PythonText`` O(rows) Python.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from ferrokv._core import FinishedSequence, Scheduler, TextModel
from ferrokv.detokenizer import IncrementalDetokenizer
from ferrokv.sampling_params import SamplingParams

__all__ = ["PythonText", "RustText", "make_text_layer"]

logger = logging.getLogger("ferrokv")

_NO_ROWS = np.zeros(0, dtype=np.int64)


class RustText:
    """The Rust text layer, attached to the scheduler (see the module docs)."""

    def __init__(self, scheduler: Scheduler, model: TextModel) -> None:
        self.model = model
        scheduler.attach_text(model)

    def request_kwargs(self, params: SamplingParams, stream: bool) -> dict[str, Any]:
        """Keywords for ``Scheduler.add_request`` that register the request's text."""
        return dict(stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output,
                    skip_special_tokens=params.skip_special_tokens, stream_text=stream,
                    detokenize=params.detokenize)

    def add_request(self, core_id: int, params: SamplingParams, prompt_ids: list[int], stream: bool) -> None:
        pass  # registered by Scheduler.add_request (request_kwargs)

    def step_results(self, scheduler: Scheduler, out: Any,
                     sampled: np.ndarray) -> tuple[list[FinishedSequence], np.ndarray, list[str]]:
        return scheduler.take_step_results()  # the scheduler kept the step's rows and tokens

    def after_abort(self, finished: list[FinishedSequence]) -> list[FinishedSequence]:
        return finished  # Scheduler.abort filled their text

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.model.decode(ids, skip_special_tokens)


class PythonText:
    """The Python text layer (see the module docs)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[int, tuple[SamplingParams, list[int], bool]] = {}
        # Per live sequence: its detokenizer and how much of its text deltas have taken.
        self._seqs: dict[int, list[Any]] = {}
        # Per live request: its sequences that ended (a step's rows may name one that a stop
        # string ended a step late, while the step ran: it gets no new state).
        self._ended: dict[int, set[int]] = {}

    def request_kwargs(self, params: SamplingParams, stream: bool) -> dict[str, Any]:
        return {}

    def add_request(self, core_id: int, params: SamplingParams, prompt_ids: list[int], stream: bool) -> None:
        self._requests[core_id] = (params, prompt_ids, stream)

    def _state(self, core_id: int, seq_id: int) -> list[Any] | None:
        st = self._seqs.get(seq_id)
        if st is None:
            req = self._requests.get(core_id)
            if req is None or seq_id in self._ended.get(core_id, ()) or not req[0].detokenize:
                return None  # not a text request (beam search, detokenize=False) or already ended
            st = self._seqs[seq_id] = [IncrementalDetokenizer.from_params(self.tokenizer, req[0], req[1]), 0]
        return st

    def step_results(self, scheduler: Scheduler, out: Any,
                     sampled: np.ndarray) -> tuple[list[FinishedSequence], np.ndarray, list[str]]:
        finished = scheduler.take_step_results()[0]
        ended = {f.seq_id: f for f in finished}
        rows: list[int] = []
        deltas: list[str] = []
        for r, (cid, sid) in enumerate(zip(out.row_req_ids.tolist(), out.row_seq_ids.tolist())):
            st = self._state(cid, sid)
            f = ended.get(sid)
            if st is None:
                req = self._requests.get(cid)
                if req is not None and req[2] and f is None and not req[0].detokenize:
                    rows.append(r)  # detokenize=False: it streams token ids, with no text
                    deltas.append("")
                continue
            if st[0].stopped:
                continue
            if f is not None and f.reason == "stop" and not self._requests[cid][0].include_stop_str_in_output:
                continue  # EOS / a stop token id: kept out of the text unless asked, as in vLLM
            d = st[0]
            d.append(int(sampled[r]))
            if d.stopped and f is None:
                index = self._requests[cid][0].stop.index(d.stop_reason)
                finished.append(scheduler.stop_sequence(sid, index))
            elif f is None and self._requests[cid][2]:
                rows.append(r)
                text = d.text
                deltas.append(text[st[1]:])
                st[1] = len(text)
        return self.after_abort(finished), (np.asarray(rows, dtype=np.int64) if rows else _NO_ROWS), deltas

    def after_abort(self, finished: list[FinishedSequence]) -> list[FinishedSequence]:
        """Fills in the text of ended sequences (flushing those that did not stop on a string;
        one that reached its length on the token that completed a stop string stops on it)."""
        out = []
        for f in finished:
            st = self._state(f.request_id, f.seq_id)
            self._seqs.pop(f.seq_id, None)
            params = self._requests.get(f.request_id, (None,))[0]
            if f.request_finished:
                self._requests.pop(f.request_id, None)
                self._ended.pop(f.request_id, None)
            elif f.request_id in self._requests:
                self._ended.setdefault(f.request_id, set()).add(f.seq_id)
            if st is None:
                out.append(f.with_text("", ""))
                continue
            d, taken = st
            index = None
            if d.stopped:
                index = params.stop.index(d.stop_reason)
            else:
                d.flush()
            text = d.text
            out.append(f.with_text(text, text[taken:], index, d.stop_reason))
        return out

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def make_text_layer(tokenizer: Any, scheduler: Scheduler) -> RustText | PythonText:
    """``RustText`` when the tokenizer has a ``tokenizer.json`` the Rust crate loads, else
    ``PythonText`` (logged)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        logger.info("tokenizer %s has no tokenizers backend: detokenizing in Python", type(tokenizer).__name__)
        return PythonText(tokenizer)
    try:
        model = TextModel(backend.to_str())
    except ValueError as e:
        logger.warning("the Rust detokenizer cannot load this tokenizer (%s): detokenizing in Python", e)
        return PythonText(tokenizer)
    return RustText(scheduler, model)
