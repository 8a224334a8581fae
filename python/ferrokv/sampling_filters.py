"""The sampler's truncation and draw over probability rows ``[R, V]`` (``ferrokv.sampler`` runs
them in vLLM's order): min-p, top-k (ties with the k-th value kept), top-k + top-p inside each
row's 512 most likely tokens with the rows those may not resolve sampled again from a full sort
once known (``_NucleusRedo``), and the two-level inverse-CDF draw.

Invariants: every function is row-local and no path choice depends on other rows (batch
invariance); masking sets probabilities to 0 and nothing renormalises (the draw takes
unnormalised weights); a token whose probability is 0 is never drawn.
Costs: O(R*V) elementwise; ``topk(512)`` for top-p rows, a full sort only for unsure rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["_TOP_P_CANDIDATES", "_NucleusRedo", "_apply_min_p", "_apply_top_k", "_apply_top_k_top_p",
           "_full_nucleus", "_inverse_cdf_sample", "_row_total", "_top_k_or_all"]

# Rows with top-p first look for their nucleus among this many most likely tokens (one topk), and
# only fall back to a full sort when it is not provably inside. Constant, so a row's path never
# depends on the batch.
_TOP_P_CANDIDATES = 512
# Token block size of the two-level inverse-CDF sampler (see _inverse_cdf_sample).
_BLOCK = 256


def _apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return probs.masked_fill(probs < threshold, 0.0)


def _apply_top_k(probs: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Top-k alone: the k-th largest value is a per-row threshold; topk(max_k), no full sort.

    The gathered threshold is an exact copy of an input value, so the result does not depend on
    ``max_top_k`` (i.e. on the other rows). Ties with the k-th value are all kept.
    """
    V = probs.shape[-1]
    k = top_k.clamp(max=max_top_k)
    kth = probs.topk(max_top_k, dim=-1).values.gather(1, (k - 1).unsqueeze(1))
    kth = kth.masked_fill((top_k >= V).unsqueeze(1), 0.0)  # disabled rows: keep everything
    return probs.masked_fill(probs < kth, 0.0)


def _nucleus(
    vals: torch.Tensor, k: torch.Tensor, p: torch.Tensor, mass_if_no_k: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k then top-p over ``vals`` sorted descending (``[r, C]``); returns (kept vals, cum).

    Top-k keeps every token tied with the k-th value (as top-k alone and vLLM do). Top-p keeps a
    token iff the (top-k) mass ranked strictly above it is ``< p * mass``, which is vLLM's rule
    (drop the ascending-cumsum tail ``<= 1 - p``) without assuming mass 1, so masses removed by
    min-p / top-k are renormalised implicitly. The top token always survives.
    """
    C = vals.shape[-1]
    k_in = k <= C
    kth = vals.gather(1, (k.clamp(max=C) - 1).unsqueeze(1))
    kth = kth.masked_fill(~k_in.unsqueeze(1), 0.0)
    vals = vals.masked_fill(vals < kth, 0.0)
    cum = vals.cumsum(dim=-1)
    # What top-k kept, its ties included; the masked tail adds zeros, so a longer scan (the full
    # sort's) gives the same sum (batch invariance).
    mass = cum[:, -1]
    if mass_if_no_k is not None:
        mass = torch.where(k_in, mass, mass_if_no_k)
    keep = (cum - vals) < (p * mass).unsqueeze(1)
    keep |= (p >= 1.0).unsqueeze(1)  # top-k only: rounding must not drop tiny tail members
    return vals * keep, cum


def _apply_top_k_top_p(
    probs: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k + top-p inside each row's ``_TOP_P_CANDIDATES`` most likely tokens (one topk, no
    sort); returns (filtered probs, unsure rows).

    A row is exact when its candidates provably contain its whole nucleus (its top-k fits there,
    ties with the k-th value included, or their mass already reaches ``p``). The others (``unsure``, a bool per row) need
    ``_full_nucleus``; finding them needs the host, so the sampler does that after the step's one
    synchronisation (``_NucleusRedo``). Each choice depends on the row alone (batch invariance).
    """
    R, V = probs.shape
    C = min(V, _TOP_P_CANDIDATES)
    k = _top_k_or_all(top_k, R, V, probs.device)
    total = _row_total(probs)
    vals, idx = probs.topk(C, dim=-1)
    kept, cum = _nucleus(vals, k, top_p, total)
    k_disabled = k >= V
    passthrough = k_disabled & (top_p >= 1.0)
    # A top-k row is resolved unless its ties with the k-th value may go on past the candidates.
    kth = vals.gather(1, (k.clamp(max=C) - 1).unsqueeze(1)).squeeze(1)
    ties_past = (vals[:, -1] >= kth) & (kth > 0) if C < V else torch.zeros_like(k_disabled)
    resolved = ((k <= C) & ~ties_past) | (k_disabled & (cum[:, -1] >= top_p * total)) | passthrough
    out = torch.zeros_like(probs).scatter_(1, idx, kept)
    return torch.where(passthrough.unsqueeze(1), probs, out), ~resolved


def _top_k_or_all(top_k: torch.Tensor | None, rows: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    return top_k if top_k is not None else torch.full((rows,), vocab_size, dtype=torch.int64, device=device)


def _full_nucleus(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k + top-p of ``probs`` ``[r, V]`` by a full sort (the rows the candidates miss)."""
    vals, idx = probs.sort(dim=-1, descending=True)
    kept, _ = _nucleus(vals, top_k, top_p, None)
    return torch.zeros_like(probs).scatter_(1, idx, kept)


@dataclass(slots=True)
class _NucleusRedo:
    """What sampling a step's unsure top-p rows again takes, once the host knows which they are
    (``SampledTokens.result()``, after the step's one synchronisation; only rows with a nucleus
    wider than the candidates, a flat distribution, pay a sort). Their uniforms are the ones
    drawn, so the token is the one an exact filter would have given."""

    probs: torch.Tensor  # float32 [R, V], before top-k / top-p
    top_k: torch.Tensor | None  # int64 [R]
    top_p: torch.Tensor  # float32 [R]
    uniforms: torch.Tensor  # float64 [R]
    unsure: torch.Tensor  # bool [R]: rows the candidates may not resolve

    def patch(self, token_ids: torch.Tensor) -> None:
        """Writes the unsure rows' exact tokens into ``token_ids`` (int64 [R], on the device)."""
        rows = np.flatnonzero(self.unsure.cpu().numpy())  # waits for the step's work
        if len(rows) == 0:
            return
        r = torch.from_numpy(rows).to(self.probs.device)
        k = _top_k_or_all(self.top_k, *self.probs.shape, self.probs.device)
        kept = _full_nucleus(self.probs.index_select(0, r), k.index_select(0, r), self.top_p.index_select(0, r))
        token_ids.index_copy_(0, r, _inverse_cdf_sample(kept, self.uniforms.index_select(0, r)))


def _blocks(probs: torch.Tensor) -> torch.Tensor:
    """``probs`` as ``[R, nb, _BLOCK]`` (zero-padded when V is not a multiple of the block)."""
    R, V = probs.shape
    nb = -(-V // _BLOCK)
    if nb * _BLOCK != V:
        probs = torch.nn.functional.pad(probs, (0, nb * _BLOCK - V))
    return probs.view(R, nb, _BLOCK)


def _row_total(probs: torch.Tensor) -> torch.Tensor:
    """Per-row sum, float32 result. Not ``probs.sum(-1)``: with one row and V > 32768, torch
    splits that reduction across threads, changing its rounding -- and a seeded row's top-p
    decision would then depend on the batch size. Block sums then a short serial sum do not."""
    return _blocks(probs).sum(dim=-1, dtype=torch.float64).sum(dim=-1).to(probs.dtype)


def _inverse_cdf_sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Samples token i with probability ``probs[i] / sum(probs)`` per row (probs need not sum
    to 1), by inverse CDF in two levels: pick a block of ``_BLOCK`` tokens, then a token in it.

    Sums are accumulated in float64, and the float32 partial sums never mix a block's tokens with
    other blocks', so tiny tail probabilities are not absorbed by rounding (a flat float32 cumsum
    over 150k tokens would lose ~1e-3 of the mass). Zero-probability tokens are never returned.
    """
    R = probs.shape[0]
    blocks = _blocks(probs)
    block_cdf = blocks.sum(dim=-1, dtype=torch.float64).cumsum(dim=-1)
    target = u.unsqueeze(1) * block_cdf[:, -1:]
    b = torch.searchsorted(block_cdf, target, right=True)
    # u * total can round up to total: fall back to the last block with mass.
    b = torch.minimum(b, (block_cdf < block_cdf[:, -1:]).sum(dim=-1, keepdim=True))
    prev = torch.where(b > 0, block_cdf.gather(1, (b - 1).clamp(min=0)), 0.0)
    inner = blocks.gather(1, b.unsqueeze(2).expand(R, 1, _BLOCK)).squeeze(1)
    inner_cdf = inner.cumsum(dim=-1, dtype=torch.float64)
    j = torch.searchsorted(inner_cdf, target - prev, right=True)
    j = torch.minimum(j, (inner_cdf < inner_cdf[:, -1:]).sum(dim=-1, keepdim=True))
    return (b * _BLOCK + j).squeeze(1)
