"""Per-token logit rules of a request: ``logit_bias``, ``allowed_token_ids`` and ``bad_words``.

``bad_words`` become token-id sequences here (``bad_words_token_ids``, as vLLM encodes them) and
are banned by the core: each step it hands out the last token of every word whose other tokens
end a row's output, with the ``min_tokens`` bans (``SchedulerOutput.banned_*``).

``logit_bias`` and ``allowed_token_ids`` are static: one additive row per request (``-inf``
outside the allowed ids, then the biases added), kept by ``LogitBiasState`` in a ``[rows, V]``
tensor indexed by the scheduler's batch row, like the penalty statistics. The core lists the
logits rows of such requests each step (``bias_rows``); a row whose batch row holds another
sequence (it joined or moved) is rebuilt from the request's parameters, the others are used as
they are. So it is a cache the core's output validates, never a mirror that can drift.

Invariants: a bias row is used only when its owner is the step's sequence; a fork-to-be (batch
row -1) gets a scratch row after the batch rows. The bias never touches logprobs, which are the
raw model's (vLLM's default).
Costs per step: nothing when no row has a bias; else O(S * V) for the S biased rows (gather, add),
plus O(|bias| + |allowed|) once when a sequence joins or moves rows.
Memory: (highest biased batch row + 1) * V * 4 bytes, grown on demand.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ferrokv.sampling_params import SamplingParams

__all__ = ["LogitBiasState", "bad_words_token_ids", "check_token_rules", "has_logit_bias"]


def has_logit_bias(params: SamplingParams) -> bool:
    """The request has a static bias row (``logit_bias`` or ``allowed_token_ids``)."""
    return bool(params.logit_bias) or params.allowed_token_ids is not None


def check_token_rules(params: SamplingParams, vocab_size: int) -> None:
    """Token ids of ``logit_bias`` and ``allowed_token_ids`` must be in the vocabulary."""
    for name, ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ())):
        bad = sorted({t for t in ids if t >= vocab_size})
        if bad:
            raise ValueError(f"{name} has token ids out of the vocabulary (size {vocab_size}): {bad[:8]}")


def bad_words_token_ids(tokenizer: Any, words: list[str], vocab_size: int) -> list[list[int]]:
    """Each word's token ids, as vLLM encodes them: the word with its leading spaces stripped,
    and again after one space when that gives a different first token and the same length."""
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
    return out


class LogitBiasState:
    """The biased rows' additive logit rows, by batch row (see the module docs)."""

    __slots__ = ("vocab_size", "device", "bias", "owner")

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.bias = torch.zeros((0, vocab_size), dtype=torch.float32, device=device)
        self.owner = np.zeros(0, dtype=np.int64)  # seq id whose bias a row holds (-1: none)

    def _grow(self, rows: int) -> None:
        have = len(self.owner)
        if rows <= have:
            return
        new = max(rows, 2 * have, 8)
        self.bias = torch.cat([self.bias, self.bias.new_zeros((new - have, self.vocab_size))])
        self.owner = np.concatenate([self.owner, np.full(new - have, -1, dtype=np.int64)])

    def inputs(self, out: Any, params_of: Callable[[int], SamplingParams | None]) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's biased logits rows and their bias rows ``[S, V]``; ``params_of(logits
        row)`` is read only for rows that are stale (joined, moved or forked)."""
        rows = out.bias_rows
        brow = out.row_batch_rows[rows].astype(np.int64)
        seqs = out.row_seq_ids[rows]
        slots = brow.copy()
        scratch = slots < 0
        if scratch.any():
            slots[scratch] = int(brow.max(initial=-1)) + 1 + np.arange(int(scratch.sum()))
        self._grow(int(slots.max()) + 1)
        stale = scratch | (self.owner[slots] != seqs)
        for j in np.flatnonzero(stale).tolist():
            self._rebuild(int(slots[j]), params_of(int(rows[j])))
            self.owner[slots[j]] = -1 if scratch[j] else seqs[j]
        idx = torch.from_numpy(slots).to(self.device)
        return torch.from_numpy(rows.astype(np.int64)).to(self.device), self.bias.index_select(0, idx)

    def _rebuild(self, slot: int, params: SamplingParams | None) -> None:
        row = self.bias[slot]
        row.zero_()
        if params is None:
            return  # ended meanwhile: its token is dropped
        if params.allowed_token_ids is not None:
            row.fill_(float("-inf"))
            row[torch.tensor(params.allowed_token_ids, dtype=torch.int64, device=self.device)] = 0.0
        if params.logit_bias:
            ids = torch.tensor(list(params.logit_bias), dtype=torch.int64, device=self.device)
            row.index_add_(0, ids, torch.tensor(list(params.logit_bias.values()), dtype=torch.float32, device=self.device))
