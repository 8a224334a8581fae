"""Prompt logprobs (``SamplingParams.prompt_logprobs``): each prompt token's logprob given the
tokens before it, with its rank and the ``k`` most likely alternatives, as vLLM reports them
(``RequestOutput.prompt_logprobs``: one entry per prompt token, ``None`` for the first).

A request that asks for them is never served from the prefix cache (the core's
``skip_cache_hits``), so every prompt position is computed, chunk by chunk. Per step,
``plan`` lists the token indices of such requests' prompt positions not reported yet (a chunk's
last position may be the sampling position, which predicts no prompt token); the model runner
computes their logits after the sampling rows' (``ModelRunner.prepare(prompt_indices=)``), and
``compute`` turns them into logprobs in the step job. ``PromptLogprobsPlan.apply`` appends the
entries once the step's ``update()`` ran, so a cancelled step adds nothing, and a preempted
request recomputing its prompt adds nothing twice (positions below the request's count are
skipped).

Invariants: ``req.prompt_logprobs`` holds ``1 + reported positions`` entries, in order.
Costs per step: one ``np.isin`` when some request wants them (nothing otherwise); O(P * V) for
the P positions (one ``log_softmax``), O(P * k) Python to build the entries.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ferrokv.id_index import IdIndex
from ferrokv.outputs import make_logprobs_entry

__all__ = ["PromptLogprobRequests", "PromptLogprobsPlan", "compute", "plan"]


@dataclass(slots=True)
class PromptLogprobsPlan:
    """One step's prompt positions to report."""

    token_indices: np.ndarray  # int64 [P]: indices into the step's tokens
    targets: torch.Tensor  # int64 [P]: the prompt token each position predicts
    num_top: int  # the largest k asked for
    spans: list[tuple[Any, int, int, int]]  # (request state, first entry index, count, its k)

    def apply(self, result: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
              decode: Callable[[int], str]) -> None:
        """Appends the entries of ``compute``'s result to their requests."""
        tok_lp, ranks, top_ids, top_lp = result
        targets = self.targets.tolist()
        j = 0
        for req, first, count, k in self.spans:
            entries = req.prompt_logprobs
            if entries is None or len(entries) != first:
                j += count  # ended, or reported by an earlier step
                continue
            dec = decode if req.params.detokenize else None
            for i in range(j, j + count):
                entries.append(make_logprobs_entry(targets[i], float(tok_lp[i]), int(ranks[i]),
                                                   top_ids[i, :k], top_lp[i, :k], decode=dec))
            j += count


def plan(out: Any, requests: dict[int, Any], wanted: PromptLogprobRequests) -> PromptLogprobsPlan | None:
    """The positions of step ``out`` that requests ``wanted`` (those that still have prompt
    positions to report) compute; None when there are none."""
    seqs = np.flatnonzero(wanted.wanted(out.req_ids))
    if not len(seqs):
        return None
    qsl, positions = out.query_start_loc, out.positions
    indices: list[np.ndarray] = []
    targets: list[int] = []
    spans: list[tuple[Any, int, int, int]] = []
    top = 0
    for i in seqs.tolist():
        req = requests.get(int(out.req_ids[i]))
        if req is None or req.prompt_logprobs is None:
            continue
        start, end = int(qsl[i]), int(qsl[i + 1])
        pos = positions[start:end].astype(np.int64)
        n_prompt = len(req.prompt_token_ids)
        first = len(req.prompt_logprobs)  # entry k is prompt token k, predicted at position k - 1
        keep = (pos >= first - 1) & (pos < n_prompt - 1)
        if not keep.any():
            continue
        idx = start + np.flatnonzero(keep)
        p = pos[keep]
        if p[0] != first - 1 or (np.diff(p) != 1).any():
            continue  # not contiguous with what was reported: never expected, skipped safely
        indices.append(idx)
        targets += [req.prompt_token_ids[q + 1] for q in p.tolist()]
        k = int(req.params.prompt_logprobs)
        if k < 0:  # -1: the whole vocabulary (compute caps it at the logits' width)
            k = 1 << 62
        spans.append((req, first, len(idx), k))
        top = max(top, k)
    if not indices:
        return None
    return PromptLogprobsPlan(np.concatenate(indices).astype(np.int64), torch.tensor(targets, dtype=torch.int64),
                              top, spans)


def compute(logits: torch.Tensor, p: PromptLogprobsPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each position's target logprob, its rank (1 = most likely) and the ``num_top`` most
    likely tokens with their logprobs, on the host (``logits``: ``[P, V]``, the positions')."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    targets = p.targets.to(lp.device)
    tok_lp = lp.gather(1, targets.unsqueeze(1))
    ranks = (lp >= tok_lp).sum(dim=1)  # vLLM's: the tokens at least as likely, itself included
    k = min(p.num_top, lp.shape[1])
    top_lp, top_ids = lp.topk(k, dim=1) if k > 0 else (lp[:, :0], torch.zeros_like(lp[:, :0], dtype=torch.int64))
    return tok_lp.squeeze(1).cpu().numpy(), ranks.cpu().numpy(), top_ids.cpu().numpy(), top_lp.cpu().numpy()


class PromptLogprobRequests:
    """The requests with prompt positions still to report (``ferrokv.id_index``: adding, ending
    and a step's lookup cost nothing in the number of them, waiting ones included)."""

    __slots__ = ("_index",)

    def __init__(self) -> None:
        self._index = IdIndex()

    def __len__(self) -> int:
        return len(self._index)

    def add(self, req: Any) -> None:
        self._index.add(req.core_id, 0)

    def discard(self, core_id: int) -> None:
        self._index.remove(core_id)

    def wanted(self, req_ids: np.ndarray) -> np.ndarray:
        """Which of ``req_ids`` (a step's) still have prompt positions to report."""
        return self._index.lookup(req_ids) >= 0

    def drop_complete(self, p: PromptLogprobsPlan) -> None:
        """Forgets the requests of plan ``p`` whose every prompt position is reported now."""
        for req, *_ in p.spans:
            if len(req.prompt_logprobs) >= len(req.prompt_token_ids):
                self.discard(req.core_id)
