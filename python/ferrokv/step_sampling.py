"""A step's sampling, read from the scheduler's output: metadata from its per-row columns,
penalty statistics from ``PenaltyState``, and the sampler.

The core keeps each request's sampling parameters and hands them out per logits row each step
(``SchedulerOutput.row_*``, with the flags that say which stages any row needs, and each row's
uniform draw); so building a step's metadata is O(1) numpy and torch calls, with no Python per
row, and a batch that is all greedy reads nothing but the flags and takes one ``argmax``.

Per-token logit masks fit the same shape: ``min_tokens`` bans already come as sparse ``(row,
token)`` pairs (``banned_rows``/``banned_tokens``) applied with one ``index_put``; ``bad_words``,
``allowed_token_ids`` and ``logit_bias`` are per-request lists the core can hand out the same way
(pairs, with a value column for a bias), and a grammar's per-step mask is a ``[R, V]`` bitmask
tensor keyed by logits row, applied before the penalties like the bans.

Invariants: ``metadata`` runs on the scheduler's thread (it reads ``out`` and, for a penalty row
that joined or moved, the core's tokens); ``sample`` touches only tensors, so it may run on the
step worker's thread. Costs: see ``ferrokv.sampler`` and ``ferrokv.penalties``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ferrokv.penalties import PenaltyState
from ferrokv.sampler import SampledTokens, Sampler, SamplingMetadata, penalty_rows
from ferrokv.sampling_params import SamplingParams

__all__ = ["StepSampler", "core_sampling_kwargs"]


class StepSampler:
    """Samples a step's logits rows with the parameters the scheduler handed out."""

    __slots__ = ("vocab_size", "device", "sampler", "penalties")

    def __init__(self, vocab_size: int, device: torch.device, seed: int | None) -> None:
        self.vocab_size = vocab_size
        self.device = device
        # Only rows without a uniform of their own draw from it (none that the scheduler built).
        self.sampler = Sampler(seed=seed, device=device)
        self.penalties = PenaltyState(vocab_size, device)

    def metadata(self, out: Any, prompt_of: Callable[[int], Sequence[int]],
                 history_of: Callable[[int], Sequence[int]]) -> SamplingMetadata | None:
        """The step's metadata (None when no row samples). ``prompt_of(logits row)`` and
        ``history_of(seq id)`` are read only for penalty rows whose statistics are stale."""
        if not out.num_rows:
            return None
        pens = None
        if out.any_penalties:
            pens = self.penalties.inputs(out, penalty_rows(out), prompt_of, history_of)
        return SamplingMetadata.from_arrays(out, self.vocab_size, self.device, pens)

    def sample(self, logits: torch.Tensor, md: SamplingMetadata) -> SampledTokens:
        """The step's tokens, left on the device; counts them into the penalty statistics."""
        tokens = self.sampler.sample_async(logits, md)
        if md.penalty_rows is not None:
            self.penalties.record(tokens.token_ids)
        return tokens


def core_sampling_kwargs(params: SamplingParams) -> dict[str, Any]:
    """A request's sampling parameters as ``Scheduler.add_request`` keywords (the core keeps
    them and hands them out per row; temperature 0 means greedy, ``is_greedy`` deciding)."""
    return dict(
        temperature=0.0 if params.is_greedy else params.temperature, top_k=params.top_k,
        top_p=params.top_p, min_p=params.min_p, presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty, repetition_penalty=params.repetition_penalty,
        seed=params.seed, logprobs=params.logprobs,
    )
