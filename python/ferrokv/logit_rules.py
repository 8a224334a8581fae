"""Per-token logit rules of a request: ``logit_bias``, ``allowed_token_ids`` and ``bad_words``.

``bad_words`` become token-id sequences here (``bad_words_token_ids``, as vLLM encodes them) and
are banned by the core: each step it hands out the last token of every word whose other tokens
end a row's output, with the ``min_tokens`` bans (``SchedulerOutput.banned_*``).

``logit_bias`` and ``allowed_token_ids`` are static: one additive row per request (``-inf``
outside the allowed ids, then the biases added), built once when a step first has the request's
rows and kept by ``LogitBiasState`` in a ``[slots, V]`` tensor, one slot per biased request that
has run (its samples share it), freed when the request ends; a waiting request holds only its
params. The core lists the logits rows of such requests each step
(``bias_rows``); their slots are found with one ``searchsorted`` over the sorted request ids, and
the rows gathered with one ``index_select``.

Invariants: a slot holds the row of the request registered in it; a row whose request was
released meanwhile (it ended while its row was in flight) gets a zero row. The bias never touches
logprobs, which are the raw model's (vLLM's default).
Costs per step: nothing when no row has a bias; else O(S * V) for the S biased rows (gather, add)
and O(S log B) to find the slots of B biased requests (``ferrokv.id_index``); O(|bias| + |allowed|)
once per request (its first step), and O(1) amortized to register or release it.
Memory: (most biased requests that have run and not ended at once) * V * 4 bytes, grown on demand:
bounded by the running batch and the preempted, never by the queue.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ferrokv.id_index import IdIndex
from ferrokv.sampling_params import SamplingParams

__all__ = ["MAX_BAD_WORDS_TOKENS", "MAX_NUM_BAD_WORDS", "LogitBiasState", "bad_words_token_ids", "check_token_rules",
           "has_logit_bias"]

# vLLM's caps per request: the core checks every banned sequence against each row's output tail
# every step, and encoding the words holds the engine, so neither may grow without bound.
MAX_NUM_BAD_WORDS = 128  # token sequences (a word can give two: plain and after a space)
MAX_BAD_WORDS_TOKENS = 1024  # their tokens in all


def has_logit_bias(params: SamplingParams) -> bool:
    """The request has a static bias row (``logit_bias`` or ``allowed_token_ids``)."""
    return bool(params.logit_bias) or params.allowed_token_ids is not None


def check_token_rules(params: SamplingParams, vocab_size: int) -> None:
    """Token ids of ``logit_bias``, ``allowed_token_ids`` and ``stop_token_ids`` must be in the
    vocabulary (vLLM's; an id past it could never be sampled)."""
    for name, ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ()),
                      ("stop_token_ids", params.stop_token_ids or ())):
        bad = sorted({t for t in ids if t >= vocab_size})
        if bad:
            raise ValueError(f"{name} has token ids out of the vocabulary (size {vocab_size}): {bad[:8]}")


def bad_words_token_ids(tokenizer: Any, words: list[str], vocab_size: int) -> list[list[int]]:
    """Each word's token ids, as vLLM encodes them: the word with its leading spaces stripped,
    and again after one space when that gives a different first token and the same length. At
    most ``MAX_NUM_BAD_WORDS`` sequences of ``MAX_BAD_WORDS_TOKENS`` tokens in all (vLLM's caps)."""
    if len(words) > MAX_NUM_BAD_WORDS:  # before encoding any: each word gives at least one sequence
        raise ValueError(f"bad_words has {len(words)} words; at most {MAX_NUM_BAD_WORDS} are allowed")
    out: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        for ids in (plain, spaced):
            if not ids:
                continue
            if ids is spaced and (not out or ids[0] == out[-1][0] or len(ids) != len(out[-1])):
                continue
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"bad_words {word!r} has token ids out of the vocabulary (size {vocab_size}): {bad}")
            out.append(list(ids))
    if len(out) > MAX_NUM_BAD_WORDS:
        raise ValueError(f"bad_words give {len(out)} token sequences (a word's plain and space-prefixed forms); "
                         f"at most {MAX_NUM_BAD_WORDS} are allowed")
    total = sum(map(len, out))
    if total > MAX_BAD_WORDS_TOKENS:
        raise ValueError(f"bad_words give {total} tokens in all; at most {MAX_BAD_WORDS_TOKENS} are allowed")
    return out


class LogitBiasState:
    """The live biased requests' additive rows, one slot each (see the module docs)."""

    __slots__ = ("vocab_size", "device", "table", "_free", "_index", "_params")

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.table = torch.zeros((0, vocab_size), dtype=torch.float32, device=device)
        self._free: list[int] = []
        self._index = IdIndex()  # request core id -> its slot, once its row is built
        self._params: dict[int, SamplingParams] = {}  # the registered requests

    def __len__(self) -> int:
        return len(self._params)

    def register(self, core_id: int, params: SamplingParams) -> None:
        """Keeps the request's params (``has_logit_bias(params)``); its row is built when a step
        first has its rows, so that a request not yet scheduled holds no V-wide row (one that ran
        keeps it until it ends, preempted or not)."""
        self._params[core_id] = params

    def release(self, core_id: int) -> None:
        """Forgets the request and frees its slot (unknown ids are ignored)."""
        if self._params.pop(core_id, None) is not None:
            slot = self._index.remove(core_id)
            if slot is not None:
                self._free.append(slot)

    def _build(self, core_id: int) -> None:
        """Builds a registered request's row in a free slot."""
        if not self._free:
            have = self.table.shape[0]
            new = max(2 * have, 8)
            self.table = torch.cat([self.table, self.table.new_zeros((new - have, self.vocab_size))])
            self._free = list(range(new - 1, have - 1, -1))
        params = self._params[core_id]
        slot = self._free.pop()
        row = self.table[slot]
        row.zero_()
        if params.allowed_token_ids is not None:
            row.fill_(float("-inf"))
            row[torch.tensor(params.allowed_token_ids, dtype=torch.int64, device=self.device)] = 0.0
        if params.logit_bias:
            ids = torch.tensor(list(params.logit_bias), dtype=torch.int64, device=self.device)
            values = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32, device=self.device)
            row.index_add_(0, ids, values)
        self._index.add(core_id, slot)

    def inputs(self, out: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's biased logits rows (``out.bias_rows``) and their bias rows ``[S, V]``."""
        rows = out.bias_rows
        req = out.row_req_ids[rows]
        slots = self._index.lookup(req)
        if (slots < 0).any():  # first rows of a request: its row is built now
            for core_id in np.unique(req[slots < 0]).tolist():
                if core_id in self._params:
                    self._build(core_id)
            slots = self._index.lookup(req)
        known = slots >= 0
        if known.all():
            bias = self.table.index_select(0, torch.from_numpy(slots).to(self.device))
        else:  # a request released meanwhile: its row (dead this step) gets no bias
            bias = torch.zeros((len(rows), self.vocab_size), dtype=torch.float32, device=self.device)
            if known.any():
                keep = torch.from_numpy(np.flatnonzero(known)).to(self.device)
                bias.index_copy_(0, keep, self.table.index_select(0, torch.from_numpy(slots[known]).to(self.device)))
        return torch.from_numpy(rows.astype(np.int64)).to(self.device), bias
