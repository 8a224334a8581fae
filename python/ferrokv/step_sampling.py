"""A step's sampling, read from the scheduler's output: metadata from its per-row columns,
penalty statistics from ``PenaltyState``, and the sampler.

The core keeps each request's sampling parameters and hands them out per logits row each step
(``SchedulerOutput.row_*``, with the flags that say which stages any row needs, and each row's
uniform draw); so building a step's metadata is O(1) numpy and torch calls, with no Python per
row, and a batch that is all greedy reads nothing but the flags and takes one ``argmax``.

Per-token logit rules: ``min_tokens`` and ``bad_words`` bans come as sparse ``(row, token)``
pairs (``banned_rows``/``banned_tokens``) applied with one ``index_put``; ``logit_bias`` and
``allowed_token_ids`` are static rows kept per request (``ferrokv.logit_rules``), gathered for
the rows the core lists (``bias_rows``).

Invariants: ``metadata`` runs on the scheduler's thread (it reads ``out`` and, for a penalty row
that joined or moved, the core's tokens); ``sample`` touches only tensors, so it may run on the
step worker's thread. Costs: see ``ferrokv.sampler`` and ``ferrokv.penalties``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ferrokv.logit_rules import LogitBiasState, has_logit_bias
from ferrokv.penalties import PenaltyState
from ferrokv.sampler import SampledTokens, Sampler, SamplingMetadata, penalty_rows
from ferrokv.sampling_params import SamplingParams

__all__ = ["StepSampler", "core_sampling_kwargs"]


class StepSampler:
    """Samples a step's logits rows with the parameters the scheduler handed out."""

    __slots__ = ("vocab_size", "device", "sampler", "penalties", "bias")

    def __init__(self, vocab_size: int, device: torch.device, seed: int | None) -> None:
        self.vocab_size = vocab_size
        self.device = device
        # Only rows without a uniform of their own draw from it (none that the scheduler built).
        self.sampler = Sampler(seed=seed, device=device)
        self.penalties = PenaltyState(vocab_size, device)
        self.bias = LogitBiasState(vocab_size, device)

    def metadata(self, out: Any, prompt_of: Callable[[int], Sequence[int]],
                 history_of: Callable[[int], Sequence[int]]) -> SamplingMetadata | None:
        """The step's metadata (None when no row samples). ``prompt_of(logits row)`` and
        ``history_of(seq id)`` are read only for penalty rows whose statistics are stale."""
        if not out.num_rows:
            return None
        pens = bias = None
        if out.any_penalties:
            pens = self.penalties.inputs(out, penalty_rows(out), prompt_of, history_of)
        if out.any_logit_bias:
            bias = self.bias.inputs(out)
        return SamplingMetadata.from_arrays(out, self.vocab_size, self.device, pens, bias)

    def sample(self, logits: torch.Tensor, md: SamplingMetadata) -> SampledTokens:
        """The step's tokens, left on the device; ``result()`` counts them into the penalty
        statistics (once final: top-p may sample rows again there)."""
        tokens = self.sampler.sample_async(logits, md)
        if md.penalty_rows is not None:
            tokens.on_result = self.penalties.record
        return tokens


_F32_MAX, _F32_TINY = 3.4028234663852886e38, 1.1754943508222875e-38


def _f32(x: float) -> float:
    """A positive finite float as the core's float32 keeps it: clipped, never rounded to 0 or
    inf (a temperature of 1e300 samples uniformly either way; a penalty or a top_p of 1e-300 is
    as small)."""
    return min(max(x, _F32_TINY), _F32_MAX)


def core_sampling_kwargs(params: SamplingParams, vocab_size: int) -> dict[str, Any]:
    """A request's sampling parameters as ``Scheduler.add_request`` keywords (the core keeps
    them and hands them out per row; temperature 0 means greedy, ``is_greedy`` deciding;
    ``logprobs=-1`` asks for the whole vocabulary). ``top_k`` and ``logprobs`` beyond the vocabulary
    mean what the vocabulary's size means (no truncation; every token), so huge values never
    overflow the core's 32-bit fields."""
    logprobs = params.logprobs
    if logprobs is not None:
        logprobs = vocab_size if logprobs == -1 else min(logprobs, vocab_size)
    return dict(
        temperature=0.0 if params.is_greedy else _f32(params.temperature),
        top_k=params.top_k if params.top_k < vocab_size else 0,
        top_p=_f32(params.top_p), min_p=params.min_p, presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty, repetition_penalty=_f32(params.repetition_penalty),
        seed=params.seed, logprobs=logprobs, has_logit_bias=has_logit_bias(params),
        # Prompt logprobs need every prompt position computed, whatever the field says.
        skip_cache_hits=params.skip_reading_prefix_cache or params.prompt_logprobs is not None,
    )
