"""Penalty state across steps: each penalty sequence's output-token counts and seen mask.

``PenaltyState`` keeps a ``[rows, V]`` count tensor and seen mask (prompt or output) indexed by
the scheduler's batch row, with, per row, the sequence whose statistics it holds and how many of
its output tokens they count. Each step it checks the penalty rows against the scheduler's output
(``row_seq_ids``, ``row_num_output``): a row that holds another sequence (one joined, left or
moved rows) or another count (a cancelled step) is rebuilt from the core's tokens, the one home of
a sequence's tokens, unless its statistics are up to date in the row it left (then they are
copied over); the others are used as they are, and the step's sampled tokens are counted in
(``record``). So this is a cache the core's output validates, never a mirror that can drift.

Invariants: a row's statistics are used only when its (sequence, count) pair equals the step's,
and a sequence's statistics are valid in at most one row (rebuilding it elsewhere invalidates the
others, which a cancelled step may have left ahead); a fan-out child (no batch row yet) gets fresh statistics in a scratch row after the batch rows.
Costs per step: O(P * V) for the P penalty rows (gather, count-in), nothing when no row has a
penalty; a row that moved costs O(V) (a copy), a rebuild O(prompt + output) once when a sequence
joins (or its statistics are stale: a cancelled step).
Memory: (highest penalty batch row + 1) * V * 5 bytes, grown on demand.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ferrokv.sampler import PenaltyInputs

__all__ = ["PenaltyState"]


class PenaltyState:
    """The penalty rows' token statistics, by batch row (see the module docs)."""

    __slots__ = ("vocab_size", "device", "counts", "seen", "owner", "num_counted", "_last")

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.counts = torch.zeros((0, vocab_size), dtype=torch.float32, device=device)
        self.seen = torch.zeros((0, vocab_size), dtype=torch.bool, device=device)
        self.owner = np.zeros(0, dtype=np.int64)  # seq id held per row (-1: none)
        self.num_counted = np.zeros(0, dtype=np.int64)  # its output tokens counted
        # (slots as numpy, slots, logits rows) of the last inputs(), scratch rows left out.
        self._last: tuple[np.ndarray, torch.Tensor, torch.Tensor] | None = None

    def _grow(self, rows: int) -> None:
        have = len(self.owner)
        if rows <= have:
            return
        new = max(rows, 2 * have, 8)
        pad = new - have
        self.counts = torch.cat([self.counts, self.counts.new_zeros((pad, self.vocab_size))])
        self.seen = torch.cat([self.seen, self.seen.new_zeros((pad, self.vocab_size))])
        self.owner = np.concatenate([self.owner, np.full(pad, -1, dtype=np.int64)])
        self.num_counted = np.concatenate([self.num_counted, np.zeros(pad, dtype=np.int64)])

    def inputs(self, out: Any, rows: np.ndarray, prompt_of: Callable[[int], Sequence[int]],
               history_of: Callable[[int], Sequence[int]]) -> PenaltyInputs:
        """The statistics of logits rows ``rows`` of step ``out``, rebuilding stale ones
        (``prompt_of(logits row)`` and ``history_of(seq id)`` read the request and the core)."""
        brow = out.row_batch_rows[rows].astype(np.int64)
        seqs = out.row_seq_ids[rows]
        nout = out.row_num_output[rows].astype(np.int64)
        slots = brow.copy()
        scratch = slots < 0
        if scratch.any():
            slots[scratch] = int(brow.max(initial=-1)) + 1 + np.arange(int(scratch.sum()))
        self._grow(int(slots.max()) + 1)
        stale = scratch | (self.owner[slots] != seqs) | (self.num_counted[slots] != nout)
        if stale.any():
            cand = np.flatnonzero(stale & ~scratch)
            held = np.flatnonzero(np.isin(self.owner, seqs[cand]))  # rows with statistics of theirs
            moved, rebuild = self._move_rows(cand, held, slots, seqs, nout)
            # Those rows are out of date now: their statistics moved, or a cancelled step counted
            # a token there before the sequence moved.
            self.owner[held] = -1
            self.owner[slots[moved]] = seqs[moved]
            self.num_counted[slots[moved]] = nout[moved]
            for j in np.union1d(rebuild, np.flatnonzero(scratch)).tolist():
                self._rebuild(int(slots[j]), prompt_of(int(rows[j])),
                              history_of(int(seqs[j])) if nout[j] > 0 and not scratch[j] else ())
                self.owner[slots[j]] = -1 if scratch[j] else seqs[j]
                self.num_counted[slots[j]] = nout[j]
        idx = torch.from_numpy(slots).to(self.device)
        host_rows = rows.astype(np.int64)
        logit_rows = torch.from_numpy(host_rows).to(self.device)
        kept = ~scratch
        if kept.all():
            self._last = (slots, idx, logit_rows)
        else:
            keep = torch.from_numpy(kept).to(self.device)
            self._last = (slots[kept], idx[keep], logit_rows[keep])
        return PenaltyInputs(logit_rows, host_rows, self.counts.index_select(0, idx), self.seen.index_select(0, idx))

    def _move_rows(self, cand: np.ndarray, held: np.ndarray, slots: np.ndarray, seqs: np.ndarray,
                   nout: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Of the stale batch rows ``cand`` (indices into the step's penalty rows), copies in the
        statistics of each whose sequence's are up to date in another row of ``held`` (the rows
        owned by their sequences; it moved: O(V), not O(output)); returns (those copied, those to
        rebuild from the core's tokens)."""
        if not len(held):
            return cand[:0], cand
        order = np.argsort(self.owner[held], kind="stable")
        held_seqs, held_rows = self.owner[held][order], held[order]
        pos = np.minimum(np.searchsorted(held_seqs, seqs[cand]), len(held) - 1)
        src = held_rows[pos]
        ok = (held_seqs[pos] == seqs[cand]) & (self.num_counted[src] == nout[cand])
        if ok.any():
            # Gathered before written: two sequences that swapped rows read each other's.
            src_idx = torch.from_numpy(src[ok]).to(self.device)
            dst_idx = torch.from_numpy(slots[cand[ok]]).to(self.device)
            self.counts[dst_idx] = self.counts.index_select(0, src_idx)
            self.seen[dst_idx] = self.seen.index_select(0, src_idx)
        return cand[ok], cand[~ok]

    def _rebuild(self, slot: int, prompt: Sequence[int], history: Sequence[int]) -> None:
        V = self.vocab_size
        self.counts[slot].zero_()
        self.seen[slot].zero_()
        out = [t for t in history if 0 <= t < V]
        if out:
            ids = torch.tensor(out, dtype=torch.int64, device=self.device)
            self.counts[slot].index_put_((ids,), torch.ones(len(out), device=self.device), accumulate=True)
            self.seen[slot, ids] = True
        prompt = [t for t in prompt if 0 <= t < V]
        if prompt:
            self.seen[slot, torch.tensor(prompt, dtype=torch.int64, device=self.device)] = True

    def record(self, sampled: torch.Tensor) -> None:
        """Counts in the step's sampled tokens (``sampled``: one per logits row) for the rows of
        the last ``inputs``. Torch and numpy only: it may run off the engine's thread."""
        if self._last is None:
            return
        slots_np, slots, rows = self._last
        self._last = None
        if not len(slots_np):
            return
        counted = self.num_counted[slots_np] + 1
        self.num_counted[slots_np] = -1  # stale until counted in: an interrupt midway means a rebuild
        tok = sampled.index_select(0, rows).to(torch.int64)
        ok = (tok >= 0) & (tok < self.vocab_size)
        tok = tok.clamp(0, self.vocab_size - 1)
        self.counts.index_put_((slots, tok), ok.to(self.counts.dtype), accumulate=True)
        self.seen[slots, tok] |= ok
        self.num_counted[slots_np] = counted
