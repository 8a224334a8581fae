"""Vectorised sampler: truncation, penalties, min_tokens, seeding, distribution, logprobs.

Every random draw here comes from a seeded generator, so the statistical tests are deterministic.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ferrokv import sampler as S
from ferrokv.sampler import (
    Sampler,
    SamplingMetadata,
    SamplingRow,
    compute_logprobs,
    make_generator,
    seed_for_sample,
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
    assert out.token_ids.dtype == np.int32
    assert np.array_equal(out.token_ids, x.argmax(-1).numpy())
    assert out.token_ids[3] == 7


@pytest.mark.parametrize(
    "params",
    [SP(top_k=1), SP(top_p=1e-6), SP(min_p=1.0), SP(top_k=1, top_p=0.5, temperature=2.0)],
    ids=["top_k=1", "top_p=1e-6", "min_p=1", "top_k=1+top_p"],
)
def test_degenerate_truncation_equals_greedy(params):
    x = rand_logits(64, 700, seed=1)
    out = run(x, [SamplingRow(params) for _ in range(64)])
    assert np.array_equal(out.token_ids, x.argmax(-1).numpy())


def test_mixed_greedy_and_random_rows():
    x = rand_logits(32, 200, seed=2)
    rows = [SamplingRow(SP(temperature=0.0 if i % 2 else 1.0, top_k=1 if i % 4 == 0 else 0))
            for i in range(32)]
    out = run(x, rows)
    # Odd rows greedy, rows divisible by 4 use top_k=1: both must equal argmax.
    for i in range(32):
        if i % 2 or i % 4 == 0:
            assert out.token_ids[i] == int(x[i].argmax())


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


def test_top_p_candidate_and_fallback_paths_agree_on_kept_probs():
    # One peaked row (nucleus within the candidates) and one flat row (fallback) in one batch:
    # the filtered probabilities must equal the reference's for both.
    V = 2000
    x = torch.cat([rand_logits(1, V, seed=4, scale=4.0), rand_logits(1, V, seed=5, scale=0.2)])
    probs = torch.softmax(x, -1)
    top_p = torch.tensor([0.9, 0.9])
    out = S._apply_top_k_top_p(probs, None, top_p)
    for r in range(2):
        support = reference_support(probs[r], 0, 0.9, 0.0)
        kept = set(torch.nonzero(out[r]).squeeze(1).tolist())
        assert kept == support
        assert torch.equal(out[r][list(kept)], probs[r][list(kept)])
    assert len(reference_support(probs[1], 0, 0.9, 0.0)) > S._TOP_P_CANDIDATES


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
    got = S._apply_penalties(x.clone(), md)
    torch.testing.assert_close(got, torch.stack(refs), rtol=1e-6, atol=1e-5)

    # End to end through greedy: argmax of the penalised logits.
    greedy_rows = [SamplingRow(SP(temperature=0.0, presence_penalty=r.params.presence_penalty,
                                  frequency_penalty=r.params.frequency_penalty,
                                  repetition_penalty=r.params.repetition_penalty),
                               r.output_token_ids, r.prompt_token_ids) for r in rows]
    out = run(x, greedy_rows)
    assert np.array_equal(out.token_ids, torch.stack(refs).argmax(-1).numpy())


def test_repetition_penalty_discourages_repeats():
    x = torch.zeros(1, 10)
    x[0, 3], x[0, 5] = 2.0, 1.9
    row = SamplingRow(SP(temperature=0.0, repetition_penalty=1.3), output_token_ids=[3])
    assert run(x, [row]).token_ids[0] == 5
    row = SamplingRow(SP(temperature=0.0, repetition_penalty=1.3), prompt_token_ids=[3])
    assert run(x, [row]).token_ids[0] == 5  # prompt tokens count too


def test_min_tokens_masks_eos_and_stop_ids():
    V, EOS, STOP = 50, 0, 7
    x = rand_logits(6, V, seed=7)
    x[:, EOS] = 100.0
    x[:, STOP] = 90.0
    p = dict(min_tokens=3, stop_token_ids=[STOP])
    rows = [
        SamplingRow(SP(temperature=0.0, **p), [1, 2]),  # 2 < 3: EOS and STOP masked
        SamplingRow(SP(temperature=0.0, **p), [1, 2, 3]),  # reached: EOS allowed
        SamplingRow(SP(temperature=0.0, ignore_eos=True, **p), [1]),  # EOS not a stop: unmasked
        SamplingRow(SP(temperature=1.0, **p), []),  # random row: masked tokens never sampled
        SamplingRow(SP(temperature=0.0), []),  # no min_tokens
        SamplingRow(SP(temperature=0.0, min_tokens=1), [], ),  # only EOS masked -> STOP
    ]
    out = run(x, rows, eos=[EOS])
    rest = x[0].clone()
    rest[[EOS, STOP]] = -1e9
    assert out.token_ids[0] == int(rest.argmax())
    assert out.token_ids[1] == EOS
    assert out.token_ids[2] == EOS
    assert out.token_ids[3] not in (EOS, STOP)
    assert out.token_ids[4] == EOS
    assert out.token_ids[5] == STOP


def test_input_logits_not_modified():
    x = rand_logits(4, 64, seed=8)
    before = x.clone()
    rows = [SamplingRow(SP(repetition_penalty=1.5, presence_penalty=1.0, top_p=0.5, min_p=0.1,
                           min_tokens=2, logprobs=2), [1, 2], [3])] * 4
    run(x, rows, eos=[0])
    assert torch.equal(x, before)


# --- seeding ------------------------------------------------------------------------------------


def _seeded_stream(row_params, seed, steps_logits, others, sample_index=0):
    """Tokens of one seeded sequence over several steps, with `others(step)` rows appended."""
    gen = make_generator(seed, sample_index)
    toks = []
    shared = Sampler(seed=999)
    for step, logits_row in enumerate(steps_logits):
        extra_logits, extra_rows = others(step)
        logits = torch.cat([extra_logits[:1], logits_row[None], extra_logits[1:]])
        rows = extra_rows[:1] + [SamplingRow(row_params, generator=gen)] + extra_rows[1:]
        md = SamplingMetadata.build(rows, logits.shape[1])
        toks.append(int(shared(logits, md).token_ids[min(1, len(extra_rows))]))
    return toks


@pytest.mark.parametrize(
    ("V", "params"),
    [(500, SP(seed=11)), (500, SP(seed=12, top_p=0.9, temperature=0.8)),
     (40000, SP(seed=13, top_p=0.95))],
    ids=["plain", "top_p", "large-vocab"],
)
def test_seeded_row_independent_of_batch(V, params):
    steps = 60 if V < 10000 else 8
    step_logits = rand_logits(steps, V, seed=21, scale=2.0)
    alone = _seeded_stream(params, params.seed, step_logits,
                           lambda s: (torch.empty(0, V), []))

    def crowd(step):
        n = 1 + step % 5  # batch composition changes every step
        g = torch.Generator().manual_seed(1000 + step)
        extra = torch.randn(n, V, generator=g) * 3
        kinds = [SP(), SP(temperature=0.0), SP(top_k=5), SP(seed=77, top_p=0.5), SP(min_p=0.1)]
        rows = [SamplingRow(kinds[i % 5], generator=make_generator(77, i) if i % 5 == 3 else None)
                for i in range(n)]
        return extra, rows

    assert _seeded_stream(params, params.seed, step_logits, crowd) == alone
    assert len(set(alone)) > 1  # actually random, not stuck on argmax


def test_n_samples_with_one_seed_differ_and_reproduce():
    V, steps = 300, 40
    step_logits = rand_logits(steps, V, seed=31, scale=1.0)
    none = lambda s: (torch.empty(0, V), [])  # noqa: E731
    params = SP(seed=5, n=3)
    streams = [_seeded_stream(params, 5, step_logits, none, i) for i in range(3)]
    assert len({tuple(s) for s in streams}) == 3
    assert streams == [_seeded_stream(params, 5, step_logits, none, i) for i in range(3)]
    assert len({seed_for_sample(5, i) for i in range(100)}) == 100
    assert seed_for_sample(0, 1) != seed_for_sample(1, 0)


def test_seeded_row_requires_generator():
    with pytest.raises(ValueError, match="generator"):
        SamplingMetadata.build([SamplingRow(SP(seed=1))], 10)
    # Greedy rows never draw, so they need none.
    SamplingMetadata.build([SamplingRow(SP(seed=1, temperature=0.0))], 10)


def test_unseeded_rows_follow_sampler_seed():
    x = rand_logits(16, 100, seed=9, scale=0.5)
    rows = [SamplingRow(SP()) for _ in range(16)]
    a, b, c = (run(x, rows, seed=s).token_ids for s in (1, 1, 2))
    assert np.array_equal(a, b) and not np.array_equal(a, c)


# --- distribution -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SP(), [0.5, 0.25, 0.15, 0.1, 0.0]),
        (SP(temperature=0.5), np.array([0.5, 0.25, 0.15, 0.1, 0.0]) ** 2),
        (SP(top_k=2), [2 / 3, 1 / 3, 0, 0, 0]),
        (SP(top_p=0.8), [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0, 0]),
        (SP(min_p=0.25), [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0, 0]),
    ],
    ids=["T=1", "T=0.5", "top_k=2", "top_p=0.8", "min_p=0.25"],
)
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


def test_inverse_cdf_sampler_exactness():
    # Blocks, padding (V not a multiple of 256) and zero-mass blocks: u maps to the right token.
    V = 700
    probs = torch.zeros(1, V)
    probs[0, 3], probs[0, 300], probs[0, 699] = 0.2, 0.3, 0.5
    for u, want in [(0.0, 3), (0.1999, 3), (0.2001, 300), (0.4999, 300), (0.5001, 699),
                    (1.0 - 1e-12, 699)]:
        tok = S._inverse_cdf_sample(probs, torch.tensor([u], dtype=torch.float64))
        assert int(tok) == want, (u, int(tok))


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
        SamplingRow(SP(logprobs=1, seed=3), generator=make_generator(3)),
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
        assert lp.sampled_ranks[j] == int((ref[r] > ref[r, tok]).sum()) + 1
        k = int(lp.num_top[j])
        vals, ids = ref[r].topk(k)
        assert lp.top_ids[j, :k].tolist() == ids.tolist()
        np.testing.assert_allclose(lp.top_logprobs[j, :k], vals.numpy(), atol=1e-6)
    # Greedy row: sampled token is the top-1.
    assert lp.sampled_ranks[1] == 1


def test_build_ignores_out_of_range_ids():
    # Histories or stop ids beyond the logits width (padded vocab) are ignored, not errors.
    rows = [SamplingRow(SP(min_tokens=3, stop_token_ids=[5, 500], presence_penalty=1.0,
                           repetition_penalty=1.2), [3, 999], [1000])]
    md = SamplingMetadata.build(rows, 10, eos_token_ids=[9, 77])
    assert md.banned_tokens.tolist() and set(md.banned_tokens.tolist()) == {5, 9}
    assert md.output_counts[0].sum() == 1
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

    md = SamplingMetadata.build([SamplingRow(SP())], 10, device="meta")
    with pytest.raises(DeviceMismatchError, match=r"sampler's generator is on cpu but the logits tensor is on meta"):
        Sampler(seed=1)(torch.zeros(1, 10, device="meta"), md)


def test_sampler_refuses_metadata_on_another_device():
    from ferrokv.checks import DeviceMismatchError

    md = SamplingMetadata.build([SamplingRow(SP(temperature=0.0))], 10, device="meta")
    with pytest.raises(DeviceMismatchError, match=r"sampling metadata is on meta but the logits tensor is on cpu"):
        Sampler(seed=1)(torch.zeros(1, 10), md)


def test_gpu_check_sampling_logic_runs_on_cpu():
    """benches/gpu_check.py's sampling check (unseeded, seeded and greedy rows in one batch) is
    right on the CPU, so on a GPU only the device can make it fail."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benches" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    report = gpu_check.sampling_check("cpu")
    assert report["ok"], report
