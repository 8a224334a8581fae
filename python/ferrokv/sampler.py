"""Vectorised token sampling over a batch of logits rows.

One call samples one token for every row of a ``[R, V]`` float logits tensor. Each row belongs to
one sequence (a request with ``n > 1`` contributes ``n`` rows, one per sample). Per-row parameters
arrive as a :class:`SamplingMetadata`, built once per step by :meth:`SamplingMetadata.from_arrays`
from per-row numpy columns: the scheduler's output (``SchedulerOutput.row_*``, where the core keeps
each request's parameters, so the engine has no per-row Python) or :class:`SamplingArrays` built
from :class:`SamplingRow` (tests, tools). All the maths is whole-batch tensor ops.

Pipeline, in vLLM V1's order (each stage is skipped when no row needs it; a batch that is all
greedy, with no penalty, ``min_tokens`` ban or logprobs, is one ``argmax``):

1. logprobs (only rows that asked): ``log_softmax`` of the **raw model logits**, before any
   penalty / temperature / truncation -- vLLM V1's default ("raw_logprobs"), so the numbers are
   the model's own beliefs and do not depend on sampling knobs.
2. ``allowed_token_ids`` and ``logit_bias``: each biased row gets its request's additive row
   (``-inf`` outside the allowed ids; ``ferrokv.logit_rules``). Then the bans: while a row has
   fewer than ``min_tokens`` outputs, its stop token ids and the EOS (under ``ignore_eos`` too, as vLLM),
   and the ``bad_words`` whose other tokens end its output, are set to ``-inf`` (the scheduler
   lists the pairs; a row they would leave with no token keeps them, so that it never yields a
   token it did not allow). A grammar's mask is applied before the sampler (``ferrokv.step_sampling``).
3. penalties, on the penalty rows only: repetition (HF semantics, over prompt + output tokens:
   ``logit > 0 -> logit / p``, else ``logit * p``), then ``frequency * count`` and
   ``presence * (count > 0)`` subtracted, with counts over output tokens only
   (``ferrokv.penalties`` keeps the counts across steps).
4. greedy rows: ``argmax`` (exact ties -> lowest index, as ``torch.argmax``).
5. random rows: ``softmax(logits / temperature)``; then, on probabilities (masking = set to 0,
   the sampler takes unnormalised weights so no renormalising softmax is needed): min-p (drop
   ``p < min_p * p_max``) on the full distribution; top-k (ties at the k-th value are all kept);
   top-p over what top-k left, relative to its mass (the most likely token always survives);
   then inverse-CDF sampling with one ``U[0,1)`` per row, accumulated in float64 in two levels
   (256-token blocks, then a token), so even tiny tail probabilities are honoured. The uniforms
   come with the metadata: the scheduler derives each from the request's seed (or the engine's
   and the request's id), the sample index and the token's position, so a seeded row's token
   depends only on its own logits row and those, never on the batch, a preemption or a
   cancelled step. NaN entries (rows built without one) draw from the sampler's generator.

Invariants: the input ``logits`` tensor is never modified; output ids are ``int64`` numpy, one per
row; a token whose processed probability is 0 is never sampled. Devices: the metadata tensors and
the sampler's generator are on the logits' device (checked: ``DeviceMismatchError`` names both
devices otherwise). Every stage is row-local and no path choice depends on other rows, so a row's
token is exact-batch-invariant on CPU; on GPU it holds up to float rounding of row reductions.

Costs per step, R rows, V vocab: O(R*V) elementwise work (softmax, one pass of block sums) for
random rows, one argmax for greedy ones; + ``topk(max_k)`` for top-k alone; + ``topk(512)`` when
some row has top-p, and a full sort only for rows whose nucleus is not inside their 512 most
likely tokens (found, and sampled again, after the step's one synchronisation: top-p adds none);
+ O(P*V) for P penalty rows; + one ``[L, V]`` log_softmax for the L rows that want logprobs.
Building the metadata is O(1) numpy/torch calls, none per row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ferrokv.checks import check_same_device
from ferrokv.sampling_filters import (_TOP_P_CANDIDATES, _apply_min_p, _apply_top_k, _apply_top_k_top_p,
                                     _full_nucleus, _inverse_cdf_sample, _NucleusRedo, _row_total, _top_k_or_all)
from ferrokv.sampling_params import SamplingParams

__all__ = [
    "LogprobsResult",
    "PenaltyInputs",
    "SampledTokens",
    "Sampler",
    "SamplerOutput",
    "SamplingArrays",
    "SamplingMetadata",
    "SamplingRow",
    "compute_logprobs",
    "penalty_inputs",
    "penalty_rows",
    "sample",
    "sample_async",
]

_NEG_INF = float("-inf")


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """``log_softmax`` over the last dim, in float32 (for beam search and logprob reporting)."""
    return torch.log_softmax(logits.float(), dim=-1)


@dataclass(slots=True)
class SamplingRow:
    """One sequence's sampling state, for building a step's metadata outside the engine (tests,
    tools); the engine reads the same columns from the scheduler's output instead.

    ``uniform`` is the row's U[0,1) draw for this step (the scheduler derives it from the
    request's seed, sample index and position); None draws it from the sampler's generator.
    ``prompt_token_ids`` is only read when the row has a repetition penalty.
    """

    params: SamplingParams
    output_token_ids: Sequence[int] = ()
    prompt_token_ids: Sequence[int] = ()
    uniform: float | None = None


@dataclass(slots=True)
class SamplingArrays:
    """A step's per-row sampling parameters as numpy columns, named as the scheduler's output
    names them (``SchedulerOutput.row_*``), so either can feed ``SamplingMetadata.from_arrays``."""

    num_rows: int
    row_temperature: np.ndarray  # float32 [R]; 0 = greedy
    row_top_k: np.ndarray  # int32 [R]; <= 0 disabled
    row_top_p: np.ndarray  # float32 [R]
    row_min_p: np.ndarray  # float32 [R]
    row_presence: np.ndarray  # float32 [R]
    row_frequency: np.ndarray  # float32 [R]
    row_repetition: np.ndarray  # float32 [R]
    row_num_logprobs: np.ndarray  # int32 [R]; -1 = none
    row_uniform: np.ndarray  # float64 [R]; NaN = draw from the sampler's generator
    banned_rows: np.ndarray  # int64 [B]: min_tokens bans, (row, token) pairs
    banned_tokens: np.ndarray  # int64 [B]
    num_greedy_rows: int
    max_top_k: int
    any_top_p: bool
    any_min_p: bool
    any_penalties: bool
    any_logprobs: bool

    @classmethod
    def of_rows(cls, rows: Sequence[SamplingRow], eos_token_ids: Sequence[int] = ()) -> SamplingArrays:
        """The columns of ``rows`` (a Python loop over rows: for tests and tools)."""
        params = [r.params for r in rows]

        def col(values: Any, dtype: Any) -> np.ndarray:
            return np.asarray(list(values), dtype=dtype)

        temperature = col((0.0 if p.is_greedy else p.temperature for p in params), np.float32)
        top_k = col((p.top_k for p in params), np.int32)
        top_p = col((p.top_p for p in params), np.float32)
        min_p = col((p.min_p for p in params), np.float32)
        presence = col((p.presence_penalty for p in params), np.float32)
        frequency = col((p.frequency_penalty for p in params), np.float32)
        repetition = col((p.repetition_penalty for p in params), np.float32)
        num_lp = col((-1 if p.logprobs is None else p.logprobs for p in params), np.int32)
        uniform = col((np.nan if r.uniform is None else r.uniform for r in rows), np.float64)
        b_rows: list[int] = []
        b_toks: list[int] = []
        for i, (row, p) in enumerate(zip(rows, params)):
            if len(row.output_token_ids) < p.min_tokens:  # EOS banned even under ignore_eos, as vLLM
                stop_ids = dict.fromkeys(p.stop_token_ids)
                stop_ids.update(dict.fromkeys(eos_token_ids))
                b_rows += [i] * len(stop_ids)
                b_toks += list(stop_ids)
        return cls(
            num_rows=len(rows), row_temperature=temperature, row_top_k=top_k, row_top_p=top_p,
            row_min_p=min_p, row_presence=presence, row_frequency=frequency, row_repetition=repetition,
            row_num_logprobs=num_lp, row_uniform=uniform,
            banned_rows=col(b_rows, np.int64), banned_tokens=col(b_toks, np.int64),
            num_greedy_rows=int((temperature == 0).sum()), max_top_k=int(top_k.max(initial=0)),
            any_top_p=bool((top_p < 1).any()), any_min_p=bool((min_p > 0).any()),
            any_penalties=bool(((presence != 0) | (frequency != 0) | (repetition != 1)).any()),
            any_logprobs=bool((num_lp >= 0).any()),
        )


@dataclass(slots=True)
class PenaltyInputs:
    """The rows with a penalty and their token statistics (``ferrokv.penalties`` keeps them
    across steps; ``penalty_inputs`` builds them from histories)."""

    rows: torch.Tensor  # int64 [P]: batch rows with a non-neutral penalty
    row_index: np.ndarray  # int64 [P]: the same rows on the host (reading them back would wait for the device)
    output_counts: torch.Tensor | None  # float32 [P, V]: occurrences in the output so far
    seen_mask: torch.Tensor | None  # bool [P, V]: in the prompt or the output


def penalty_rows(arrays: Any) -> np.ndarray:
    """The rows of ``arrays`` (a ``SamplingArrays`` or a scheduler output) with a penalty."""
    mask = (arrays.row_presence != 0) | (arrays.row_frequency != 0) | (arrays.row_repetition != 1)
    return np.flatnonzero(mask)


def penalty_inputs(rows: Sequence[SamplingRow], vocab_size: int, device: torch.device | str = "cpu") -> PenaltyInputs | None:
    """``PenaltyInputs`` computed from the rows' histories (tests and tools)."""
    pen = [i for i, r in enumerate(rows) if r.params.has_penalties]
    if not pen:
        return None
    counts = torch.zeros((len(pen), vocab_size), dtype=torch.float32, device=device)
    seen = torch.zeros((len(pen), vocab_size), dtype=torch.bool, device=device)
    for j, i in enumerate(pen):
        out = [t for t in rows[i].output_token_ids if 0 <= t < vocab_size]
        prompt = [t for t in rows[i].prompt_token_ids if 0 <= t < vocab_size]
        if out:
            ids = torch.tensor(out, dtype=torch.int64, device=device)
            counts[j].index_put_((ids,), torch.ones(len(out), device=device), accumulate=True)
            seen[j, ids] = True
        if prompt:
            seen[j, torch.tensor(prompt, dtype=torch.int64, device=device)] = True
    idx = np.asarray(pen, dtype=np.int64)
    return PenaltyInputs(torch.from_numpy(idx).to(device), idx, counts, seen)


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row sampling parameters of one step, as batch tensors (``None`` = no row uses it)."""

    num_rows: int
    device: torch.device
    all_greedy: bool
    all_random: bool
    greedy: torch.Tensor | None  # bool [R]; None when all rows are greedy or all random
    temperature: torch.Tensor | None  # float32 [R]; 1.0 on greedy rows so division is harmless
    top_k: torch.Tensor | None  # int64 [R]; V where disabled
    max_top_k: int  # largest enabled top_k (0 if none); a Python int so no device sync is needed
    top_p: torch.Tensor | None  # float32 [R]
    min_p: torch.Tensor | None  # float32 [R]
    # Penalties: None unless some row has a non-neutral one; then per penalty row.
    penalty_rows: torch.Tensor | None  # int64 [P]
    presence_penalty: torch.Tensor | None  # float32 [P, 1]
    frequency_penalty: torch.Tensor | None  # float32 [P, 1]
    repetition_penalty: torch.Tensor | None  # float32 [P, 1]
    output_counts: torch.Tensor | None  # float32 [P, V]
    seen_mask: torch.Tensor | None  # bool [P, V]
    # min_tokens and bad_words: (row, token) pairs to set to -inf.
    banned_rows: torch.Tensor | None  # int64 [B]
    banned_tokens: torch.Tensor | None  # int64 [B]
    banned_row_set: torch.Tensor | None  # int64 [U]: the distinct banned rows
    # logit_bias / allowed_token_ids: rows and the additive rows they get (ferrokv.logit_rules).
    bias_rows: torch.Tensor | None  # int64 [S]
    bias: torch.Tensor | None  # float32 [S, V]
    uniforms: torch.Tensor | None  # float64 [R]; NaN entries draw from the sampler's generator
    draw_missing: bool  # some uniform is NaN (decided on the host, so the device never waits)
    # Logprobs: rows that asked and how many top alternatives each wants.
    logprob_rows: torch.Tensor | None  # int64 [L]
    num_top_logprobs: np.ndarray | None  # int32 [L]

    @classmethod
    def from_arrays(cls, a: Any, vocab_size: int, device: torch.device | str = "cpu",
                    penalties: PenaltyInputs | None = None,
                    bias: tuple[torch.Tensor, torch.Tensor] | None = None) -> SamplingMetadata:
        """The batch tensors of a step's columns ``a`` (a ``SamplingArrays`` or a scheduler
        output): array operations only, and a batch that is all greedy with no penalty, ban or
        logprobs reads nothing but the flags. Token ids outside ``[0, vocab_size)`` are ignored."""
        R, V = a.num_rows, vocab_size
        dev = torch.device(device)

        def tensor(x: np.ndarray) -> torch.Tensor:
            t = torch.from_numpy(np.ascontiguousarray(x))
            return t if dev.type == "cpu" else t.to(dev, non_blocking=True)

        num_greedy = a.num_greedy_rows
        all_greedy, all_random = num_greedy == R, num_greedy == 0
        greedy = temperature = top_k = top_p = min_p = uniforms = None
        max_top_k = 0
        draw_missing = False
        if not all_greedy:
            temp = a.row_temperature
            is_greedy = temp == 0
            greedy = None if all_random else tensor(is_greedy)
            temperature = tensor(np.where(is_greedy, np.float32(1.0), temp))
            if a.max_top_k > 0:
                k = a.row_top_k.astype(np.int64)
                enabled = (k > 0) & (k < V)
                max_top_k = int(k[enabled].max(initial=0))
                if max_top_k > 0:
                    top_k = tensor(np.where(enabled, k, V))
            if a.any_top_p:  # off for greedy rows: the top-p redo must not replace their argmax
                top_p = tensor(np.where(is_greedy, np.float32(1.0), a.row_top_p))
            if a.any_min_p:
                min_p = tensor(a.row_min_p)
            draw_missing = bool(np.isnan(a.row_uniform).any())
            uniforms = tensor(a.row_uniform)

        pen_rows = presence = frequency = repetition = counts = seen = None
        if penalties is not None:
            idx = penalties.row_index
            pen_rows = penalties.rows.to(dev)
            presence = tensor(a.row_presence[idx]).unsqueeze(1)
            frequency = tensor(a.row_frequency[idx]).unsqueeze(1)
            repetition = tensor(a.row_repetition[idx]).unsqueeze(1)
            counts, seen = penalties.output_counts, penalties.seen_mask

        banned_rows = banned_tokens = banned_row_set = None
        if len(a.banned_rows):
            toks = a.banned_tokens
            keep = (toks >= 0) & (toks < V)
            if keep.any():
                banned_rows, banned_tokens = tensor(a.banned_rows[keep]), tensor(toks[keep])
                banned_row_set = tensor(np.unique(a.banned_rows[keep]))

        logprob_rows = num_top = None
        if a.any_logprobs:
            n = a.row_num_logprobs
            rows = np.flatnonzero(n >= 0)
            logprob_rows = tensor(rows.astype(np.int64))
            num_top = np.minimum(n[rows], V).astype(np.int32)

        return cls(
            num_rows=R, device=dev, all_greedy=all_greedy, all_random=all_random, greedy=greedy,
            temperature=temperature, top_k=top_k, max_top_k=max_top_k, top_p=top_p, min_p=min_p,
            penalty_rows=pen_rows, presence_penalty=presence, frequency_penalty=frequency,
            repetition_penalty=repetition, output_counts=counts, seen_mask=seen,
            banned_rows=banned_rows, banned_tokens=banned_tokens, banned_row_set=banned_row_set,
            uniforms=uniforms, draw_missing=draw_missing,
            logprob_rows=logprob_rows, num_top_logprobs=num_top,
            bias_rows=None if bias is None else bias[0], bias=None if bias is None else bias[1],
        )

    @classmethod
    def build(cls, rows: Sequence[SamplingRow], vocab_size: int, eos_token_ids: Sequence[int] = (),
              device: torch.device | str = "cpu") -> SamplingMetadata:
        """The metadata of ``rows`` (tests and tools): ``SamplingArrays.of_rows`` and
        ``penalty_inputs``, then the engine's own ``from_arrays``. ``eos_token_ids`` are masked
        during ``min_tokens``, whatever ``ignore_eos`` says."""
        arrays = SamplingArrays.of_rows(rows, eos_token_ids)
        pens = penalty_inputs(rows, vocab_size, device) if arrays.any_penalties else None
        return cls.from_arrays(arrays, vocab_size, device, pens)


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

    token_ids: np.ndarray  # int64 [R] (the core's update takes it as is)
    logprobs: LogprobsResult | None = None


def _apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The logits with the penalty rows penalised (out of place: only those rows are computed)."""
    rows = md.penalty_rows
    x = logits.index_select(0, rows)
    if md.seen_mask is not None:
        p = md.repetition_penalty
        penalized = torch.where(x > 0, x / p, x * p)
        x = torch.where(md.seen_mask, penalized, x)
    if md.output_counts is not None:
        counts = md.output_counts
        x = x - md.frequency_penalty * counts - md.presence_penalty * (counts > 0).to(x.dtype)
    return logits.index_copy(0, rows, x)


def _draw_uniforms(
    n: int, md: SamplingMetadata, generator: torch.Generator | None, device: torch.device
) -> torch.Tensor:
    """One U[0,1) per row (float64): the metadata's, whose NaN entries (rows without a given
    draw) come from ``generator`` (else torch's global one), which must be on ``device``."""
    if generator is not None:
        check_same_device("the sampler's generator", generator.device, "the logits tensor", device)
    u = md.uniforms
    if u is None:
        return torch.rand(n, dtype=torch.float64, device=device, generator=generator)
    if md.draw_missing:
        u = torch.where(torch.isnan(u), torch.rand(n, dtype=torch.float64, device=device, generator=generator), u)
    return u


@dataclass(slots=True)
class SampledTokens:
    """A step's sampling results, still on the logits' device (nothing has waited for them);
    ``result()`` copies them to the host, the one synchronisation of a step."""

    token_ids: torch.Tensor  # int64 [R]
    logprob_parts: tuple[torch.Tensor, ...] | None  # rows, logprobs [L, V], top ids, top lp
    num_top_logprobs: np.ndarray | None
    redo: _NucleusRedo | None = None  # top-p rows to sample again once known
    # Called once, in result(), with the final token ids (int64 [R], on the device).
    on_result: Callable[[torch.Tensor], None] | None = None

    def result(self) -> SamplerOutput:
        if self.redo is not None:  # first: the tokens it replaces are the ones reported below
            self.redo.patch(self.token_ids)
            self.redo = None  # its tensors are the step's largest: freed once used
        if self.on_result is not None:
            self.on_result(self.token_ids)
            self.on_result = None
        lp = None
        if self.logprob_parts is not None:
            rows, table, top_ids, top_lp = self.logprob_parts
            tok_lp, ranks = _sampled_logprobs(table, rows, self.token_ids)
            rows, tok_lp, ranks, top_ids, top_lp = (t.cpu().numpy() for t in (rows, tok_lp, ranks, top_ids, top_lp))
            lp = LogprobsResult(rows=rows, sampled_logprobs=tok_lp, sampled_ranks=ranks,
                                top_ids=top_ids.astype(np.int32), top_logprobs=top_lp, num_top=self.num_top_logprobs)
        return SamplerOutput(token_ids=self.token_ids.cpu().numpy(), logprobs=lp)


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """Row argmax of float32 ``x`` ``[R, V]`` (ties and NaN as ``torch.argmax``: the first
    maximum, a NaN counting as one). On the CPU numpy's vectorised argmax, several times faster
    than torch's there, on a zero-copy view."""
    if x.device.type == "cpu":
        return torch.from_numpy(x.detach().numpy().argmax(axis=-1))
    return x.argmax(dim=-1)


def _logprob_tables(logits: torch.Tensor, md: SamplingMetadata) -> tuple[torch.Tensor, ...]:
    """(rows, their logprobs ``[L, V]``, top ids, top logprobs) of the rows that want logprobs;
    the sampled tokens' own come at ``result()`` (``_sampled_logprobs``), once the tokens are final."""
    assert md.logprob_rows is not None and md.num_top_logprobs is not None
    rows = md.logprob_rows
    lp = compute_logprobs(logits.index_select(0, rows))
    k = int(md.num_top_logprobs.max())
    if k > 0:
        top_lp, top_ids = lp.topk(k, dim=-1)
    else:
        top_lp = lp.new_empty((lp.shape[0], 0))
        top_ids = torch.empty((lp.shape[0], 0), dtype=torch.int64, device=lp.device)
    return rows, lp, top_ids, top_lp


def _sampled_logprobs(lp: torch.Tensor, rows: torch.Tensor,
                      token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The logprob and rank of each row's sampled token (vLLM's rank: the tokens at least as
    likely, itself included)."""
    tok_lp = lp.gather(1, token_ids.index_select(0, rows).to(torch.int64).unsqueeze(1))
    return tok_lp.squeeze(1), (lp >= tok_lp).sum(dim=-1)


def _ban(x: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """``x`` with the banned (row, token) pairs at -inf, except in a row the bans would leave with
    no token at all (``allowed_token_ids`` or a finished grammar allowing only EOS under
    ``min_tokens``): that row keeps its banned tokens, rather than yielding token 0, which it
    never allowed. O(U * V) for the U banned rows; no host copy (a GPU sync)."""
    assert md.banned_rows is not None and md.banned_tokens is not None and md.banned_row_set is not None
    banned = x.index_put((md.banned_rows, md.banned_tokens), x.new_full((), _NEG_INF))
    rows = md.banned_row_set
    after = banned.index_select(0, rows)
    emptied = torch.isneginf(after.amax(dim=1, keepdim=True))
    return banned.index_copy(0, rows, torch.where(emptied, x.index_select(0, rows), after))


def sample_async(logits: torch.Tensor, metadata: SamplingMetadata,
                 generator: torch.Generator | None = None) -> SampledTokens:
    """Samples one token per row of ``logits`` ``[R, V]`` (see the module docstring), leaving
    the results on the device (``SampledTokens.result()`` fetches them)."""
    md = metadata
    if logits.dim() != 2 or logits.shape[0] != md.num_rows:
        raise ValueError(f"logits must be [{md.num_rows}, V], got {tuple(logits.shape)}")
    check_same_device("the sampling metadata", md.device, "the logits tensor", logits.device)
    raw = logits
    # Everything below is out of place, so the caller's tensor is never touched.
    x = logits.float()

    if md.bias_rows is not None:
        x = x.index_add(0, md.bias_rows, md.bias)
    if md.banned_rows is not None:
        x = _ban(x, md)
    if md.penalty_rows is not None:
        x = _apply_penalties(x, md)

    redo = None
    if md.all_greedy:
        sampled = _argmax(x)
    else:
        greedy_tok = None if md.all_random else _argmax(x)
        assert md.temperature is not None
        # Everything after the temperature works on probabilities: masking is "set to 0", and no
        # second softmax is needed since the sampler accepts unnormalised weights.
        probs = torch.softmax(x / md.temperature.unsqueeze(1), dim=-1)
        if md.min_p is not None:
            probs = _apply_min_p(probs, md.min_p)
        u = _draw_uniforms(md.num_rows, md, generator, probs.device)
        if md.top_p is not None:
            # Greedy rows are never unsure: their top_p is 1 (SamplingParams resets it).
            full, (probs, unsure) = probs, _apply_top_k_top_p(probs, md.top_k, md.top_p)
            redo = _NucleusRedo(full, md.top_k, md.top_p, u, unsure)
        elif md.top_k is not None:
            probs = _apply_top_k(probs, md.top_k, md.max_top_k)
        random_tok = _inverse_cdf_sample(probs, u)
        sampled = random_tok if greedy_tok is None else torch.where(md.greedy, greedy_tok, random_tok)

    lp = _logprob_tables(raw, md) if md.logprob_rows is not None else None
    return SampledTokens(sampled, lp, md.num_top_logprobs, redo)


def sample(logits: torch.Tensor, metadata: SamplingMetadata,
           generator: torch.Generator | None = None) -> SamplerOutput:
    """Samples one token per row of ``logits`` ``[R, V]``, results on the host."""
    return sample_async(logits, metadata, generator).result()


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

    def sample_async(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SampledTokens:
        return sample_async(logits, metadata, self.generator)
