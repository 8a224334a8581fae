"""Vectorised token sampling over a batch of logits rows.

One call samples one token for every row of a ``[R, V]`` float logits tensor. Each row belongs to
one sequence (a request with ``n > 1`` contributes ``n`` rows, one per sample). Per-row parameters
arrive as a :class:`SamplingMetadata`, built once per step by :meth:`SamplingMetadata.build` from
per-row :class:`SamplingRow` state; building loops over rows in Python (cheap), the maths is whole-
batch tensor ops. The only per-row Python loop in :func:`sample` draws one uniform for each
*seeded* non-greedy row from that row's own generator.

Pipeline, in vLLM V1's order (each stage is skipped when no row needs it):

1. logprobs (only rows that asked): ``log_softmax`` of the **raw model logits**, before any
   penalty / temperature / truncation -- vLLM V1's default ("raw_logprobs"), so the numbers are
   the model's own beliefs and do not depend on sampling knobs.
2. ``min_tokens``: while a row has fewer than ``min_tokens`` outputs, its stop token ids and (unless
   ``ignore_eos``) the EOS ids are set to ``-inf``.
3. penalties: repetition (HF semantics, over prompt + output tokens: ``logit > 0 -> logit / p``,
   else ``logit * p``), then ``frequency * count`` and ``presence * (count > 0)`` subtracted, with
   counts over output tokens only.
4. greedy rows: ``argmax`` (exact ties -> lowest index, as ``torch.argmax``).
5. random rows: ``softmax(logits / temperature)``; then, on probabilities (masking = set to 0,
   the sampler takes unnormalised weights so no renormalising softmax is needed): min-p (drop
   ``p < min_p * p_max``) on the full distribution; top-k (ties at the k-th value are all kept);
   top-p over what top-k left, relative to its mass (the most likely token always survives);
   then inverse-CDF sampling with one ``U[0,1)`` per row, accumulated in float64 in two levels
   (256-token blocks, then a token), so even tiny tail probabilities are honoured. Seeded rows
   draw their uniform from their own ``torch.Generator`` (exactly one draw per step), so their
   token depends only on their own logits row and generator, never on which other rows share the
   batch; unseeded rows share one generator (the sampler's, else torch's global one), which must be
   on the logits' device.

Invariants: the input ``logits`` tensor is never modified; output ids are ``int32`` numpy, one per
row; a token whose processed probability is 0 is never sampled. Devices: the metadata tensors and
the shared generator are on the logits' device (checked: ``DeviceMismatchError`` names both
devices otherwise); seeded rows' generators may be anywhere (their one draw is moved over). Batch invariance of seeded rows is
exact on CPU (every step is row-local and no path choice depends on other rows); on GPU it holds up
to float rounding of row reductions.

Costs per step, R rows, V vocab: O(R*V) elementwise work (softmax, one pass of block sums) and a
single random number per row; + ``topk(max_k)`` for top-k alone; + ``topk(512)`` when some row has
top-p, and a full sort only for rows whose nucleus is not inside their 512 most likely tokens;
+ O(total history length) to build penalty counts, only when a row has penalties; + one
``[L, V]`` log_softmax for the L rows that want logprobs. No Python loop per row except one tiny
draw per seeded random row.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ferrokv.checks import check_same_device
from ferrokv.sampling_params import GREEDY_EPS, SamplingParams

__all__ = [
    "LogprobsResult",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingRow",
    "compute_logprobs",
    "make_generator",
    "sample",
    "seed_for_sample",
]

_NEG_INF = float("-inf")
# Rows with top-p first look for their nucleus among this many most likely tokens (one topk), and
# only fall back to a full sort when it is not provably inside. Constant, so a row's path never
# depends on the batch.
_TOP_P_CANDIDATES = 512
# Token block size of the two-level inverse-CDF sampler (see _inverse_cdf_sample).
_BLOCK = 256


def seed_for_sample(seed: int, sample_index: int = 0) -> int:
    """Derives the 63-bit generator seed of sample ``sample_index`` of a request seeded ``seed``.

    A hash (rather than ``seed + index``) keeps sample 1 of seed 0 from replaying sample 0 of
    seed 1; index 0 goes through the same hash so ``n=1`` and sample 0 of ``n=2`` agree.
    """
    digest = hashlib.blake2b(f"{seed}:{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


def make_generator(
    seed: int, sample_index: int = 0, device: torch.device | str = "cpu"
) -> torch.Generator:
    """Creates the per-sequence generator for a seeded request; create once, reuse every step.

    Keep it on the CPU (the default) even when logits live on a GPU: the sampler draws one number
    per step from it and moves that, so seeded outputs do not depend on the device's RNG.
    """
    gen = torch.Generator(device=device)
    gen.manual_seed(seed_for_sample(seed, sample_index))
    return gen


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """``log_softmax`` over the last dim, in float32 (for beam search and logprob reporting)."""
    return torch.log_softmax(logits.float(), dim=-1)


@dataclass(slots=True)
class SamplingRow:
    """The per-step state of one sequence that the sampler needs.

    ``generator`` must be the sequence's own long-lived generator when ``params.seed`` is set
    (see :func:`make_generator`); it is advanced by every non-greedy draw. ``prompt_token_ids`` is
    only read when the row has a repetition penalty.
    """

    params: SamplingParams
    output_token_ids: Sequence[int] = ()
    prompt_token_ids: Sequence[int] = ()
    generator: torch.Generator | None = None
    # Tokens generated so far (min_tokens); None: len(output_token_ids). The engine passes the
    # count and reads the history from the core only for rows with penalties.
    num_output_tokens: int | None = None


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row sampling parameters of one step, as batch tensors (``None`` = no row uses it)."""

    num_rows: int
    all_greedy: bool
    all_random: bool
    greedy: torch.Tensor  # bool [R]
    temperature: torch.Tensor | None  # float32 [R]; 1.0 on greedy rows so division is harmless
    top_k: torch.Tensor | None  # int64 [R]; V where disabled
    max_top_k: int  # largest enabled top_k (0 if none); a Python int so no device sync is needed
    top_p: torch.Tensor | None  # float32 [R]
    min_p: torch.Tensor | None  # float32 [R]
    # Penalties: None unless some row has a non-neutral one.
    presence_penalty: torch.Tensor | None  # float32 [R, 1]
    frequency_penalty: torch.Tensor | None  # float32 [R, 1]
    repetition_penalty: torch.Tensor | None  # float32 [R, 1]
    output_counts: torch.Tensor | None  # float32 [R, V]: occurrences in the output so far
    seen_mask: torch.Tensor | None  # bool [R, V]: token in prompt or output (repetition penalty)
    # min_tokens: (row, token) pairs to set to -inf.
    banned_rows: torch.Tensor | None  # int64 [B]
    banned_tokens: torch.Tensor | None  # int64 [B]
    # Seeded non-greedy rows and their generators (parallel lists).
    seeded_rows: list[int]
    generators: list[torch.Generator]
    # Logprobs: rows that asked and how many top alternatives each wants.
    logprob_rows: torch.Tensor | None  # int64 [L]
    num_top_logprobs: np.ndarray | None  # int32 [L]

    @classmethod
    def build(
        cls,
        rows: Sequence[SamplingRow],
        vocab_size: int,
        eos_token_ids: Sequence[int] = (),
        device: torch.device | str = "cpu",
    ) -> SamplingMetadata:
        """Builds the batch tensors for ``rows`` (Python loop over rows; no per-token loops).

        ``eos_token_ids`` are the model's EOS ids, masked during ``min_tokens`` unless the row sets
        ``ignore_eos``. Token ids ``>= vocab_size`` in histories or stop ids are ignored.
        """
        R, V = len(rows), vocab_size
        params = [r.params for r in rows]
        greedy_l = [p.is_greedy for p in params]
        all_greedy = all(greedy_l)
        all_random = not any(greedy_l)
        greedy = torch.tensor(greedy_l, dtype=torch.bool, device=device)

        temperature = top_k = top_p = min_p = None
        max_top_k = 0
        seeded_rows: list[int] = []
        generators: list[torch.Generator] = []
        if not all_greedy:
            temperature = torch.tensor(
                [1.0 if g else p.temperature for p, g in zip(params, greedy_l)],
                dtype=torch.float32,
                device=device,
            )
            # k >= V keeps everything, so it counts as disabled.
            max_top_k = max((p.top_k for p in params if 0 < p.top_k < V), default=0)
            if max_top_k > 0:
                top_k = torch.tensor(
                    [p.top_k if 0 < p.top_k < V else V for p in params],
                    dtype=torch.int64,
                    device=device,
                )
            if any(p.top_p < 1.0 for p in params):
                top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
            if any(p.min_p > 0.0 for p in params):
                min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
            for i, (row, g) in enumerate(zip(rows, greedy_l)):
                if not g and row.params.seed is not None:
                    if row.generator is None:
                        raise ValueError(
                            f"row {i} has seed={row.params.seed} but no generator; create one "
                            "per sequence with make_generator() and keep it across steps"
                        )
                    seeded_rows.append(i)
                    generators.append(row.generator)

        # --- penalties ----------------------------------------------------------------------
        presence = frequency = repetition = output_counts = seen_mask = None
        pen_rows = [i for i, p in enumerate(params) if p.has_penalties]
        if pen_rows:
            def col(name: str) -> torch.Tensor:
                return torch.tensor(
                    [getattr(p, name) for p in params], dtype=torch.float32, device=device
                ).unsqueeze(1)

            if any(params[i].presence_penalty != 0 or params[i].frequency_penalty != 0
                   for i in pen_rows):
                presence, frequency = col("presence_penalty"), col("frequency_penalty")
                output_counts = torch.zeros((R, V), dtype=torch.float32, device=device)
                r_idx, t_idx = _flatten_histories(
                    [(i, rows[i].output_token_ids) for i in pen_rows], V, device
                )
                output_counts.index_put_(
                    (r_idx, t_idx),
                    torch.ones(t_idx.numel(), dtype=torch.float32, device=device),
                    accumulate=True,
                )
            rep_rows = [i for i in pen_rows if params[i].repetition_penalty != 1.0]
            if rep_rows:
                repetition = col("repetition_penalty")
                seen_mask = torch.zeros((R, V), dtype=torch.bool, device=device)
                r_idx, t_idx = _flatten_histories(
                    [(i, rows[i].prompt_token_ids) for i in rep_rows]
                    + [(i, rows[i].output_token_ids) for i in rep_rows],
                    V,
                    device,
                )
                seen_mask[r_idx, t_idx] = True

        # --- min_tokens -----------------------------------------------------------------------
        banned_rows = banned_tokens = None
        b_rows: list[int] = []
        b_toks: list[int] = []
        for i, (row, p) in enumerate(zip(rows, params)):
            n_out = len(row.output_token_ids) if row.num_output_tokens is None else row.num_output_tokens
            if n_out < p.min_tokens:
                stop_ids = set(p.stop_token_ids)
                if not p.ignore_eos:
                    stop_ids.update(eos_token_ids)
                for t in stop_ids:
                    if 0 <= t < V:
                        b_rows.append(i)
                        b_toks.append(t)
        if b_rows:
            banned_rows = torch.tensor(b_rows, dtype=torch.int64, device=device)
            banned_tokens = torch.tensor(b_toks, dtype=torch.int64, device=device)

        # --- logprobs -------------------------------------------------------------------------
        logprob_rows = num_top = None
        lp = [(i, p.logprobs) for i, p in enumerate(params) if p.logprobs is not None]
        if lp:
            logprob_rows = torch.tensor([i for i, _ in lp], dtype=torch.int64, device=device)
            num_top = np.array([min(k, V) for _, k in lp], dtype=np.int32)

        return cls(
            num_rows=R,
            all_greedy=all_greedy,
            all_random=all_random,
            greedy=greedy,
            temperature=temperature,
            top_k=top_k,
            max_top_k=max_top_k,
            top_p=top_p,
            min_p=min_p,
            presence_penalty=presence,
            frequency_penalty=frequency,
            repetition_penalty=repetition,
            output_counts=output_counts,
            seen_mask=seen_mask,
            banned_rows=banned_rows,
            banned_tokens=banned_tokens,
            seeded_rows=seeded_rows,
            generators=generators,
            logprob_rows=logprob_rows,
            num_top_logprobs=num_top,
        )


def _flatten_histories(
    histories: list[tuple[int, Sequence[int]]], vocab_size: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) index tensors for scatter, from per-row token lists; drops ids outside V."""
    lengths = [len(toks) for _, toks in histories]
    rows = torch.repeat_interleave(
        torch.tensor([i for i, _ in histories], dtype=torch.int64),
        torch.tensor(lengths, dtype=torch.int64),
    )
    # One C-level conversion of the concatenated ids rather than one tensor per row.
    toks = torch.tensor(
        list(itertools.chain.from_iterable(toks for _, toks in histories)), dtype=torch.int64
    )
    keep = (toks >= 0) & (toks < vocab_size)
    return rows[keep].to(device), toks[keep].to(device)


@dataclass(slots=True)
class LogprobsResult:
    """Logprobs of the rows that asked for them (row ``rows[j]`` of the batch is entry ``j``).

    ``top_ids[j, :num_top[j]]`` / ``top_logprobs[j, :num_top[j]]`` are the row's most likely
    tokens in decreasing order; columns past ``num_top[j]`` are padding. ``sampled_ranks`` is 1 for
    the most likely token (``1 + #tokens with a strictly larger logprob``).
    """

    rows: np.ndarray  # int64 [L]
    sampled_logprobs: np.ndarray  # float32 [L]
    sampled_ranks: np.ndarray  # int64 [L]
    top_ids: np.ndarray  # int32 [L, K]
    top_logprobs: np.ndarray  # float32 [L, K]
    num_top: np.ndarray  # int32 [L]


@dataclass(slots=True)
class SamplerOutput:
    """``token_ids[r]`` is the token sampled for batch row ``r``."""

    token_ids: np.ndarray  # int32 [R]
    logprobs: LogprobsResult | None = None


def _apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    if md.seen_mask is not None:
        assert md.repetition_penalty is not None
        p = md.repetition_penalty
        penalized = torch.where(logits > 0, logits / p, logits * p)
        logits = torch.where(md.seen_mask, penalized, logits)
    if md.output_counts is not None:
        assert md.frequency_penalty is not None and md.presence_penalty is not None
        logits = (
            logits
            - md.frequency_penalty * md.output_counts
            - md.presence_penalty * (md.output_counts > 0).to(logits.dtype)
        )
    return logits


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

    Top-p keeps a token iff the (top-k) mass ranked strictly above it is ``< p * mass``, which is
    vLLM's rule (drop the ascending-cumsum tail ``<= 1 - p``) without assuming mass 1, so masses
    removed by min-p / top-k are renormalised implicitly. The top token always survives.
    """
    C = vals.shape[-1]
    k_in = k <= C
    kth = vals.gather(1, (k.clamp(max=C) - 1).unsqueeze(1))
    kth = kth.masked_fill(~k_in.unsqueeze(1), 0.0)
    vals = vals.masked_fill(vals < kth, 0.0)
    cum = vals.cumsum(dim=-1)
    # cumsum is a sequential scan, so cum[k-1] does not depend on C (batch invariance).
    mass = cum.gather(1, (k.clamp(max=C) - 1).unsqueeze(1)).squeeze(1)
    if mass_if_no_k is not None:
        mass = torch.where(k_in, mass, mass_if_no_k)
    keep = (cum - vals) < (p * mass).unsqueeze(1)
    keep |= (p >= 1.0).unsqueeze(1)  # top-k only: rounding must not drop tiny tail members
    return vals * keep, cum


def _apply_top_k_top_p(
    probs: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor
) -> torch.Tensor:
    """Top-k + top-p, exact, usually without a full-vocabulary sort.

    A row is resolved inside its ``_TOP_P_CANDIDATES`` most likely tokens when that provably
    contains its whole nucleus (its top-k fits there, or the candidates' mass already reaches
    ``p``); only the other rows pay a full sort. The choice depends on the row alone, so a row's
    result does not depend on the batch.
    """
    R, V = probs.shape
    C = min(V, _TOP_P_CANDIDATES)
    k = top_k if top_k is not None else torch.full((R,), V, dtype=torch.int64, device=probs.device)
    total = _row_total(probs)
    vals, idx = probs.topk(C, dim=-1)
    kept, cum = _nucleus(vals, k, top_p, total)
    k_disabled = k >= V
    passthrough = k_disabled & (top_p >= 1.0)
    resolved = (k <= C) | (k_disabled & (cum[:, -1] >= top_p * total)) | passthrough
    out = torch.zeros_like(probs).scatter_(1, idx, kept)
    out = torch.where(passthrough.unsqueeze(1), probs, out)
    if not bool(resolved.all()):
        rows = (~resolved).nonzero().squeeze(1)
        sub = probs.index_select(0, rows)
        svals, sidx = sub.sort(dim=-1, descending=True)
        skept, _ = _nucleus(svals, k.index_select(0, rows), top_p.index_select(0, rows), None)
        out.index_copy_(0, rows, torch.zeros_like(sub).scatter_(1, sidx, skept))
    return out


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


def _draw_uniforms(
    n: int, md: SamplingMetadata, generator: torch.Generator | None, device: torch.device
) -> torch.Tensor:
    """One U[0,1) per row (float64); seeded rows draw theirs from their own generator."""
    if generator is not None:
        check_same_device("the sampler's generator", generator.device, "the logits tensor", device)
    u = torch.rand(n, dtype=torch.float64, device=device, generator=generator)
    if md.seeded_rows:
        # Exactly one draw per step from each seeded generator, so its stream -- and the token --
        # depend only on the sequence itself, not on the rest of the batch. Drawn on the
        # generator's own device (CPU by default), so a seed gives the same stream on any device.
        own = torch.cat(
            [torch.rand(1, dtype=torch.float64, device=g.device, generator=g)
             for g in md.generators]
        ).to(device)
        u.index_copy_(0, torch.tensor(md.seeded_rows, dtype=torch.int64, device=device), own)
    return u


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


def _logprobs(
    logits: torch.Tensor, md: SamplingMetadata, sampled: torch.Tensor
) -> LogprobsResult:
    assert md.logprob_rows is not None and md.num_top_logprobs is not None
    rows = md.logprob_rows
    lp = compute_logprobs(logits.index_select(0, rows))
    tok = sampled.index_select(0, rows).to(torch.int64).unsqueeze(1)
    tok_lp = lp.gather(1, tok)
    ranks = (lp > tok_lp).sum(dim=-1) + 1
    k = int(md.num_top_logprobs.max())
    if k > 0:
        top_lp, top_ids = lp.topk(k, dim=-1)
    else:
        top_lp = lp.new_empty((lp.shape[0], 0))
        top_ids = torch.empty((lp.shape[0], 0), dtype=torch.int64, device=lp.device)
    return LogprobsResult(
        rows=rows.cpu().numpy(),
        sampled_logprobs=tok_lp.squeeze(1).cpu().numpy(),
        sampled_ranks=ranks.cpu().numpy(),
        top_ids=top_ids.to(torch.int32).cpu().numpy(),
        top_logprobs=top_lp.cpu().numpy(),
        num_top=md.num_top_logprobs,
    )


def sample(
    logits: torch.Tensor,
    metadata: SamplingMetadata,
    generator: torch.Generator | None = None,
) -> SamplerOutput:
    """Samples one token per row of ``logits`` ``[R, V]`` (see the module docstring)."""
    md = metadata
    if logits.dim() != 2 or logits.shape[0] != md.num_rows:
        raise ValueError(f"logits must be [{md.num_rows}, V], got {tuple(logits.shape)}")
    check_same_device("the sampling metadata", md.greedy.device, "the logits tensor", logits.device)
    raw = logits
    # Everything below is out-of-place on the first op, so the caller's tensor is never touched.
    x = logits.float()

    if md.banned_rows is not None:
        x = x.index_put((md.banned_rows, md.banned_tokens), x.new_tensor(_NEG_INF))
    x = _apply_penalties(x, md)

    if md.all_greedy:
        sampled = x.argmax(dim=-1)
    else:
        greedy_tok = None if md.all_random else x.argmax(dim=-1)
        assert md.temperature is not None
        # Everything after the temperature works on probabilities: masking is "set to 0", and no
        # second softmax is needed since the sampler accepts unnormalised weights.
        probs = torch.softmax(x / md.temperature.unsqueeze(1), dim=-1)
        if md.min_p is not None:
            probs = _apply_min_p(probs, md.min_p)
        if md.top_p is not None:
            probs = _apply_top_k_top_p(probs, md.top_k, md.top_p)
        elif md.top_k is not None:
            probs = _apply_top_k(probs, md.top_k, md.max_top_k)
        u = _draw_uniforms(md.num_rows, md, generator, probs.device)
        random_tok = _inverse_cdf_sample(probs, u)
        sampled = random_tok if greedy_tok is None else torch.where(md.greedy, greedy_tok, random_tok)

    lp = _logprobs(raw, md, sampled) if md.logprob_rows is not None else None
    return SamplerOutput(token_ids=sampled.to(torch.int32).cpu().numpy(), logprobs=lp)


class Sampler:
    """Holds the shared generator for unseeded rows; ``Sampler(seed=0)`` makes runs replayable.

    The shared generator lives on ``device``, the device of the logits it will sample (unseeded
    rows draw their uniforms there in one call); ``sample`` refuses a generator on another device.
    """

    __slots__ = ("generator",)

    def __init__(
        self,
        seed: int | None = None,
        device: torch.device | str = "cpu",
        generator: torch.Generator | None = None,
    ) -> None:
        if generator is None and seed is not None:
            generator = torch.Generator(device=device)
            generator.manual_seed(seed)
        self.generator = generator

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        return sample(logits, metadata, self.generator)
