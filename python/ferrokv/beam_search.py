"""Beam search over the core's fork / drop / copy-on-write, with Hugging Face's semantics.

Each step the live beams of a request arrive together (the scheduler steps all sequences of a
request in lockstep). ``BeamSearchState.step`` mirrors ``transformers``' vectorised beam search
(``generate(num_beams=k, do_sample=False)``): the top ``2k`` continuations over all beams, the
best ``k`` that did not stop keep running, stopped ones (EOS, or max length) among the top
``k`` enter the finished set with score ``sum(logprobs) / generated_len ** length_penalty``, and
the search ends when no running beam can beat the worst finished one.

The caller maps the result onto the scheduler: a surviving parent keeps its own row's token,
extra children are forked with their token, parents without children are dropped. All scores
are float32 like transformers'. Cost per step: one topk over ``k * vocab`` scores.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_NEG = -1.0e9


@dataclass(slots=True)
class BeamHypothesis:
    token_ids: list[int]  # generated tokens (the stopping EOS included)
    score: float  # normalised: cumulative logprob / generated_len ** length_penalty
    cumulative_logprob: float
    token_logprobs: list[float] = field(default_factory=list)  # each generated token's logprob


# A running beam: (cumulative logprob, generated tokens, their logprobs).
Beam = tuple[float, list[int], list[float]]
ROOT_BEAM: Beam = (0.0, [], [])


@dataclass(slots=True)
class BeamStepResult:
    # For each running beam of the next step: (parent row, token, cumulative logprob).
    next_beams: list[tuple[int, int, float]]
    done: bool


@dataclass(slots=True)
class BeamSearchState:
    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    eos_token_ids: tuple[int, ...] = ()
    num_generated: int = 0
    beams: dict[int, Beam] = field(default_factory=dict)  # by sequence id
    finished_scores: list[float] = field(default_factory=list)
    finished: list[BeamHypothesis] = field(default_factory=list)
    finished_flags: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.finished_scores = [_NEG] * self.beam_width
        self.finished = [BeamHypothesis([], _NEG, _NEG) for _ in range(self.beam_width)]
        self.finished_flags = [False] * self.beam_width

    def step(self, seq_ids: list[int], logprobs: torch.Tensor) -> BeamStepResult:
        """``logprobs`` ``[len(seq_ids), V]`` float32 log-softmax of each live beam's logits."""
        k = self.beam_width
        vocab = logprobs.shape[1]
        t = self.num_generated + 1
        scores = torch.tensor([self.beams.get(s, ROOT_BEAM)[0] for s in seq_ids], dtype=torch.float32)
        rows = logprobs.float()
        if len(seq_ids) < k:
            # transformers starts with k copies of the prompt, all but the first scored -1e9.
            pad = k - len(seq_ids)
            rows = torch.cat([rows, rows[:1].expand(pad, vocab)])
            scores = torch.cat([scores, torch.full((pad,), _NEG, dtype=torch.float32)])
        acc = (rows + scores[:, None]).reshape(-1)
        keep = min(max(2, 1 + len(self.eos_token_ids)) * k, acc.numel())
        top_vals, top_idx = torch.topk(acc, keep)
        beam_idx = (top_idx // vocab).tolist()
        tokens = (top_idx % vocab).tolist()
        is_eos = torch.tensor([tok in self.eos_token_ids for tok in tokens])
        hits = is_eos | (t >= self.max_tokens)

        running = top_vals + hits.to(torch.float32) * _NEG
        sel = torch.topk(running, min(k, keep)).indices.tolist()
        n_live = len(seq_ids)
        # A padded beam is a copy of beam 0: its continuations belong to row 0. Only real candidates
        # (not a padded row's, scored -1e9: fewer real ones than k when the vocabulary is tiny) go on.
        parent_row = [b if b < n_live else 0 for b in beam_idx]
        real = top_vals > _NEG / 2
        next_beams = [(parent_row[j], tokens[j], float(top_vals[j])) for j in sel if real[j]]

        # Finished set: the top k of the old finished and this step's stopped top-k candidates.
        norm = top_vals / (float(t) ** self.length_penalty)
        in_top = torch.arange(keep) < k
        just_finished = hits & in_top & real
        norm = norm + (~just_finished).to(torch.float32) * _NEG
        merged = torch.cat([torch.tensor(self.finished_scores, dtype=torch.float32), norm])
        order = torch.topk(merged, k).indices.tolist()
        new_scores, new_hyps, new_flags = [], [], []
        for m in order:
            if m < k:
                new_scores.append(self.finished_scores[m])
                new_hyps.append(self.finished[m])
                new_flags.append(self.finished_flags[m])
            else:
                j = m - k
                parent = self.beams.get(seq_ids[parent_row[j]], ROOT_BEAM)
                cum, toks, lps = extend(parent, tokens[j], float(top_vals[j]))
                new_scores.append(float(merged[m]))
                new_hyps.append(BeamHypothesis(toks, float(merged[m]), cum, lps))
                new_flags.append(bool(just_finished[j]))
        self.finished_scores, self.finished, self.finished_flags = new_scores, new_hyps, new_flags

        # Can a running beam still beat the worst finished hypothesis?
        best_running = float(running[sel[0]]) / (float(t) ** self.length_penalty)
        worst = min(self.finished_scores) if all(self.finished_flags) else _NEG
        improvement_possible = best_running > worst
        valid = not bool(hits.all())
        self.num_generated = t
        return BeamStepResult(next_beams=next_beams, done=not (improvement_possible and valid))

    def hypotheses(self) -> list[BeamHypothesis]:
        """Finished hypotheses, best first (every slot is filled once the search is done)."""
        return [h for h, f in zip(self.finished, self.finished_flags) if f]


def extend(beam: Beam, token: int, cumulative_logprob: float) -> Beam:
    """``beam`` continued by ``token``, its cumulative logprob then ``cumulative_logprob``."""
    cum, toks, lps = beam
    return cumulative_logprob, toks + [token], lps + [cumulative_logprob - cum]
