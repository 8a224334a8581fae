"""Prompt logprobs (``SamplingParams.prompt_logprobs``, ``ferrokv.prompt_logprobs``): one entry
per prompt token (``None`` for the first), each holding the token's logprob given the tokens
before it, with its rank, and the ``k`` most likely alternatives, equal to transformers' full
forward pass; computed at every position whatever the chunking, block size, overlap or
preemption, never from the prefix cache; CUMULATIVE / DELTA / FINAL_ONLY outputs carry them as
vLLM does. Tiny llama, CPU, fp32.
"""
from __future__ import annotations

import pytest
import torch

from ferrokv import SamplingParams
from ferrokv.outputs import RequestOutputKind
from helpers.engine_faults import assert_idle, rand_prompts, run_requests, tiny_engine

TOL = 1e-4


@pytest.fixture(scope="module")
def engine(llama_path):
    return tiny_engine(llama_path)


@pytest.fixture(scope="module")
def reference(llama_path, hf_model):
    """``reference(prompt_ids)`` -> transformers' log_softmax ``[len - 1, V]``: row i predicts token i + 1."""
    model = hf_model(llama_path)
    memo: dict[tuple[int, ...], torch.Tensor] = {}

    def lp(ids) -> torch.Tensor:
        key = tuple(ids)
        if key not in memo:
            with torch.no_grad():
                logits = model(torch.tensor([list(ids)])).logits[0].float()
            memo[key] = torch.log_softmax(logits, dim=-1)[:-1]
        return memo[key]

    return lp


def params(k: int | None = 3, **kw) -> SamplingParams:
    base = dict(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=k)
    base.update(kw)
    return SamplingParams(**base)


def run(engine, requests):
    """(final outputs by id, every output by id); the engine left idle."""
    final, every = run_requests(engine, requests)
    assert_idle(engine)
    assert len(engine._plp_wanted) == 0  # no request left waiting for prompt positions
    return final, every


def check_against(reference, prompt_ids: list[int], plp, k: int) -> None:
    """``plp`` equals the reference: one entry per prompt token, the token's own logprob and rank
    and the top-k alternatives with ranks 1..k."""
    assert plp is not None and len(plp) == len(prompt_ids), (None if plp is None else len(plp), len(prompt_ids))
    assert plp[0] is None
    ref = reference(prompt_ids)
    for i in range(1, len(prompt_ids)):
        entry, row, tok = plp[i], ref[i - 1], prompt_ids[i]
        top_lp, top_ids = row.topk(k) if k else (row[:0], torch.zeros(0, dtype=torch.int64))
        want = {int(t): (float(v), r + 1) for r, (t, v) in enumerate(zip(top_ids.tolist(), top_lp.tolist()))}
        want.setdefault(tok, (float(row[tok]), int((row > row[tok]).sum()) + 1))
        assert set(entry) == set(want), (i, sorted(entry), sorted(want))
        assert next(iter(entry)) == tok, "the prompt token comes first"
        for t, (v, rank) in want.items():
            assert entry[t].logprob == pytest.approx(v, abs=TOL), (i, t)
            assert entry[t].rank == rank, (i, t, entry[t].rank, rank)
            assert entry[t].decoded_token is not None


LENGTHS = [23, 9, 2, 37, 14]

CONFIGS = {
    "default": dict(),
    "chunked-block4": dict(block_size=4, max_num_batched_tokens=8, max_num_seqs=4),
    "block16": dict(block_size=16, num_kv_blocks=32),
    "overlap": dict(overlap=True),
    "overlap-chunked": dict(overlap=True, block_size=4, max_num_batched_tokens=8, max_num_seqs=4),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_matches_transformers(llama_path, reference, config):
    prompts = rand_prompts(4, LENGTHS)
    ks = [3, 1, 5, 2, 0]
    eng = tiny_engine(llama_path, **CONFIGS[config])
    final, _ = run(eng, [(str(i), p, params(k)) for i, (p, k) in enumerate(zip(prompts, ks))]
                   + [("none", prompts[0], params(None))])
    for i, (p, k) in enumerate(zip(prompts, ks)):
        check_against(reference, p["prompt_token_ids"], final[str(i)].prompt_logprobs, k)
    assert final["none"].prompt_logprobs is None


def test_generation_is_unchanged_by_prompt_logprobs(engine):
    prompts = rand_prompts(5, [17, 6])
    with_plp, _ = run(engine, [(str(i), p, params(4, max_tokens=8)) for i, p in enumerate(prompts)])
    without, _ = run(engine, [(str(i), p, params(None, max_tokens=8)) for i, p in enumerate(prompts)])
    for i in range(len(prompts)):
        assert with_plp[str(i)].outputs[0].token_ids == without[str(i)].outputs[0].token_ids


def test_never_served_from_the_prefix_cache(llama_path, reference):
    eng = tiny_engine(llama_path, enable_prefix_caching=True, block_size=4)
    prompt = rand_prompts(6, [26])[0]
    ids = prompt["prompt_token_ids"]
    run(eng, [("warm", prompt, params(None))])
    hit, _ = run(eng, [("hit", prompt, params(None))])
    assert hit["hit"].num_cached_tokens > 0, "the cache is warm: a plain request hits it"
    for rid in ("plp1", "plp2"):
        got, _ = run(eng, [(rid, prompt, params(2))])
        assert got[rid].num_cached_tokens == 0
        check_against(reference, ids, got[rid].prompt_logprobs, 2)
    # Both at once, with a plain request sharing the prompt.
    got, _ = run(eng, [("a", prompt, params(2)), ("b", prompt, params(None)), ("c", prompt, params(1))])
    assert got["a"].num_cached_tokens == 0 and got["c"].num_cached_tokens == 0
    assert got["b"].num_cached_tokens > 0
    check_against(reference, ids, got["a"].prompt_logprobs, 2)
    check_against(reference, ids, got["c"].prompt_logprobs, 1)


def test_prompt_of_one_token(engine, reference):
    one = {"prompt_token_ids": [57]}
    other = rand_prompts(7, [12])[0]
    final, every = run(engine, [("one", one, params(3, output_kind=RequestOutputKind.DELTA)),
                                ("other", other, params(3))])
    assert every["one"][0].prompt_logprobs == [None]
    assert all(not o.prompt_logprobs for o in every["one"][1:])
    final, _ = run(engine, [("one", one, params(3))])
    assert final["one"].prompt_logprobs == [None]
    check_against(reference, other["prompt_token_ids"], run(engine, [("o", other, params(3))])[0]["o"].prompt_logprobs, 3)


def test_n2(engine, reference):
    prompt = rand_prompts(8, [19])[0]
    final, _ = run(engine, [("r", prompt, params(2, n=2, temperature=1.0, seed=4, max_tokens=6))])
    assert len(final["r"].outputs) == 2
    check_against(reference, prompt["prompt_token_ids"], final["r"].prompt_logprobs, 2)


def test_k0_gives_only_the_prompt_tokens(engine, reference):
    prompt = rand_prompts(9, [15])[0]
    plp = run(engine, [("r", prompt, params(0))])[0]["r"].prompt_logprobs
    ids = prompt["prompt_token_ids"]
    assert [list(e) for e in plp[1:]] == [[t] for t in ids[1:]]
    check_against(reference, ids, plp, 0)


@pytest.mark.parametrize("overlap", [False, True], ids=["overlap-off", "overlap-on"])
@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_output_kinds(llama_path, reference, overlap, chunked):
    kw = dict(block_size=4, max_num_batched_tokens=8, max_num_seqs=4) if chunked else {}
    eng = tiny_engine(llama_path, overlap=overlap, **kw)
    prompt = rand_prompts(10, [21])[0]
    ids = prompt["prompt_token_ids"]
    final, every = run(eng, [(kind.name, prompt, params(2, max_tokens=5, output_kind=kind))
                             for kind in RequestOutputKind])
    full = final["FINAL_ONLY"].prompt_logprobs
    check_against(reference, ids, full, 2)
    assert len(every["FINAL_ONLY"]) == 1
    cumulative = every["CUMULATIVE"]
    assert len(cumulative) == 5  # one output per generated token
    for o in cumulative:
        check_against(reference, ids, o.prompt_logprobs, 2)
    delta = every["DELTA"]
    assert len(delta) == 5
    joined = [e for o in delta for e in (o.prompt_logprobs or [])]
    check_against(reference, ids, joined, 2)
    check_against(reference, ids, delta[0].prompt_logprobs, 2)  # the first output carries them all
    assert all(not o.prompt_logprobs for o in delta[1:]), "later ones carry nothing twice"


@pytest.mark.parametrize("value", [-2, 1.5, "2", False, 2.0, [2]])  # (True is vLLM's 1)
def test_bad_values_name_the_field(value):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)


def test_bad_value_assigned_later_is_refused_at_add_request(engine):
    p = SamplingParams()
    p.prompt_logprobs = -2
    with pytest.raises(ValueError, match="prompt_logprobs"):
        engine.add_request("x", rand_prompts(0, [5])[0], p)
    assert_idle(engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_under_preemption(llama_path, reference, mode):
    """Crowded: sequences are preempted (recompute: their prompt is computed again) and prefills
    are chunked; each request's list has exactly one entry per prompt token, equal to the
    reference."""
    kw = dict(block_size=4, num_kv_blocks=32, max_num_batched_tokens=16, preemption_mode=mode)
    if mode == "swap":
        kw["num_cpu_blocks"] = 64
    eng = tiny_engine(llama_path, **kw)
    prompts = rand_prompts(11, [30, 25, 18, 33, 12, 27])
    final, every = run(eng, [(str(i), p, params(2, n=1 + i % 2, temperature=1.0, seed=i, max_tokens=20,
                                                output_kind=RequestOutputKind(i % 3)))
                             for i, p in enumerate(prompts)])
    stats = eng.stats()
    assert stats[f"{mode}_preemptions"] > 0, stats
    for i, p in enumerate(prompts):
        rid = str(i)
        plp = final[rid].prompt_logprobs
        if RequestOutputKind(i % 3) == RequestOutputKind.DELTA:
            plp = [e for o in every[rid] for e in (o.prompt_logprobs or [])]
        check_against(reference, p["prompt_token_ids"], plp, 2)


def test_minus_one_asks_for_the_whole_vocabulary(llama_path):
    """vLLM's ``-1``: every token's logprob, for the prompt's positions and the sampled ones
    (with no ``max_logprobs`` cap; the default, 20, refuses it)."""
    engine = tiny_engine(llama_path, max_logprobs=-1)
    V = engine.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=-1, logprobs=-1)
    final, _ = run(engine, [("all", rand_prompts(3, [6])[0], params)])
    out = final["all"]
    assert out.prompt_logprobs[0] is None
    assert all(len(e) == V for e in out.prompt_logprobs[1:]), [len(e) for e in out.prompt_logprobs[1:]]
    assert [len(e) for e in out.outputs[0].logprobs] == [V, V]
    ranks = sorted(lp.rank for lp in out.prompt_logprobs[1].values())
    assert ranks[0] == 1 and len(set(ranks)) >= V - 1  # the prompt token may repeat its own rank
