"""Vectorised sampler: truncation, penalties, min_tokens, given uniforms, distribution, logprobs.

Every random draw here comes from a seeded generator or is given with the metadata, so the
statistical tests are deterministic.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ferrokv import sampler as S
from ferrokv.sampler import (
    PenaltyInputs,
    SampledTokens,
    Sampler,
    SamplingArrays,
    SamplingMetadata,
    SamplingRow,
    compute_logprobs,
    penalty_inputs,
    penalty_rows,
    sample,
    sample_async,
)
from ferrokv.sampling_params import SamplingParams as SP


def run(logits, rows, eos=(), seed=0):
    md = SamplingMetadata.build(rows, logits.shape[1], eos_token_ids=eos)
    return Sampler(seed=seed)(logits, md)


def rand_logits(R, V, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(R, V, generator=g) * scale


# --- greedy and truncation equivalences --------------------------------------------------------


def test_greedy_is_argmax_with_lowest_index_ties():
    x = rand_logits(16, 300)
    x[3, 7] = x[3, 250] = x[3].max() + 1.0  # exact tie: the lower index wins
    out = run(x, [SamplingRow(SP(temperature=0.0)) for _ in range(16)])
    assert out.token_ids.dtype == np.int64
    assert np.array_equal(out.token_ids, x.argmax(-1).numpy())
    assert out.token_ids[3] == 7
    # Greedy rows in a mixed batch break ties the same way.
    rows = [SamplingRow(SP(temperature=0.0 if i % 2 else 1.0)) for i in range(16)]
    rows[3] = SamplingRow(SP(temperature=0.0))
    assert run(x, rows).token_ids[3] == 7


@pytest.mark.parametrize(
    "params",
    [SP(top_k=1), SP(top_p=1e-6), SP(min_p=1.0), SP(top_k=1, top_p=0.5, temperature=2.0)],
    ids=["top_k=1", "top_p=1e-6", "min_p=1", "top_k=1+top_p"],
)
def test_degenerate_truncation_equals_greedy(params):
    x = rand_logits(64, 700, seed=1)
    out = run(x, [SamplingRow(params) for _ in range(64)])
    assert np.array_equal(out.token_ids, x.argmax(-1).numpy())
    # Whatever the uniform: the only survivor is the argmax.
    for u in (0.0, 0.5, 1.0 - 1e-12):
        out = run(x, [SamplingRow(params, uniform=u) for _ in range(64)])
        assert np.array_equal(out.token_ids, x.argmax(-1).numpy())


def test_mixed_greedy_and_random_rows():
    x = rand_logits(32, 200, seed=2, scale=1.0)
    rows = [SamplingRow(SP(temperature=0.0 if i % 2 else 1.0, top_k=1 if i % 4 == 0 else 0))
            for i in range(32)]
    out = run(x, rows)
    argmax = x.argmax(-1).numpy()
    # Odd rows greedy, rows divisible by 4 use top_k=1: both must equal argmax.
    for i in range(32):
        if i % 2 or i % 4 == 0:
            assert out.token_ids[i] == argmax[i]
    # The other rows really sample (flat-ish logits: not all stuck on the argmax).
    free = [i for i in range(32) if i % 4 == 2]
    assert any(out.token_ids[i] != argmax[i] for i in free)


def reference_support(probs_row: torch.Tensor, top_k: int, top_p: float, min_p: float) -> set[int]:
    """Straightforward per-row reference of which tokens may be sampled (vLLM semantics)."""
    p = probs_row.double().clone()
    if min_p > 0:
        p[p < min_p * p.max()] = 0
    order = torch.argsort(p, descending=True, stable=True)
    sp = p[order]
    if 0 < top_k < len(p):
        sp[sp < sp[top_k - 1]] = 0
    mass = sp.sum()
    above = torch.cumsum(sp, 0) - sp
    keep = (above < top_p * mass) & (sp > 0)
    return set(order[keep].tolist())


@pytest.mark.parametrize(
    ("V", "scale", "params"),
    [
        (1000, 3.0, SP(top_k=7)),
        (1000, 3.0, SP(top_p=0.8)),
        (1000, 3.0, SP(top_p=0.7, top_k=40)),
        (1000, 3.0, SP(min_p=0.2)),
        (1000, 3.0, SP(min_p=0.05, top_p=0.9, temperature=0.7)),
        # Flat rows: the nucleus is larger than the top-512 candidates -> full-sort fallback.
        (3000, 0.3, SP(top_p=0.9)),
        (3000, 0.3, SP(top_p=0.5, top_k=1500)),
    ],
    ids=["top_k", "top_p", "top_k+top_p", "min_p", "all", "top_p-fallback", "big-k-fallback"],
)
def test_samples_stay_in_reference_support(V, scale, params):
    R, draws = 8, 40
    x = rand_logits(R, V, seed=3, scale=scale)
    probs = torch.softmax(x / params.temperature, -1)
    supports = [reference_support(probs[r], params.top_k, params.top_p, params.min_p)
                for r in range(R)]
    sampler = Sampler(seed=123)
    md = SamplingMetadata.build([SamplingRow(params) for _ in range(R)], V)
    seen = [set() for _ in range(R)]
    for _ in range(draws):
        toks = sampler(x, md).token_ids
        for r in range(R):
            assert int(toks[r]) in supports[r]
            seen[r].add(int(toks[r]))
    # Not degenerate: when the support is big, several members get sampled.
    for r in range(R):
        assert len(seen[r]) >= min(3, len(supports[r]))
    # The uniforms' extremes stay inside the support too.
    for u in (0.0, 1.0 - 1e-16, 1.0 - 1e-9):
        md = SamplingMetadata.build([SamplingRow(params, uniform=u) for _ in range(R)], V)
        toks = sample(x, md).token_ids
        assert all(int(toks[r]) in supports[r] for r in range(R))


def filtered(probs, top_k, top_p):
    """The sampler's exact top-k/top-p: the candidates, then a full sort of the rows they leave
    unsure (what sampling does for them after the step's synchronisation)."""
    out, unsure = S._apply_top_k_top_p(probs, top_k, top_p)
    rows = unsure.nonzero().squeeze(1)
    k = S._top_k_or_all(top_k, *probs.shape, probs.device)
    return out.index_copy(0, rows, S._full_nucleus(probs[rows], k[rows], top_p[rows]))


def test_a_greedy_row_keeps_its_argmax_whatever_its_top_p_column_says():
    """The arrays may carry a top-p for a greedy row (its params assigned after validation): the
    redo of unsure top-p rows must not replace its argmax (vLLM: greedy rows ignore top-p)."""
    V = 3000
    x = rand_logits(2, V, seed=5, scale=0.2)  # flat: a top-p row is unsure
    greedy = SP(temperature=0.0)
    greedy.top_p = 0.9
    arrays = SamplingArrays.of_rows([SamplingRow(greedy, uniform=0.0), SamplingRow(SP(top_p=0.9), uniform=0.3)])
    assert arrays.row_top_p[0] == np.float32(0.9)
    out = sample(x, SamplingMetadata.from_arrays(arrays, V))
    assert int(out.token_ids[0]) == int(x[0].argmax())


def test_rows_the_candidates_miss_are_sampled_from_their_whole_nucleus_after_the_sync():
    # A flat row (nucleus of ~1700 of 2000 tokens) and a peaked one: sampling leaves the flat row
    # unsure on the device, and result() samples it again from its whole nucleus, with its own
    # uniform: the same token alone or beside other rows; greedy rows are never sampled again.
    V = 2000
    x = torch.cat([rand_logits(1, V, seed=5, scale=0.2), rand_logits(1, V, seed=4, scale=4.0)])
    probs = torch.softmax(x, -1)
    _, unsure = S._apply_top_k_top_p(probs, None, torch.tensor([0.9, 0.9]))
    assert unsure.tolist() == [True, False]
    support = reference_support(probs[0], 0, 0.9, 0.0)
    candidates = set(probs[0].topk(S._TOP_P_CANDIDATES).indices.tolist())
    lp = compute_logprobs(x[0])
    beyond = 0
    for u in np.linspace(0.0, 1.0 - 1e-9, 60):
        rows = [SamplingRow(SP(top_p=0.9, logprobs=0), uniform=float(u)), SamplingRow(SP(top_p=0.9, seed=1)),
                SamplingRow(SP(temperature=0.0, top_p=0.9))]
        pending = sample_async(torch.cat([x, x[:1]]), SamplingMetadata.build(rows, V))
        assert pending.redo is not None
        result = pending.result()
        toks = result.token_ids
        assert pending.redo is None and pending.result().token_ids.tolist() == toks.tolist()
        # The reported logprob and rank are the returned token's, not the one it replaced.
        assert float(result.logprobs.sampled_logprobs[0]) == float(lp[toks[0]])
        assert int(result.logprobs.sampled_ranks[0]) == int((lp >= lp[toks[0]]).sum())
        alone = sample(x[:1], SamplingMetadata.build(rows[:1], V)).token_ids
        assert int(toks[0]) in support and int(toks[0]) == int(alone[0])
        assert int(toks[2]) == int(x[0].argmax())
        beyond += int(toks[0]) not in candidates
    assert beyond > 0  # the flat row does reach past its candidates


def test_top_p_candidate_and_fallback_paths_agree_on_kept_probs():
    # One peaked row (nucleus within the candidates) and one flat row (fallback) in one batch:
    # the filtered probabilities must equal the reference's for both.
    V = 2000
    x = torch.cat([rand_logits(1, V, seed=4, scale=4.0), rand_logits(1, V, seed=5, scale=0.2)])
    probs = torch.softmax(x, -1)
    top_p = torch.tensor([0.9, 0.9])
    out = filtered(probs, None, top_p)
    for r in range(2):
        support = reference_support(probs[r], 0, 0.9, 0.0)
        kept = set(torch.nonzero(out[r]).squeeze(1).tolist())
        assert kept == support
        assert torch.equal(out[r][list(kept)], probs[r][list(kept)])
    assert len(reference_support(probs[0], 0, 0.9, 0.0)) < S._TOP_P_CANDIDATES
    assert len(reference_support(probs[1], 0, 0.9, 0.0)) > S._TOP_P_CANDIDATES
    # Each row alone gives the same result as in the shared batch.
    for r in range(2):
        alone = filtered(probs[r:r + 1], None, top_p[r:r + 1])
        assert torch.equal(alone[0], out[r])


@pytest.mark.parametrize("V", [40000, 150000])
def test_truncation_of_a_row_does_not_depend_on_the_batch(V):
    # Bitwise: the row total (a multi-threaded reduction when one row is long) and the kept
    # probabilities of each row are the same alone as in a batch, on both top-p paths.
    x = rand_logits(6, V, seed=14, scale=1.0) * torch.tensor([[3.0], [3.0], [0.3], [2.0], [3.0], [0.5]])
    probs = torch.softmax(x, -1)
    top_p = torch.tensor([0.9, 0.95, 0.5, 1.0, 0.8, 0.99])
    top_k = torch.tensor([V, 40, V, 7, 600, V])
    full = filtered(probs, top_k, top_p)
    totals = S._row_total(probs)
    for i in range(6):
        assert torch.equal(S._row_total(probs[i:i + 1])[0], totals[i]), i
        alone = filtered(probs[i:i + 1], top_k[i:i + 1], top_p[i:i + 1])
        assert torch.equal(alone[0], full[i]), i


def test_top_k_keeps_tiny_tail_members_next_to_top_p_rows():
    # A top-k-only row (p = 1) in a batch that runs the top-p path: its k tokens all survive, even
    # when the tail is so small that the mass above the last ones rounds to the whole mass.
    V = 1000
    x = torch.full((2, V), -30.0)
    x[:, 0] = 0.0
    x[0, 1:5] = -20.0  # p ~ 2e-9 each: 1 + 4e-9 == 1 in float32
    x[1] = rand_logits(1, V, seed=15)[0]
    probs = torch.softmax(x, -1)
    out = filtered(probs, torch.tensor([5, V]), torch.tensor([1.0, 0.5]))
    assert out[0].nonzero().squeeze(1).tolist() == [0, 1, 2, 3, 4]
    assert set(out[1].nonzero().squeeze(1).tolist()) == reference_support(probs[1], 0, 0.5, 0.0)
    # Through the sampler: a uniform at the very top lands in that tail.
    md = SamplingMetadata.build([SamplingRow(SP(top_k=5), uniform=1.0 - 1e-10),
                                 SamplingRow(SP(top_p=0.5), uniform=0.5)], V)
    assert sample(x, md).token_ids[0] in (1, 2, 3, 4)


# --- penalties and min_tokens -------------------------------------------------------------------


def reference_penalize(logits_row, prompt, output, presence, frequency, repetition):
    row = logits_row.clone()
    for t in set(prompt) | set(output):
        row[t] = row[t] / repetition if row[t] > 0 else row[t] * repetition
    for t in set(output):
        row[t] -= frequency * output.count(t) + presence
    return row


def test_penalties_match_reference():
    R, V = 12, 97
    g = np.random.default_rng(0)
    x = rand_logits(R, V, seed=6)
    rows, refs = [], []
    for r in range(R):
        params = SP(
            presence_penalty=float(g.uniform(-2, 2)) if r % 3 else 0.0,
            frequency_penalty=float(g.uniform(-2, 2)) if r % 2 else 0.0,
            repetition_penalty=float(g.uniform(0.5, 2.0)) if r % 4 else 1.0,
        )
        prompt = g.integers(0, V, size=int(g.integers(0, 20))).tolist()
        output = g.integers(0, V, size=int(g.integers(0, 30))).tolist()
        rows.append(SamplingRow(params, output, prompt))
        refs.append(reference_penalize(x[r], prompt, output, params.presence_penalty,
                                       params.frequency_penalty, params.repetition_penalty))
    md = SamplingMetadata.build(rows, V)
    pen = [r for r in range(R) if rows[r].params.has_penalties]
    assert pen != list(range(R))  # row 0 (and only it) is neutral
    assert md.penalty_rows.tolist() == pen
    assert penalty_rows(SamplingArrays.of_rows(rows)).tolist() == pen
    assert md.output_counts.shape == md.seen_mask.shape == (len(pen), V)
    got = S._apply_penalties(x.clone(), md)
    torch.testing.assert_close(got, torch.stack(refs), rtol=1e-6, atol=1e-5)
    assert torch.equal(got[0], x[0])

    # End to end through greedy: argmax of the penalised logits.
    greedy_rows = [SamplingRow(SP(temperature=0.0, presence_penalty=r.params.presence_penalty,
                                  frequency_penalty=r.params.frequency_penalty,
                                  repetition_penalty=r.params.repetition_penalty),
                               r.output_token_ids, r.prompt_token_ids) for r in rows]
    out = run(x, greedy_rows)
    assert np.array_equal(out.token_ids, torch.stack(refs).argmax(-1).numpy())


def test_penalty_inputs_for_a_subset_of_rows():
    # The statistics only exist for the penalty rows (P of R), in their order.
    V = 30
    rows = [SamplingRow(SP(temperature=0.0)), SamplingRow(SP(temperature=0.0, presence_penalty=2.0), [4, 4, 9], [2]),
            SamplingRow(SP(temperature=0.0)), SamplingRow(SP(temperature=0.0, repetition_penalty=3.0), [], [4])]
    pens = penalty_inputs(rows, V)
    assert isinstance(pens, PenaltyInputs) and pens.rows.tolist() == [1, 3]
    assert pens.output_counts[0, 4] == 2 and pens.output_counts[0, 9] == 1 and pens.output_counts.sum() == 3
    assert set(pens.seen_mask[0].nonzero().squeeze(1).tolist()) == {2, 4, 9}
    assert pens.seen_mask[1].nonzero().squeeze(1).tolist() == [4]
    assert pens.output_counts[1].sum() == 0
    assert penalty_inputs([SamplingRow(SP())], V) is None
    # The penalties move only their rows' argmax.
    x = torch.zeros(4, V)
    x[:, 4], x[:, 6], x[:, 8] = 3.0, 2.0, 1.0
    md = SamplingMetadata.from_arrays(SamplingArrays.of_rows(rows), V, "cpu", pens)
    assert sample(x, md).token_ids.tolist() == [4, 6, 4, 6]


def test_repetition_penalty_discourages_repeats():
    x = torch.zeros(1, 10)
    x[0, 3], x[0, 5] = 2.0, 1.9
    row = SamplingRow(SP(temperature=0.0, repetition_penalty=1.3), output_token_ids=[3])
    assert run(x, [row]).token_ids[0] == 5
    row = SamplingRow(SP(temperature=0.0, repetition_penalty=1.3), prompt_token_ids=[3])
    assert run(x, [row]).token_ids[0] == 5  # prompt tokens count too
    row = SamplingRow(SP(temperature=0.0, repetition_penalty=1.3))
    assert run(x, [row]).token_ids[0] == 3  # nothing seen: nothing penalised


def test_min_tokens_masks_eos_and_stop_ids():
    V, EOS, STOP = 50, 0, 7
    x = rand_logits(6, V, seed=7)
    x[:, EOS] = 100.0
    x[:, STOP] = 90.0
    p = dict(min_tokens=3, stop_token_ids=[STOP])
    rows = [
        SamplingRow(SP(temperature=0.0, **p), [1, 2]),  # 2 < 3: EOS and STOP masked
        SamplingRow(SP(temperature=0.0, **p), [1, 2, 3]),  # reached: EOS allowed
        SamplingRow(SP(temperature=0.0, ignore_eos=True, **p), [1]),  # EOS masked all the same (vLLM)
        SamplingRow(SP(temperature=1.0, **p), []),  # random row: masked tokens never sampled
        SamplingRow(SP(temperature=0.0), []),  # no min_tokens
        SamplingRow(SP(temperature=0.0, min_tokens=1), [], ),  # only EOS masked -> STOP
    ]
    arrays = SamplingArrays.of_rows(rows, eos_token_ids=[EOS])
    pairs = sorted(zip(arrays.banned_rows.tolist(), arrays.banned_tokens.tolist()))
    assert pairs == [(0, EOS), (0, STOP), (2, EOS), (2, STOP), (3, EOS), (3, STOP), (5, EOS)]
    assert arrays.banned_rows.dtype == arrays.banned_tokens.dtype == np.int64
    out = run(x, rows, eos=[EOS])
    rest = x[0].clone()
    rest[[EOS, STOP]] = -1e9
    assert out.token_ids[0] == int(rest.argmax())
    assert out.token_ids[1] == EOS
    third = x[2].clone()
    third[[EOS, STOP]] = -1e9
    assert out.token_ids[2] == int(third.argmax())
    assert out.token_ids[3] not in (EOS, STOP)
    assert out.token_ids[4] == EOS
    assert out.token_ids[5] == STOP
    # The random row never gets a banned token, whatever its uniform (EOS holds ~all the mass).
    for u in np.linspace(0.0, 1.0 - 1e-12, 25):
        md = SamplingMetadata.build([SamplingRow(SP(temperature=1.0, **p), [], uniform=float(u))], V, [EOS])
        assert sample(x[3:4], md).token_ids[0] not in (EOS, STOP)


def test_bans_never_empty_a_row():
    """A row whose only allowed tokens are banned (a finished grammar allows only EOS, under
    min_tokens; allowed_token_ids of stop ids) keeps them: it yields one of them, not token 0,
    which it never allowed. Other rows keep their bans."""
    V, EOS, STOP = 50, 5, 7
    x = rand_logits(4, V, seed=3)
    x[0] = float("-inf")
    x[0, EOS] = 1.0  # a grammar that is done: only EOS
    x[1] = float("-inf")
    x[1, [EOS, STOP]] = torch.tensor([1.0, 2.0])
    x[2, EOS] = x[2, STOP] = 100.0  # a normal row: the bans hold
    p = dict(min_tokens=3, stop_token_ids=[STOP])
    for temperature in (0.0, 1.0):
        rows = [SamplingRow(SP(temperature=temperature, **p), []) for _ in range(3)]
        rows.append(SamplingRow(SP(temperature=0.0), []))
        out = run(x, rows, eos=[EOS]).token_ids
        assert out[0] == EOS and out[1] in (EOS, STOP) and out[2] not in (EOS, STOP), out
        if temperature == 0.0:
            assert out[1] == STOP and out[3] == int(x[3].argmax())


def test_from_arrays_bans_are_row_token_pairs():
    # Scheduler-style columns: pairs can repeat rows, and ids outside the vocab are dropped.
    V = 10
    arrays = SamplingArrays.of_rows([SamplingRow(SP(temperature=0.0)) for _ in range(3)])
    arrays.banned_rows = np.array([0, 0, 2, 1], dtype=np.int64)
    arrays.banned_tokens = np.array([9, 8, 9, 12], dtype=np.int64)
    md = SamplingMetadata.from_arrays(arrays, V)
    assert sorted(zip(md.banned_rows.tolist(), md.banned_tokens.tolist())) == [(0, 8), (0, 9), (2, 9)]
    x = torch.arange(V, dtype=torch.float32).expand(3, V).contiguous()
    assert sample(x, md).token_ids.tolist() == [7, 9, 8]


def _mixed_rows(uniform=None):
    return [
        SamplingRow(SP(repetition_penalty=1.5, presence_penalty=1.0, top_p=0.5, min_p=0.1,
                       min_tokens=2, logprobs=2), [1, 2], [3], uniform),
        SamplingRow(SP(top_k=3), uniform=uniform),
        SamplingRow(SP(temperature=0.0, frequency_penalty=2.0, logprobs=1), [5, 5]),
        SamplingRow(SP(temperature=0.0)),
        SamplingRow(SP(temperature=0.5, frequency_penalty=-1.0), [7], [8], uniform),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "rows",
    [
        _mixed_rows(),
        _mixed_rows(uniform=0.3),
        # All greedy with penalties: argmax of the penalised rows.
        [SamplingRow(SP(temperature=0.0, repetition_penalty=2.0, presence_penalty=1.0), [1, 2], [3]),
         SamplingRow(SP(temperature=0.0)), SamplingRow(SP(temperature=0.0, frequency_penalty=1.0), [4])],
        # Every row penalised.
        [SamplingRow(SP(presence_penalty=1.0, min_tokens=3), [1, 2], [3]) for _ in range(5)],
    ],
    ids=["mixed", "mixed-uniform", "greedy-penalties", "all-penalised"],
)
def test_input_logits_not_modified(rows, dtype):
    # float32 logits: `.float()` returns the caller's tensor itself, so every later stage (bans,
    # penalties' index_copy, temperature) must be out of place.
    x = rand_logits(len(rows), 64, seed=8).to(dtype)
    x[:, 1:4] = 5.0  # the penalised / banned tokens are the likely ones: the stages must act
    before = x.clone()
    run(x, rows, eos=[0])
    assert torch.equal(x, before)
    md = SamplingMetadata.build(rows, 64, eos_token_ids=[0])
    sample_async(x, md, torch.Generator().manual_seed(0)).result()
    assert torch.equal(x, before)
    got = S._apply_penalties(x.float(), md) if md.penalty_rows is not None else None
    assert torch.equal(x, before)
    if got is not None and dtype == torch.float32:
        assert not torch.equal(got, x)  # the penalties did change something, in a copy


# --- given uniforms (the scheduler's per-row draws) ---------------------------------------------

# Rows of every kind to share a batch with: greedy, plain, truncated, penalised, min_tokens bans,
# logprobs; each with a given uniform or none (drawn from the sampler's generator).
OTHER_KINDS = [
    SP(), SP(temperature=0.0), SP(top_k=5), SP(top_p=0.5, temperature=1.3), SP(min_p=0.1),
    SP(presence_penalty=1.0, repetition_penalty=1.2), SP(min_tokens=4, stop_token_ids=[3, 4]),
    SP(logprobs=2, top_k=50, top_p=0.9), SP(temperature=0.0, frequency_penalty=0.5, logprobs=0),
    SP(top_k=2000, top_p=0.99), SP(temperature=0.3, min_p=0.3, top_k=7),
]


def _other_row(g: np.random.Generator, V: int) -> SamplingRow:
    params = OTHER_KINDS[int(g.integers(len(OTHER_KINDS)))]
    output = g.integers(0, V, size=int(g.integers(0, 6))).tolist()
    prompt = g.integers(0, V, size=int(g.integers(0, 6))).tolist()
    return SamplingRow(params, output, prompt, None if g.random() < 0.5 else float(g.random()))


@pytest.mark.parametrize(
    ("V", "params"),
    [
        (500, SP()),
        (500, SP(top_p=0.9, temperature=0.8)),
        (500, SP(top_k=20, top_p=0.8, min_p=0.02, temperature=1.5)),
        (500, SP(presence_penalty=0.7, frequency_penalty=0.3, repetition_penalty=1.3, top_p=0.95)),
        (500, SP(min_tokens=10, max_tokens=100, stop_token_ids=[1, 2], logprobs=3, top_k=40)),
        (40000, SP(top_p=0.95)),
        (40000, SP(temperature=0.7)),
    ],
    ids=["plain", "top_p", "top_k+top_p+min_p", "penalties", "bans+logprobs", "large-vocab-top_p",
         "large-vocab"],
)
def test_given_uniform_row_independent_of_batch(V, params):
    """A row's token depends on its logits, parameters and uniform only: alone, or at any place in
    batches of any size with rows of every kind (which change the stages the batch runs), and
    whatever the sampler's generator holds."""
    steps = 40 if V < 10000 else 6
    g = np.random.default_rng(V + len(str(params)))
    step_logits = rand_logits(steps, V, seed=21, scale=2.0)
    alone, crowded = [], []
    for step in range(steps):
        output = g.integers(0, V, size=step % 7).tolist()
        row = SamplingRow(params, output, g.integers(0, V, size=3).tolist(), float(g.random()))
        md = SamplingMetadata.build([row], V, eos_token_ids=[0])
        alone.append(int(sample(step_logits[step:step + 1], md).token_ids[0]))

        n = int(g.integers(0, 10 if V < 10000 else 5))
        others = [_other_row(g, V) for _ in range(n)]
        pos = int(g.integers(0, n + 1))
        rows = others[:pos] + [row] + others[pos:]
        extra = torch.randn(n, V, generator=torch.Generator().manual_seed(1000 + step)) * 3
        logits = torch.cat([extra[:pos], step_logits[step:step + 1], extra[pos:]])
        md = SamplingMetadata.build(rows, V, eos_token_ids=[0])
        crowded.append(int(Sampler(seed=step)(logits, md).token_ids[pos]))
    assert crowded == alone
    assert len(set(alone)) > 1  # actually random, not stuck on the argmax


def test_given_uniform_is_the_inverse_cdf_point():
    # Through the whole pipeline: token i is chosen iff u falls in [cdf[i-1], cdf[i]).
    V = 700
    probs = torch.zeros(V, dtype=torch.float64)
    probs[3], probs[300], probs[699] = 0.2, 0.3, 0.5
    x = probs.log().float().expand(6, V).contiguous()
    us = [0.0, 0.1999, 0.2001, 0.4999, 0.5001, 1.0 - 1e-12]
    md = SamplingMetadata.build([SamplingRow(SP(), uniform=u) for u in us], V)
    assert sample(x, md).token_ids.tolist() == [3, 3, 300, 300, 699, 699]


def test_given_uniforms_never_read_the_generator_and_nan_rows_follow_the_seed():
    R, V = 24, 100
    x = rand_logits(R, V, seed=9, scale=0.5)
    g = np.random.default_rng(3)
    kinds = [SP(), SP(top_k=10), SP(top_p=0.7), SP(min_p=0.05, temperature=0.8), SP(presence_penalty=1.0)]
    given = [i % 2 == 0 for i in range(R)]
    rows = [SamplingRow(kinds[i % 5], [1, 2], [3], float(g.random()) if given[i] else None) for i in range(R)]
    md = SamplingMetadata.build(rows, V)
    assert md.draw_missing
    a, b, c = (Sampler(seed=s)(x, md).token_ids for s in (1, 1, 2))
    advanced = torch.Generator().manual_seed(1)
    torch.rand(1000, generator=advanced)
    d = Sampler(generator=advanced)(x, md).token_ids
    e = sample(x, md).token_ids  # torch's global generator
    G, N = np.flatnonzero(given), np.flatnonzero(~np.array(given))
    for other in (b, c, d, e):
        assert np.array_equal(a[G], other[G])
    # Rows without a uniform draw theirs from the sampler's generator: its seed replays them.
    assert np.array_equal(a[N], b[N]) and not np.array_equal(a[N], c[N])
    # Unseeded rows sampled by themselves: the seed alone replays them too.
    only_nan = SamplingMetadata.build([rows[i] for i in N], V)
    f, h, k = (Sampler(seed=s)(x[N], only_nan).token_ids for s in (1, 1, 2))
    assert np.array_equal(f, h) and not np.array_equal(f, k)

    # A batch whose rows all have their uniform never draws: the generator is left untouched.
    all_given = SamplingMetadata.build([SamplingRow(kinds[i % 5], [1], [2], float(g.random())) for i in range(R)], V)
    assert not all_given.draw_missing
    gen = torch.Generator().manual_seed(5)
    state = gen.get_state()
    sample(x, all_given, gen)
    assert torch.equal(gen.get_state(), state)


def test_uniform_column_from_rows():
    arrays = SamplingArrays.of_rows([SamplingRow(SP(), uniform=0.25), SamplingRow(SP()),
                                     SamplingRow(SP(temperature=0.0), uniform=0.5)])
    assert arrays.row_uniform.dtype == np.float64
    assert arrays.row_uniform[0] == 0.25 and math.isnan(arrays.row_uniform[1]) and arrays.row_uniform[2] == 0.5
    md = SamplingMetadata.from_arrays(arrays, 10)
    assert md.uniforms.dtype == torch.float64 and md.draw_missing


def _flags_only(R: int) -> SimpleNamespace:
    """An all-greedy step with no penalty, ban or logprobs: the flags and nothing per row."""
    return SimpleNamespace(num_rows=R, num_greedy_rows=R, max_top_k=0, any_top_p=False, any_min_p=False,
                           any_penalties=False, any_logprobs=False, banned_rows=np.zeros(0, np.int64),
                           banned_tokens=np.zeros(0, np.int64))


def test_all_greedy_batch_builds_no_tensors(monkeypatch):
    R, V = 7, 50
    x = rand_logits(R, V, seed=12)

    def no_tensors(*a, **k):
        raise AssertionError("from_arrays built a tensor for an all-greedy batch")

    # Greedy rows with uniforms, top_k and min_p given (reset by SamplingParams) change nothing.
    rows = [SamplingRow(SP(temperature=0.0, top_k=3, min_p=0.5), uniform=0.5) for _ in range(R)]
    arrays = SamplingArrays.of_rows(rows)
    with monkeypatch.context() as m:
        m.setattr(torch, "from_numpy", no_tensors)
        m.setattr(torch, "tensor", no_tensors)
        mds = [SamplingMetadata.from_arrays(_flags_only(R), V),  # no row_* column to read
               SamplingMetadata.from_arrays(arrays, V)]
    for md in mds:
        assert md.all_greedy and not md.all_random and md.num_rows == R and md.device == torch.device("cpu")
        assert md.temperature is None and md.top_k is None and md.uniforms is None and md.greedy is None
        assert md.top_p is None and md.min_p is None and md.max_top_k == 0 and not md.draw_missing
        assert md.penalty_rows is None and md.output_counts is None and md.seen_mask is None
        assert md.banned_rows is None and md.logprob_rows is None and md.num_top_logprobs is None
        gen = torch.Generator().manual_seed(0)
        state = gen.get_state()
        out = sample(x, md, gen)
        assert np.array_equal(out.token_ids, x.argmax(-1).numpy()) and out.logprobs is None
        assert torch.equal(gen.get_state(), state)


@pytest.mark.parametrize("kind", ["mixed", "all-greedy", "all-random"])
def test_sample_async_result_equals_sample(kind):
    R, V = 10, 120
    x = rand_logits(R, V, seed=13, scale=1.0)
    if kind == "mixed":
        rows = [SamplingRow(OTHER_KINDS[i % len(OTHER_KINDS)], [1, 5], [2], None if i % 3 else 0.1 * i)
                for i in range(R)]
    elif kind == "all-greedy":
        rows = [SamplingRow(SP(temperature=0.0, logprobs=i % 3, repetition_penalty=1.5), [i]) for i in range(R)]
    else:
        rows = [SamplingRow(SP(top_p=0.8, logprobs=1)) for _ in range(R)]
    md = SamplingMetadata.build(rows, V, eos_token_ids=[3])
    pending = Sampler(seed=4).sample_async(x, md)
    assert isinstance(pending, SampledTokens)
    assert isinstance(pending.token_ids, torch.Tensor) and pending.token_ids.device == x.device
    got, want = pending.result(), Sampler(seed=4)(x, md)
    assert got.token_ids.dtype == np.int64 and np.array_equal(got.token_ids, want.token_ids)
    assert np.array_equal(sample_async(x, md, torch.Generator().manual_seed(4)).result().token_ids,
                          want.token_ids)
    assert (got.logprobs is None) == (want.logprobs is None)
    if want.logprobs is not None:
        for field in ("rows", "sampled_logprobs", "sampled_ranks", "top_ids", "top_logprobs", "num_top"):
            assert np.array_equal(getattr(got.logprobs, field), getattr(want.logprobs, field)), field
        assert got.logprobs.top_ids.dtype == np.int32


# --- distribution -------------------------------------------------------------------------------

DISTRIBUTIONS = [
    (SP(), [0.5, 0.25, 0.15, 0.1, 0.0]),
    (SP(temperature=0.5), np.array([0.5, 0.25, 0.15, 0.1, 0.0]) ** 2),
    (SP(top_k=2), [2 / 3, 1 / 3, 0, 0, 0]),
    (SP(top_p=0.8), [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0, 0]),
    (SP(min_p=0.25), [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0, 0]),
]
DIST_IDS = ["T=1", "T=0.5", "top_k=2", "top_p=0.8", "min_p=0.25"]


@pytest.mark.parametrize(("params", "expected"), DISTRIBUTIONS, ids=DIST_IDS)
def test_empirical_distribution(params, expected):
    base = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0]).log()
    draws = 4000
    x = base.expand(draws, 5).contiguous()
    toks = run(x, [SamplingRow(params)] * draws, seed=2024).token_ids
    freq = np.bincount(toks, minlength=5) / draws
    expected = np.asarray(expected, dtype=np.float64)
    expected = expected / expected.sum()
    np.testing.assert_allclose(freq, expected, atol=0.03)
    assert freq[4] == 0.0  # zero-probability token never sampled


@pytest.mark.parametrize(("params", "expected"), DISTRIBUTIONS, ids=DIST_IDS)
def test_stratified_uniforms_give_the_exact_distribution(params, expected):
    # Evenly spaced uniforms: each token's share is its probability to within one draw.
    base = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0]).log()
    draws = 4000
    x = base.expand(draws, 5).contiguous()
    rows = [SamplingRow(params, uniform=(i + 0.5) / draws) for i in range(draws)]
    toks = run(x, rows, seed=None).token_ids
    freq = np.bincount(toks, minlength=5) / draws
    expected = np.asarray(expected, dtype=np.float64)
    np.testing.assert_allclose(freq, expected / expected.sum(), atol=1.5 / draws)
    assert np.all(np.diff(toks) >= 0)  # increasing u -> non-decreasing token (inverse CDF)


def test_inverse_cdf_sampler_exactness():
    # Blocks, padding (V not a multiple of 256) and zero-mass blocks: u maps to the right token.
    V = 700
    probs = torch.zeros(1, V)
    probs[0, 3], probs[0, 300], probs[0, 699] = 0.2, 0.3, 0.5
    for u, want in [(0.0, 3), (0.1999, 3), (0.2001, 300), (0.4999, 300), (0.5001, 699),
                    (1.0 - 1e-12, 699)]:
        tok = S._inverse_cdf_sample(probs, torch.tensor([u], dtype=torch.float64))
        assert int(tok) == want, (u, int(tok))
    # A tail token worth 1e-9 of the mass after 150k others keeps its own interval.
    V = 150_000
    probs = torch.full((1, V), 1.0)
    probs[0, -1] = 150_000 * 1e-9
    total = 150_000 + 150_000 * 1e-9
    u = torch.tensor([(150_000 + 0.5 * 150_000 * 1e-9) / total], dtype=torch.float64)
    assert int(S._inverse_cdf_sample(probs, u)) == V - 1


# --- logprobs -----------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax():
    R, V = 6, 80
    x = rand_logits(R, V, seed=10)
    rows = [
        SamplingRow(SP(logprobs=3, temperature=0.5, repetition_penalty=1.5), [1, 2]),
        SamplingRow(SP()),  # no logprobs
        SamplingRow(SP(logprobs=0, temperature=0.0)),
        SamplingRow(SP(logprobs=5, top_k=3)),
        SamplingRow(SP()),
        SamplingRow(SP(logprobs=1, seed=3), uniform=0.7),
    ]
    out = run(x, rows)
    lp = out.logprobs
    assert lp is not None
    assert lp.rows.tolist() == [0, 2, 3, 5]
    assert lp.num_top.tolist() == [3, 0, 5, 1]
    ref = torch.log_softmax(x, -1)
    torch.testing.assert_close(compute_logprobs(x), ref)
    for j, r in enumerate(lp.rows):
        tok = int(out.token_ids[r])
        assert lp.sampled_logprobs[j] == pytest.approx(float(ref[r, tok]), abs=1e-6)
        assert lp.sampled_ranks[j] == int((ref[r] >= ref[r, tok]).sum())
        k = int(lp.num_top[j])
        vals, ids = ref[r].topk(k)
        assert lp.top_ids[j, :k].tolist() == ids.tolist()
        np.testing.assert_allclose(lp.top_logprobs[j, :k], vals.numpy(), atol=1e-6)
    # Greedy row: sampled token is the top-1.
    assert lp.sampled_ranks[1] == 1
    # Raw: the penalised row's numbers are the model's, not the penalised ones.
    assert lp.top_ids[0, 0] == int(ref[0].argmax())


def test_tied_logprobs_rank_as_vllm():
    """Two tokens tie for the top: the sampled one's rank counts the tokens at least as likely
    (2), and in an entry with top-k alternatives it takes its top-k position, so the entry's
    ranks are 1..k with no repeat (vLLM's ranks)."""
    from ferrokv.outputs import make_logprobs_entry

    x = torch.zeros(2, 10)
    x[:, [3, 6]] = 5.0
    out = run(x, [SamplingRow(SP(logprobs=0, temperature=0.0)), SamplingRow(SP(logprobs=3, temperature=0.0))])
    lp = out.logprobs
    assert lp.sampled_ranks.tolist() == [2, 2] and int(out.token_ids[1]) in (3, 6)
    k = int(lp.num_top[1])
    entry = make_logprobs_entry(int(out.token_ids[1]), float(lp.sampled_logprobs[1]), int(lp.sampled_ranks[1]),
                                lp.top_ids[1, :k], lp.top_logprobs[1, :k])
    assert sorted(e.rank for e in entry.values()) == [1, 2, 3]
    assert next(iter(entry)) == int(out.token_ids[1])  # the sampled token stays first


def test_build_ignores_out_of_range_ids():
    # Histories or stop ids beyond the logits width (padded vocab) are ignored, not errors.
    rows = [SamplingRow(SP(min_tokens=4, stop_token_ids=[5, 500], presence_penalty=1.0,
                           repetition_penalty=1.2), [3, 999, -1], [1000, -5])]
    md = SamplingMetadata.build(rows, 10, eos_token_ids=[9, 77])
    assert md.banned_tokens.tolist() and set(md.banned_tokens.tolist()) == {5, 9}
    assert md.output_counts[0].sum() == 1 and md.output_counts[0, 3] == 1
    assert md.seen_mask[0].nonzero().squeeze(1).tolist() == [3]
    # Sampling with them: flat logits, so the banned ids never come, token 3 (presence penalty:
    # logit -1, p = 0.05) comes less often than each of the other seven (p = 0.136).
    draws = 700
    md = SamplingMetadata.build(rows * draws, 10, eos_token_ids=[9, 77])
    counts = np.bincount(Sampler(seed=0)(torch.zeros(draws, 10), md).token_ids, minlength=10)
    assert counts[5] == counts[9] == 0
    others = [counts[t] for t in (0, 1, 2, 4, 6, 7, 8)]
    assert 0 < counts[3] < min(others), counts


# --- devices --------------------------------------------------------------------------------------


def test_check_same_device_names_both_sides():
    from ferrokv.checks import DeviceMismatchError, check_same_device

    check_same_device("a", torch.device("cpu"), "b", "cpu")
    with pytest.raises(DeviceMismatchError, match=r"the generator is on cpu but the tensor is on meta"):
        check_same_device("the generator", torch.device("cpu"), "the tensor", torch.device("meta"))


def test_sampler_refuses_a_generator_on_another_device():
    """The shared generator must be where the logits are (a CPU generator with CUDA logits was the
    engine's bug); `meta` logits stand in for a second device."""
    from ferrokv.checks import DeviceMismatchError

    md = SamplingMetadata.build([SamplingRow(SP()), SamplingRow(SP(), uniform=0.5)], 10, device="meta")
    assert md.device == torch.device("meta") and md.uniforms.device.type == "meta"
    with pytest.raises(DeviceMismatchError, match=r"sampler's generator is on cpu but the logits tensor is on meta"):
        Sampler(seed=1)(torch.zeros(2, 10, device="meta"), md)


def test_sampler_refuses_metadata_on_another_device():
    from ferrokv.checks import DeviceMismatchError

    for rows in ([SamplingRow(SP(temperature=0.0))], [SamplingRow(SP(), uniform=0.5)]):
        md = SamplingMetadata.build(rows, 10, device="meta")
        assert md.device == torch.device("meta")
        with pytest.raises(DeviceMismatchError, match=r"sampling metadata is on meta but the logits tensor is on cpu"):
            Sampler(seed=1)(torch.zeros(1, 10), md)


def test_gpu_check_sampling_logic_runs_on_cpu():
    """benches/gpu_check.py's sampling check (rows with given uniforms, rows drawing from the
    sampler's generator, greedy rows in one batch) is right on the CPU, so on a GPU only the device
    can make it fail."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benches" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    report = gpu_check.sampling_check("cpu")
    assert report["ok"], report


def test_top_k_keeps_every_token_tied_with_the_kth_with_or_without_top_p_and_alone_or_in_a_batch():
    """Ties with the k-th value are all kept (vLLM's), and top-p then works over all of them: with
    top-p set on the row, and when another row's top-p sends the batch through the candidates
    (ties past the 512 candidates must not be cut there)."""
    V, N = 3000, 400
    flat = torch.zeros(1, V)  # every token tied: top_k=7 keeps all 3000
    us = (np.arange(N) + 0.5) / N

    def tokens(params, with_top_p_row):
        rows = [SamplingRow(params, uniform=float(u)) for u in us]
        x = flat.expand(N, V)
        if with_top_p_row:
            rows.append(SamplingRow(SP(top_p=0.9), uniform=0.5))
            x = torch.cat([x, rand_logits(1, V, seed=2)])
        return sample(x, SamplingMetadata.build(rows, V)).token_ids[:N]

    alone = tokens(SP(top_k=7), False)
    assert len(np.unique(alone)) > 300 and alone.max() > 2000  # spread over the whole tie
    assert np.array_equal(tokens(SP(top_k=7), True), alone)  # another row's top-p changes nothing
    assert np.array_equal(tokens(SP(top_k=7, top_p=1.0), True), alone)
    nucleus = tokens(SP(top_k=7, top_p=0.9), False)
    assert nucleus.max() > 2000 and len(np.unique(nucleus)) > 300  # top-p over the tie, not over 7
    # Small vocabulary: top_k=2 with the 2nd value tied three ways keeps all four, top_p or not.
    x = torch.tensor([[5.0, 4.0, 4.0, 4.0, 1.0, 0.0]])
    for params in (SP(top_k=2), SP(top_k=2, top_p=0.95)):
        md = SamplingMetadata.build([SamplingRow(params, uniform=u) for u in (0.5, 0.7, 0.9)], 6)
        assert sorted(sample(x.expand(3, 6), md).token_ids.tolist()) == [1, 2, 3], params
