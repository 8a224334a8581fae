"""End-to-end correctness of ``LLMEngine`` (and ``LLM.generate``) on tiny random checkpoints.

Reference: transformers' ``generate(do_sample=False)`` of each prompt alone (no padding), EOS
disabled on both sides so every continuation has a fixed length. Every architecture is checked in
every engine configuration that changes *how* the KV cache is filled -- prefix caching on/off,
chunked prefill in small chunks, and a cache so small that sequences are preempted (recompute and
swap) -- and the tests assert via the scheduler's stats that the mechanism really ran.
All on CPU in fp32; each engine is a few hundred KiB, so building one per test is cheap.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch

from ferrokv import LLM, CacheCapacityError, InvalidArgumentError, SamplingParams
from ferrokv.engine import EngineArgs, LLMEngine
from helpers.text_oracle import final_text
from helpers.tiny_models import TINY_VOCAB

MAX_NEW = 12
MAX_MODEL_LEN = 128

# name -> (arch, save_tiny_model kwargs)
MODELS = {
    "llama": ("llama", {}),
    "llama-gqa4": ("llama", dict(num_attention_heads=8, num_key_value_heads=2, seed=1)),
    "llama-headdim32": ("llama", dict(head_dim=32, tie_word_embeddings=True, seed=2)),
    "qwen2": ("qwen2", dict(seed=3)),
    "qwen3": ("qwen3", dict(seed=4)),
    "mistral-sw8": ("mistral", dict(sliding_window=8, seed=5)),
}

# name -> engine kwargs. Every configuration runs the same ragged batch.
CONFIGS = {
    "prefix-cache": dict(enable_prefix_caching=True),
    "no-prefix-cache": dict(enable_prefix_caching=False),
    "chunked-16": dict(max_num_batched_tokens=16, max_num_seqs=4),
    # Two prompts share 24 tokens (hits in the step that computes them): these sizes still preempt.
    "preempt-recompute": dict(block_size=4, num_kv_blocks=24, preemption_mode="recompute"),
    "preempt-swap": dict(block_size=8, num_kv_blocks=13, preemption_mode="swap", num_cpu_blocks=64),
}


def ragged_prompts(seed: int = 0) -> list[list[int]]:
    """Prompts of 3..60 tokens; two of them share a 24-token prefix (prefix-cache hits)."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(3, TINY_VOCAB) for _ in range(n)]  # noqa: E731 - no special tokens
    shared = ids(24)
    return [ids(3), ids(60), ids(9), shared + ids(5), ids(17), shared + ids(20), ids(33), ids(1)]


def greedy(max_tokens: int = MAX_NEW, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def assert_no_leak(engine: LLMEngine) -> None:
    sch = engine.scheduler
    assert not engine.has_unfinished_requests()
    assert sch.num_unfinished == 0 and sch.num_running_seqs == 0
    # Cached prefix blocks count as free (evictable); only the null block is never free.
    assert sch.num_free_blocks == sch.num_blocks - 1, engine.stats()
    sch.check_invariants()


def run_engine(engine: LLMEngine, steps: int | None = None) -> dict[str, object]:
    """Steps until done (or ``steps`` times); returns the last output of each request."""
    last: dict[str, object] = {}
    n = 0
    while engine.has_unfinished_requests() and (steps is None or n < steps):
        for o in engine.step():
            last[o.request_id] = o
        n += 1
    return last


# ------------------------------------------------------------------------------------------------
# 1. Greedy == transformers, every architecture x every cache configuration
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("model", list(MODELS))
def test_greedy_matches_transformers(model, config, tiny_model_dir, hf_greedy):
    arch, kw = MODELS[model]
    path = tiny_model_dir(model, arch, **kw)
    prompts = ragged_prompts()
    refs = [hf_greedy(path, p, MAX_NEW) for p in prompts]
    llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, **CONFIGS[config])
    engine = llm.llm_engine
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    for i, (o, ref) in enumerate(zip(outs, refs)):
        assert o.finished and o.outputs[0].finish_reason == "length"
        assert o.outputs[0].token_ids == ref, f"prompt {i} ({len(prompts[i])} tokens)"
    st = engine.stats()
    if config.startswith("preempt"):
        assert st["preemptions"] > 0, st
        if config == "preempt-swap":
            assert st["swap_preemptions"] > 0 and st["blocks_swapped_out"] > 0 and st["blocks_swapped_in"] > 0, st
        else:
            assert st["recompute_preemptions"] > 0 and st["swap_preemptions"] == 0, st
    else:
        assert st["preemptions"] == 0, st
    if config == "chunked-16":
        assert 0 < st["max_step_tokens"] <= 16 and st["max_running_seqs"] <= 4, st
    assert_no_leak(engine)

    if config in ("prefix-cache", "no-prefix-cache"):
        # Same batch again: with prefix caching the prompts' KV now comes from the cache.
        before = st["cached_prompt_tokens"]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == refs
        after = engine.stats()["cached_prompt_tokens"]
        if config == "prefix-cache":
            # Every prompt finds all its full blocks cached, except the one holding its last token
            # (that token is computed again to give the logits).
            bs = engine.args.block_size
            expected = [(len(p) - 1) // bs * bs for p in prompts]
            assert [o.num_cached_tokens for o in outs] == expected
            assert after - before == sum(expected)
            # vLLM's skip_reading_prefix_cache: the same prompts computed whole, the same tokens.
            queried = engine.stats()["prefix_cache_queried_tokens"]
            skip = greedy()
            skip.skip_reading_prefix_cache = True
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], skip, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outs] == refs and {o.num_cached_tokens for o in outs} == {0}
            assert engine.stats()["prefix_cache_queried_tokens"] == queried  # it looked nothing up
        else:
            assert after == before == 0
        assert_no_leak(engine)


# Dynamic NTK RoPE: transformers rescales the base from the length of each call (the whole prompt,
# then one token at a time), so a prompt's keys depend on its length, not on how it was chunked.
DYNAMIC_ROPE = dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=16)


def hf_greedy_fresh_rope(hf, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation, its dynamic RoPE state reset first (it keeps the
    longest length it has seen across calls)."""
    rot = hf.model.rotary_emb
    rot.inv_freq = rot.original_inv_freq.clone()
    rot.max_seq_len_cached = rot.original_max_seq_len
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=0, eos_token_id=None,
                          pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("config", ["chunked-16", "prefix-cache", "preempt-recompute"])
def test_dynamic_rope_matches_transformers_however_prompts_are_chunked_cached_or_recomputed(
        config, tiny_model_dir, hf_model, caplog, monkeypatch):
    # max_model_len beyond the scaled positions too, which vLLM (and ferrokv) allow only when asked.
    monkeypatch.setenv("FERROKV_ALLOW_LONG_MAX_MODEL_LEN", "1")
    path = tiny_model_dir("llama-dynamic-rope", "llama", **DYNAMIC_ROPE)
    prompts = ragged_prompts()  # most are longer than the model's 16 positions; two share 24 tokens
    hf = hf_model(path)
    refs = [hf_greedy_fresh_rope(hf, p, MAX_NEW) for p in prompts]
    with caplog.at_level("WARNING", logger="ferrokv"):
        llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, **CONFIGS[config])
    assert "prefix caching is off" in caplog.text  # equal prefixes of prompts of different lengths differ
    for _ in range(2):  # the second pass would hit the prefix cache if it were on
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
        for i, (o, ref) in enumerate(zip(outs, refs)):
            assert o.outputs[0].token_ids == ref, f"prompt {i} ({len(prompts[i])} tokens)"
    st = llm.llm_engine.stats()
    assert st["cached_prompt_tokens"] == 0, st
    if config == "chunked-16":
        assert st["max_step_tokens"] <= 16, st
    if config == "preempt-recompute":
        assert st["recompute_preemptions"] > 0, st
    assert_no_leak(llm.llm_engine)


# ------------------------------------------------------------------------------------------------
# Engine-level behaviour on the tiny llama
# ------------------------------------------------------------------------------------------------

def make_engine(path, **kw) -> LLMEngine:
    args = dict(model=str(path), device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, block_size=4,
                num_kv_blocks=128)
    args.update(kw)
    return LLMEngine.from_engine_args(EngineArgs(**args))  # vLLM's spelling; the same as LLMEngine(args)


def tokens_of(out) -> list[list[int]]:
    return [c.token_ids for c in out.outputs]


# --- 4. n > 1: shared prompt blocks, copy-on-write, distinct samples, seeded reproducibility ----
def test_model_config_has_the_attributes_vllm_scripts_read(llama_path):
    """``llm_engine.model_config.max_model_len`` and the like, as in vLLM."""
    engine = make_engine(llama_path, max_model_len=48, seed=7)
    mc = engine.model_config
    assert (mc.model, mc.tokenizer) == (str(engine.model_path), str(engine.model_path))
    assert (mc.max_model_len, mc.dtype, mc.seed, mc.revision) == (48, torch.float32, 7, None)
    assert mc.get_vocab_size() == engine.vocab_size and mc.hf_config.num_hidden_layers == 2
    assert engine.get_model_config() is mc
    # hf_config is transformers' config class, as vLLM's (scripts read architectures[0], to_dict())
    hf = mc.hf_config
    assert (hf.architectures, hf.model_type, hf.to_dict()["num_hidden_layers"]) == (["LlamaForCausalLM"], "llama", 2)
    overrides = {"rms_norm_eps": 1e-3, "rope_scaling": {"type": "linear", "factor": 2.0}}
    engine = make_engine(llama_path, hf_overrides=overrides)
    overridden = engine.model_config.hf_config
    assert overridden.rms_norm_eps == 1e-3
    # Reading it leaves the caller's dict as it was (transformers fills rope_scaling in: longctx8).
    assert overrides == {"rms_norm_eps": 1e-3, "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert engine.args.hf_overrides == overrides


def test_cache_config_has_the_attributes_vllm_scripts_read(llama_path):
    engine = make_engine(llama_path, block_size=8, num_kv_blocks=40, num_cpu_blocks=6,
                         enable_prefix_caching=False)
    cc = engine.cache_config
    assert (cc.block_size, cc.num_gpu_blocks, cc.num_cpu_blocks, cc.enable_prefix_caching) == (8, 40, 6, False)
    assert (cc.gpu_memory_utilization, cc.swap_space, cc.cache_dtype) == (0.9, 4.0, "auto")
    assert cc.num_gpu_blocks == engine.scheduler.num_blocks


def test_n_samples_share_prompt_blocks_and_reproduce(llama_path):
    prompt = ragged_prompts(1)[4][:10]  # 10 tokens: 2 full blocks + a partial one that must be COWed
    params = SamplingParams(n=4, temperature=1.0, seed=1234, max_tokens=8, ignore_eos=True)
    engine = make_engine(llama_path)
    engine.add_request("n4", {"prompt_token_ids": prompt}, params)
    engine.step()  # prefill; the 4 samples are forked off the prompt sequence at update
    st = engine.scheduler.stats()
    assert st["num_running_seqs"] == 4
    assert st["num_shared_blocks"] > 0, st
    # All four sequences start on the same prompt blocks.
    seq_ids = engine.scheduler.request_seq_ids(engine._by_name["n4"])
    tables = [engine.scheduler.seq_block_table(s) for s in seq_ids]
    assert len({tuple(t[:2]) for t in tables}) == 1
    out = run_engine(engine)["n4"]
    st = engine.scheduler.stats()
    assert st["cow_copies"] > 0, st
    samples = tokens_of(out)
    assert len(samples) == 4 and all(len(s) == 8 for s in samples)
    assert len({tuple(s) for s in samples}) == 4, samples  # the samples differ
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert_no_leak(engine)

    # Same seed, same engine: the same four samples.
    engine.add_request("again", {"prompt_token_ids": prompt}, params)
    assert tokens_of(run_engine(engine)["again"]) == samples

    # Same seed in a fresh engine, sharing the batch with other (seeded and unseeded) requests.
    engine = make_engine(llama_path, seed=99)
    others = ragged_prompts(2)
    engine.add_request("o0", {"prompt_token_ids": others[1]}, SamplingParams(temperature=0.7, max_tokens=12))
    engine.add_request("o1", {"prompt_token_ids": others[2]},
                       SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=5))
    run_engine(engine, steps=2)
    engine.add_request("late", {"prompt_token_ids": prompt}, params)
    engine.add_request("o2", {"prompt_token_ids": prompt}, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=9))
    outs = run_engine(engine)
    assert tokens_of(outs["late"]) == samples
    assert tokens_of(outs["o2"]) != samples[:3]
    assert_no_leak(engine)


@pytest.mark.parametrize(
    "mode, prefix_caching",
    [("recompute", True), ("recompute", False), ("swap", True), ("swap", False)],
)
def test_n_samples_survive_preemption(llama_path, mode, prefix_caching):
    """Seeded n > 1 requests give the same samples with a cache so small that they are preempted."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, TINY_VOCAB) for _ in range(n)] for n in (10, 30, 45, 20, 7)]

    def run(**kw):
        engine = make_engine(llama_path, enable_prefix_caching=prefix_caching, **kw)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": p},
                               SamplingParams(n=3, temperature=1.0, seed=i, max_tokens=16, ignore_eos=True))
        outs = run_engine(engine)
        assert_no_leak(engine)
        return {k: [(c.token_ids, c.finish_reason) for c in o.outputs] for k, o in outs.items()}, engine.stats()

    ample, st = run()
    assert st["preemptions"] == 0
    # The samples share their prompt's full blocks in every mode (after a recompute too), so the
    # largest request's worst case is 11 + 3 x (ceil(60 / 4) - 11) = 23 blocks: the whole cache (+1 reserved).
    small, st = run(num_kv_blocks=24, preemption_mode=mode, num_cpu_blocks=64 if mode == "swap" else 0)
    assert st["preemptions"] > 0 and st["capacity_aborts"] == 0, st
    assert small == ample


def test_samples_that_fit_only_sharing_their_prompt_run_after_a_recompute(llama_path):
    """A request whose samples fit only while they share their prompt's full blocks is admitted
    (as vLLM's child requests each need to fit alone), and runs to its end after preemptions:
    swap falls back to recompute when the CPU pool is full, and recomputed samples share the
    prompt again. It used to be refused, and before that capacity-aborted mid-generation."""
    rng = random.Random(5)
    prompts = {"a": [rng.randrange(3, TINY_VOCAB) for _ in range(16)],
               "b": [rng.randrange(3, TINY_VOCAB) for _ in range(64)]}
    # 4 full prompt blocks once + 4 x (ceil(95 / 16) - 4) = 12 blocks: the whole cache.
    params = {"a": greedy(max_tokens=64), "b": SamplingParams(n=4, temperature=0.0, max_tokens=32, ignore_eos=True)}

    def run(**kw):
        engine = make_engine(llama_path, block_size=16, max_model_len=128, **kw)
        for rid in ("a", "b"):  # "a" arrives first: "b" is the one preempted
            engine.add_request(rid, {"prompt_token_ids": prompts[rid]}, params[rid])
        outs = run_engine(engine)
        assert_no_leak(engine)
        return {k: [(c.token_ids, c.finish_reason) for c in o.outputs] for k, o in outs.items()}, engine.stats()

    ample, _ = run()
    small, st = run(num_kv_blocks=13, preemption_mode="swap", num_cpu_blocks=1)
    assert st["recompute_preemptions"] > 0 and st["capacity_aborts"] == 0, st
    assert small == ample and [len(t) for t, _ in small["b"]] == [32] * 4


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_requests_that_fill_the_cache_exactly_are_admitted_and_run_as_with_room(llama_path, preemption_mode):
    """15 usable blocks of 4 hold 60 tokens, and a request's last token is never cached: a 60-token
    prompt with max_tokens=1, 57 + 4, and two samples of 24 + 17 (the prompt's 6 blocks shared, 4
    of their own each) fit, and one token more does not (pressure7: the check counted the last
    token, refusing the first two; the samples' shared prompt blocks were counted twice)."""
    rng = random.Random(17)
    prompts = {k: [rng.randrange(3, TINY_VOCAB) for _ in range(k)] for k in (60, 57, 24)}
    asks = [("fill", 60, greedy(max_tokens=1)), ("fill4", 57, greedy(max_tokens=4)),
            ("two", 24, SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=17, ignore_eos=True))]

    def run(**kw):
        engine = make_engine(llama_path, block_size=4, max_model_len=128, preemption_mode=preemption_mode, **kw)
        for rid, k, params in asks:
            engine.add_request(rid, {"prompt_token_ids": prompts[k]}, params)
        outs = run_engine(engine)
        assert engine.stats()["capacity_aborts"] == 0
        assert_no_leak(engine)
        return {rid: [c.token_ids for c in o.outputs] for rid, o in outs.items()}, engine

    exact, engine = run(num_kv_blocks=16, num_cpu_blocks=16 if preemption_mode == "swap" else 0)
    assert exact == run(num_kv_blocks=256)[0]
    for k, params in ((60, greedy(max_tokens=2)), (57, greedy(max_tokens=5)),
                      (24, SamplingParams(n=2, max_tokens=18, ignore_eos=True))):
        with pytest.raises(CacheCapacityError, match="needs up to 16 KV blocks"):
            engine.add_request("more", {"prompt_token_ids": prompts[k]}, params)


def test_a_beam_search_that_could_never_fit_is_told_in_its_own_terms(llama_path):
    """A beam search keeps 2 * beam_width - 1 sequences and has no n: the refusal says so (it said
    "lower max_tokens or n")."""
    engine = make_engine(llama_path, num_kv_blocks=30, max_model_len=64)
    with pytest.raises(CacheCapacityError) as e:
        engine.add_beam_request("b", {"prompt_token_ids": list(range(3, 23))}, beam_width=3, max_tokens=24)
    message = str(e.value)
    assert "(5 beam search sequences (2 * beam_width - 1) of its 20-token prompt + max_tokens=24)" in message
    assert message.endswith("lower max_tokens or beam_width, or enlarge the KV cache"), message
    assert not engine.has_unfinished_requests()
    assert_no_leak(engine)


def test_no_max_tokens_means_as_many_as_the_samples_worst_case_fits(llama_path, caplog):
    """``max_tokens=None`` (chat's default) with n samples: as many tokens as n contexts sharing
    their prompt's full blocks fit in the cache, not a refusal (vLLM runs each sample alone), and
    a warning says so; an explicit limit that cannot fit is still refused."""
    engine = make_engine(llama_path, block_size=16, num_kv_blocks=13, max_model_len=128)  # 12 usable
    prompt = {"prompt_token_ids": list(range(5, 5 + 40))}
    with caplog.at_level(logging.WARNING, logger="ferrokv"):
        engine.add_request("n3", prompt, SamplingParams(n=3, temperature=0.0, max_tokens=None, ignore_eos=True,
                                                        min_tokens=50))
        engine.add_request("n1", prompt, SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))
    warned = [r.getMessage() for r in caplog.records if "names no max_tokens" in r.getMessage()]
    assert warned == ["request n3 names no max_tokens: each of its n=3 sample(s) may generate 41 tokens, what the KV "
                      "cache holds for them at once (max_model_len leaves 88); min_tokens=50 is cut to it"]
    with pytest.raises(CacheCapacityError):
        engine.add_request("big", prompt, SamplingParams(n=3, temperature=0.0, max_tokens=100, ignore_eos=True))
    outs = run_engine(engine)
    # The prompt's 2 full blocks once, and (12 - 2) // 3 = 3 blocks of 16 more per sample: 80 cached
    # tokens each, and a last one never cached: 41 after the 40-token prompt.
    assert [len(c.token_ids) for c in outs["n3"].outputs] == [41, 41, 41]
    assert len(outs["n1"].outputs[0].token_ids) == 88  # one sample fits max_model_len: no warning
    assert all(c.finish_reason == "length" for c in outs["n3"].outputs)
    assert engine.stats()["capacity_aborts"] == 0
    assert_no_leak(engine)


def test_seeded_request_independent_of_batch(llama_path):
    """A seeded request samples the same tokens alone, in a big batch, and at another position."""
    prompt = ragged_prompts(3)[1][:21]
    p = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=42, max_tokens=10, ignore_eos=True)
    engine = make_engine(llama_path)
    engine.add_request("alone", {"prompt_token_ids": prompt}, p)
    alone = tokens_of(run_engine(engine)["alone"])

    engine = make_engine(llama_path)
    for i, q in enumerate(ragged_prompts(4)[:5]):
        engine.add_request(f"x{i}", {"prompt_token_ids": q}, SamplingParams(temperature=1.0, max_tokens=6 + i))
    run_engine(engine, steps=3)
    engine.add_request("batched", {"prompt_token_ids": prompt}, p)
    engine.add_request("twin", {"prompt_token_ids": prompt}, SamplingParams(temperature=0.9, seed=43, max_tokens=10))
    outs = run_engine(engine)
    assert tokens_of(outs["batched"]) == alone
    assert tokens_of(outs["twin"]) != alone  # another seed: another sample (sanity: seeds matter)
    assert_no_leak(engine)


def test_a_seeded_n_request_is_n_one_sample_requests_with_the_seed_plus_the_index(llama_path):
    """vLLM's child seeds: sample i of ``SamplingParams(n=3, seed=s)`` samples as a one-sample
    request with seed s + i, so splitting a request (or not) changes nothing."""
    prompt = ragged_prompts(3)[2][:9]
    params = dict(temperature=1.0, max_tokens=8, ignore_eos=True)
    engine = make_engine(llama_path)
    engine.add_request("n3", {"prompt_token_ids": prompt}, SamplingParams(n=3, seed=7, **params))
    for i in range(3):
        engine.add_request(f"one{i}", {"prompt_token_ids": prompt}, SamplingParams(seed=7 + i, **params))
    outs = run_engine(engine)
    samples = tokens_of(outs["n3"])
    assert samples == [tokens_of(outs[f"one{i}"])[0] for i in range(3)]
    assert len({tuple(s) for s in samples}) == 3
    assert_no_leak(engine)


# --- 5. bad input: ValueError naming the field, in-flight requests unaffected, no block leak -----
def bad_requests(engine: LLMEngine):
    """(prompt, params, text the ValueError must contain)."""
    good = {"prompt_token_ids": [5, 6, 7]}
    return [
        ({"prompt_token_ids": list(range(3, 3 + MAX_MODEL_LEN + 1))}, None, "max_model_len"),
        # Exactly max_model_len leaves no position for an output token (vLLM refuses it too).
        ({"prompt_token_ids": list(range(3, 3 + MAX_MODEL_LEN))}, None, "as many as max_model_len"),
        ({"prompt_token_ids": []}, None, "prompt"),
        ("", None, "prompt"),
        ({"prompt_token_ids": [5, TINY_VOCAB]}, None, "prompt_token_ids"),
        ({"prompt_token_ids": [-1, 5]}, None, "prompt_token_ids"),
        ({"prompt_token_ids": [5, "x"]}, None, "prompt_token_ids"),
        (12345, None, "prompt"),
        (good, {"temperature": 0.0}, "sampling_params"),
        (good, SamplingParams(n=engine.args.max_num_seqs + 1), "n="),
        # vLLM's max_logprobs (20 by default) caps both kinds; -1 asks for the whole vocabulary.
        (good, SamplingParams(logprobs=21), "logprobs=21 asks for 21 logprobs, more than max_logprobs=20"),
        (good, SamplingParams(prompt_logprobs=-1), f"prompt_logprobs=-1 asks for {TINY_VOCAB} logprobs"),
        # Fits max_model_len but could never fit the KV cache (8 samples of 103 tokens).
        (good, SamplingParams(n=8, max_tokens=100), "max_tokens"),
    ]


def test_bad_requests_rejected_while_others_complete(llama_path, hf_greedy):
    prompts = ragged_prompts(5)[:4]
    refs = [hf_greedy(llama_path, p, MAX_NEW) for p in prompts]
    engine = make_engine(llama_path, num_kv_blocks=40, max_num_seqs=8)
    for i, p in enumerate(prompts):
        engine.add_request(f"good{i}", {"prompt_token_ids": p}, greedy())
    last = run_engine(engine, steps=3)
    free_before = engine.scheduler.num_free_blocks
    stats_before = engine.stats()
    for prompt, params, field in bad_requests(engine):
        with pytest.raises(ValueError, match=field):
            engine.add_request("bad", prompt, params)
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("good0", {"prompt_token_ids": [5, 6]}, greedy())
    # Nothing of the bad requests reached the scheduler.
    assert engine.scheduler.num_free_blocks == free_before
    assert engine.stats()["requests_added"] == stats_before["requests_added"]
    assert engine.get_num_unfinished_requests() == 4
    last.update(run_engine(engine))
    for i, ref in enumerate(refs):
        assert last[f"good{i}"].finished and last[f"good{i}"].outputs[0].token_ids == ref
    assert_no_leak(engine)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(n=0), "n"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
        (dict(logprobs=-2), "logprobs"),
        (dict(stop=[""]), "stop"),
        (dict(stop_token_ids=[-3]), "stop_token_ids"),
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(seed="7"), "seed"),
    ],
)
def test_invalid_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_a_torch_device_is_a_device(llama_path):
    """vLLM's device may be a torch.device as well as its name."""
    assert make_engine(llama_path, device=torch.device("cpu")).device == torch.device("cpu")


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(block_size=0), "block_size"),
        (dict(block_size=24), "block_size=24: must be a power of two"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(num_kv_blocks=1), "num_gpu_blocks_override"),  # the former name: an alias
        (dict(max_model_len=-5), "max_model_len"),
        (dict(preemption_mode="discard"), "preemption_mode"),
        (dict(scheduling_policy="lifo"), "invalid scheduling_policy=\"lifo\""),
        (dict(max_num_seqs=1 << 22, block_size=1), "max_model_len"),  # the core's batch-matrix limit
        (dict(num_cpu_blocks=-1), "num_cpu_blocks"),
        (dict(dtype="int8"), "dtype"),
        (dict(device="tpu"), "device"),
        (dict(device="cuda:x"), "device must be"),  # torch's own error was a RuntimeError
        (dict(device="cuda:-1"), "device must be"),
    ],
)
def test_invalid_engine_args(llama_path, kwargs, field):
    with pytest.raises(ValueError, match=field):
        make_engine(llama_path, **kwargs)


def test_scheduler_settings_are_checked_before_the_model_loads(tmp_path):
    """The core's checks run in EngineArgs.validate: a bad block_size fails, not the missing model."""
    with pytest.raises(ValueError, match="invalid block_size=24: must be a power of two"):
        LLMEngine(EngineArgs(model=str(tmp_path / "no-such-model"), block_size=24))
    with pytest.raises(ValueError, match="invalid num_gpu_blocks_override=1: must be >= 2") as e:
        EngineArgs(num_kv_blocks=1).validate()  # the former name, folded into vLLM's
    # The core's error, renamed in place: its type and parts stay, under our name for the field.
    assert type(e.value) is InvalidArgumentError and (e.value.field, e.value.value) == ("num_gpu_blocks_override", "1")


def test_core_errors_keep_their_type_and_name_the_callers_request_id(llama_path, monkeypatch):
    """The engine renames the core's integer request id in the core's errors in place: the type
    stays (an exception rebuilt as type(e)(message) became a TypeError for UnicodeEncodeError,
    which takes five arguments), and so do the core error's field and value."""
    from ferrokv import CacheCapacityError, InvalidArgumentError
    from ferrokv._core import Scheduler

    engine = make_engine(llama_path)
    raised = []

    def fail_unicode(core_id, *args):
        raise UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed")

    def fail_capacity(core_id, *args):
        raise CacheCapacityError(f"request_id={core_id} needs up to 9 KV blocks; request_id={core_id}1 is another")

    def fail_field(core_id, *args):
        try:
            Scheduler(8).add_request(-core_id - 1, [5], 2)  # the core's own typed error, naming the id
        except InvalidArgumentError as e:
            e.args = (e.args[0].replace(f"={-core_id - 1}", f"={core_id}"),)
            e.value = str(core_id)
            raise

    for fake in (fail_unicode, fail_capacity, fail_field):
        monkeypatch.setattr(engine, "_add_to_scheduler", fake)
        with pytest.raises(ValueError) as e:
            engine.add_request("mine", {"prompt_token_ids": [5, 6]}, greedy())
        raised.append(e.value)
    assert type(raised[0]) is UnicodeEncodeError and raised[0].reason == "surrogates not allowed"
    assert type(raised[1]) is CacheCapacityError
    assert str(raised[1]).startswith("request_id='mine' needs") and str(raised[1]).endswith("1 is another")
    assert type(raised[2]) is InvalidArgumentError and (raised[2].field, raised[2].value) == ("request_id", "'mine'")
    assert "request_id='mine'" in str(raised[2])
    assert not engine.has_unfinished_requests()


def test_params_are_checked_and_copied_when_a_request_is_added(llama_path, hf_greedy):
    """SamplingParams are checked again when a request is added (an assignment after construction
    skipped every check: temperature=nan sampled token 0), and the request keeps its own copy,
    so an assignment after add_request does not reach it."""
    prompt = ragged_prompts(15)[1]
    engine = make_engine(llama_path)
    params = greedy()
    params.temperature = float("nan")
    with pytest.raises(ValueError, match="temperature must be >= 0 and finite, got nan"):
        engine.add_request("nan", {"prompt_token_ids": prompt}, params)
    params.temperature = 0.0
    engine.add_request("g", {"prompt_token_ids": prompt}, params)
    params.temperature = 5.0  # after the request was added: not its business
    params.stop_token_ids.append(hf_greedy(llama_path, prompt, MAX_NEW)[2])
    assert tokens_of(run_engine(engine)["g"]) == [hf_greedy(llama_path, prompt, MAX_NEW)]
    assert_no_leak(engine)


def test_huge_token_counts_are_capped_at_max_model_len(llama_path, hf_greedy):
    """max_tokens / min_tokens larger than any context (2**70) mean "up to max_model_len", as
    the core caps them anyway, instead of overflowing the core's integers."""
    prompt = ragged_prompts(16)[1]
    room = MAX_MODEL_LEN - len(prompt)
    engine = make_engine(llama_path)
    engine.add_request("mt", {"prompt_token_ids": prompt}, greedy(max_tokens=2**70))
    engine.add_request("min", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=None, min_tokens=2**70))
    outs = run_engine(engine)
    for rid in ("mt", "min"):
        c = outs[rid].outputs[0]
        assert c.token_ids == hf_greedy(llama_path, prompt, room) and c.finish_reason == "length"
    assert_no_leak(engine)


def test_request_ids_of_any_type_can_be_aborted(llama_path):
    """add_request takes any id (it keeps str(id)); abort_request takes the same id back."""
    engine = make_engine(llama_path)
    engine.add_request(2**63, {"prompt_token_ids": [5, 6, 7]}, greedy())
    engine.add_request(7, {"prompt_token_ids": [5, 6, 7]}, greedy())
    engine.abort_request(2**63)
    engine.abort_request([7])
    assert_no_leak(engine)


# --- 6. stops, min_tokens, logprobs, abort ----------------------------------------------------------
def test_stop_string_ends_early_and_frees_blocks(llama_path, hf_greedy):
    engine = make_engine(llama_path)
    tok = engine.tokenizer
    prompt, other = ragged_prompts(6)[1], ragged_prompts(6)[4]
    full = hf_greedy(llama_path, prompt, MAX_NEW)
    full_text = tok.decode(full)
    # A stop string that first appears inside the text of generated tokens 5..7.
    prefix_len = len(tok.decode(full[:5]))
    stop = full_text[prefix_len:prefix_len + 2]
    assert stop.strip() and stop in full_text
    cut = full_text.index(stop)

    engine.add_request("s", {"prompt_token_ids": prompt}, greedy(stop=[stop, "never-generated-XYZ"]))
    engine.add_request("long", {"prompt_token_ids": other}, greedy(max_tokens=40))
    s_out = None
    while s_out is None:
        for o in engine.step():
            if o.request_id == "s" and o.finished:
                s_out = o
    c = s_out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == full_text[:cut]
    assert len(c.token_ids) < MAX_NEW and c.token_ids == full[:len(c.token_ids)]
    # "s" is gone from the scheduler at once; only "long" holds blocks now.
    sch = engine.scheduler
    assert sch.num_unfinished == 1 and sch.num_running_seqs == 1
    (long_seq,) = sch.request_seq_ids(engine._by_name["long"])
    assert sch.stats()["num_used_blocks"] == len(sch.seq_block_table(long_seq))
    run_engine(engine)
    assert_no_leak(engine)

    # include_stop_str_in_output keeps the stop string.
    engine.add_request("s2", {"prompt_token_ids": prompt}, greedy(stop=stop, include_stop_str_in_output=True))
    c2 = run_engine(engine)["s2"].outputs[0]
    assert c2.text == full_text[:cut + len(stop)] and c2.finish_reason == "stop"
    assert_no_leak(engine)


def test_stop_token_ids_and_min_tokens(llama_path, hf_greedy, hf_model):
    prompt = ragged_prompts(7)[2]
    full = hf_greedy(llama_path, prompt, MAX_NEW)
    engine = make_engine(llama_path)
    stop_tok = full[3]
    first = full.index(stop_tok)
    engine.add_request("st", {"prompt_token_ids": prompt}, greedy(stop_token_ids=[stop_tok]))
    c = run_engine(engine)["st"].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop_tok
    assert c.token_ids == full[:first + 1]  # the stop token is returned in token_ids ...
    assert c.text == engine.tokenizer.decode(full[:first])  # ... but not in the text

    # min_tokens: the stop token cannot end the sequence (nor be sampled) before min_tokens tokens:
    # exactly transformers' min_new_tokens with the stop token as its EOS. Here the stop token ends
    # the output right after min_tokens = first + 2, and never comes back with first + 3.
    reasons = []
    for k in (first + 2, first + 3):
        with torch.no_grad():
            ref = hf_model(llama_path).generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_NEW, min_new_tokens=k,
                eos_token_id=stop_tok, pad_token_id=0)[0, len(prompt):].tolist()
        stopped = ref[-1] == stop_tok
        engine.add_request(f"mt{k}", {"prompt_token_ids": prompt}, greedy(stop_token_ids=[stop_tok], min_tokens=k))
        c = run_engine(engine)[f"mt{k}"].outputs[0]
        assert c.token_ids == ref
        assert (c.finish_reason, c.stop_reason) == (("stop", stop_tok) if stopped else ("length", None))
        reasons.append(c.finish_reason)
    assert reasons == ["stop", "length"]  # both ways of ending are checked

    assert_no_leak(engine)


def test_eos_ends_sequence_and_min_tokens_suppresses_it(eos_model_dir, hf_greedy, hf_model):
    """EOS (the tokenizer's, id 0) ends a sequence like transformers' generate with that EOS."""
    path, prompt = eos_model_dir
    full = hf_greedy(path, prompt, MAX_NEW)  # EOS disabled: what comes after EOS too
    at = full.index(0)
    hf = hf_model(path)
    with torch.no_grad():
        g = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=0,
                        pad_token_id=0)[0, len(prompt):].tolist()
    assert g[:at + 1] == full[:at + 1] and len(g) == at + 1  # transformers stops at EOS

    engine = make_engine(path)
    engine.add_request("eos", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    engine.add_request("ign", {"prompt_token_ids": prompt}, greedy())
    engine.add_request("min", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=at + 2))
    outs = run_engine(engine)
    c = outs["eos"].outputs[0]
    assert c.token_ids == g and c.finish_reason == "stop" and c.stop_reason is None
    assert c.text == engine.tokenizer.decode(g[:-1])  # EOS is not part of the text
    c = outs["ign"].outputs[0]
    assert c.token_ids == full and c.finish_reason == "length"
    c = outs["min"].outputs[0]
    assert c.token_ids[:at] == full[:at] and 0 not in c.token_ids[:at + 2] and len(c.token_ids) >= at + 2
    assert_no_leak(engine)


def test_extra_eos_ids_from_generation_config(llama_path, hf_greedy, tmp_path):
    """generation_config.json may list several EOS ids: each ends a sequence like EOS, is masked
    during min_tokens (also under ignore_eos, as vLLM bans every EOS id there), and none of them
    ends a request that sets ignore_eos."""
    import json
    import shutil

    prompt = ragged_prompts(14)[1]
    full = hf_greedy(llama_path, prompt, MAX_NEW)
    extra = full[3]  # a token greedy decoding really produces: an EOS id here
    first = full.index(extra)
    path = tmp_path / "multi-eos"
    shutil.copytree(llama_path, path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, extra, TINY_VOCAB - 1]}))
    engine = make_engine(path)
    assert engine.eos_token_ids == (0, extra, TINY_VOCAB - 1)
    engine.add_request("eos", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    engine.add_request("ign", {"prompt_token_ids": prompt}, greedy())
    engine.add_request("min", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=first + 1, ignore_eos=False))
    # Pushed towards the extra EOS id: under min_tokens it is banned all the same, then it is sampled.
    engine.add_request("min-ign", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=6, min_tokens=3, ignore_eos=True,
                                      logit_bias={extra: 100}))
    outs = run_engine(engine)
    c = outs["eos"].outputs[0]
    assert c.token_ids == full[:first + 1] and c.finish_reason == "stop"
    assert c.text == engine.tokenizer.decode(full[:first])  # an EOS is not part of the text
    c = outs["ign"].outputs[0]
    assert c.token_ids == full and c.finish_reason == "length"
    c = outs["min"].outputs[0]
    assert c.token_ids[:first] == full[:first] and extra not in c.token_ids[:first + 1]
    c = outs["min-ign"].outputs[0]
    assert extra not in c.token_ids[:3] and c.token_ids[3:] == [extra] * 3 and c.finish_reason == "length"
    assert_no_leak(engine)


def test_logprobs_match_transformers(llama_path, hf_model):
    prompt = ragged_prompts(9)[1][:30]
    engine = make_engine(llama_path)
    engine.add_request("lp", {"prompt_token_ids": prompt}, greedy(max_tokens=6, logprobs=3))
    c = run_engine(engine)["lp"].outputs[0]
    assert len(c.logprobs) == 6
    hf = hf_model(llama_path)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1:-1]
    ref = torch.log_softmax(logits.double(), dim=-1)
    total = 0.0
    for pos, (tok, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        ids = list(entry)
        assert ids[0] == tok and entry[tok].rank == 1  # greedy: the sampled token is the top one
        top3 = torch.topk(ref[pos], 3).indices.tolist()
        assert set(ids) == set(top3)
        for t, lp in entry.items():
            assert lp.logprob == pytest.approx(float(ref[pos, t]), abs=1e-4)
            assert lp.decoded_token == engine.tokenizer.decode([t])
        total += entry[tok].logprob
    assert c.cumulative_logprob == pytest.approx(total, abs=1e-6)
    assert_no_leak(engine)


def test_abort_mid_generation_frees_blocks(llama_path, hf_greedy):
    prompts = ragged_prompts(10)[:3]
    engine = make_engine(llama_path, enable_prefix_caching=False)
    engine.add_request("a", {"prompt_token_ids": prompts[0]}, greedy())
    engine.add_request("b", {"prompt_token_ids": prompts[1]}, greedy(max_tokens=20))
    engine.add_request("c", {"prompt_token_ids": prompts[2]},
                       SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=20))
    run_engine(engine, steps=4)
    sch = engine.scheduler
    used = sch.stats()["num_used_blocks"]
    (b_seq,) = sch.request_seq_ids(engine._by_name["b"])
    b_blocks = len(sch.seq_block_table(b_seq))
    engine.abort_request("b")
    assert sch.stats()["num_used_blocks"] == used - b_blocks
    engine.abort_request(["c", "no-such-request"])  # unknown ids are ignored
    assert sch.num_running_seqs == 1 and engine.get_num_unfinished_requests() == 1
    last = run_engine(engine)
    assert "b" not in last and "c" not in last  # aborted requests produce no more outputs
    assert last["a"].outputs[0].token_ids == hf_greedy(llama_path, prompts[0], MAX_NEW)
    assert engine.stats()["requests_aborted"] == 2
    assert_no_leak(engine)
    engine.abort_request("a")  # finished: a no-op
    assert_no_leak(engine)


def test_min_tokens_bans_eos_even_under_ignore_eos(llama_path):
    """vLLM's MinTokens bans the EOS for the first min_tokens tokens whatever ignore_eos says;
    after them, ignore_eos lets a sampled EOS through without stopping."""
    engine = make_engine(llama_path)
    eos = engine.eos_token_ids[0]
    engine.add_request("m", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(
        temperature=0.0, max_tokens=6, min_tokens=4, ignore_eos=True, logit_bias={eos: 100.0}))
    toks = run_engine(engine)["m"].outputs[0].token_ids
    assert eos not in toks[:4] and toks[4:] == [eos, eos], toks
    assert_no_leak(engine)


@pytest.mark.parametrize("when", ["waiting", "running"])
def test_an_aborted_request_reports_every_one_of_its_n_samples(llama_path, when):
    """vLLM runs each of n samples as a request of its own, so an abort reports n completions;
    a request aborted while it waits has only its prompt's sequence in the core."""
    engine = make_engine(llama_path)
    aborted = []
    engine.on_abort = aborted.append
    engine.add_request("c", {"prompt_token_ids": [5, 6, 7, 8]},
                       SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=20, logprobs=1))
    if when == "running":
        run_engine(engine, steps=3)
    engine.abort_request("c")
    (out,) = aborted
    assert out.finished and [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.finish_reason == "abort" for c in out.outputs)
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids) and (c.cumulative_logprob is not None)
        assert (len(c.token_ids) > 0) == (when == "running")
    assert_no_leak(engine)


def test_repetition_penalty_matches_transformers(llama_path, hf_model):
    """Greedy with a repetition penalty (HF semantics, over prompt + output) equals transformers'."""
    hf = hf_model(llama_path)
    prompts = [ragged_prompts(12)[k] for k in (1, 4, 6)]
    engine = make_engine(llama_path, max_num_batched_tokens=16, max_num_seqs=4)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, greedy(repetition_penalty=1.8))
    outs = run_engine(engine)
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=MAX_NEW, repetition_penalty=1.8,
                              pad_token_id=0)[0, len(p):].tolist()
        assert outs[str(i)].outputs[0].token_ids == ref
    assert_no_leak(engine)


def test_streaming_outputs_are_cumulative(llama_path, hf_greedy):
    """step() returns growing outputs; ``finished`` only on the last; stop strings per sample."""
    prompt = ragged_prompts(13)[1]
    ref = hf_greedy(llama_path, prompt, MAX_NEW)
    engine = make_engine(llama_path)
    engine.add_request("g", {"prompt_token_ids": prompt}, greedy())
    engine.add_request("n", {"prompt_token_ids": prompt},
                       SamplingParams(n=4, temperature=1.5, seed=8, max_tokens=30, stop=["e", "a"]))
    seen, n_out = [], None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == "g":
                seen.append((list(o.outputs[0].token_ids), o.finished, o.outputs[0].text))
            else:
                n_out = o
    assert [len(t) for t, _, _ in seen] == list(range(1, MAX_NEW + 1))
    assert [f for _, f, _ in seen] == [False] * (MAX_NEW - 1) + [True]
    assert seen[-1][0] == ref and all(t == ref[:len(t)] for t, _, _ in seen)
    assert seen[-1][2] == final_text(engine.tokenizer, ref)
    assert n_out.finished and len(n_out.outputs) == 4
    for c in n_out.outputs:
        if c.finish_reason == "stop":
            assert c.stop_reason in ("e", "a") and "e" not in c.text and "a" not in c.text
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == 30
    assert sum(c.finish_reason == "stop" for c in n_out.outputs) >= 2
    assert_no_leak(engine)


def test_sampler_generator_is_on_the_engine_device(llama_path, monkeypatch):
    """Unseeded rows draw from the sampler's shared generator on the logits' device, so the
    engine must make it on its own device (it once made it on the CPU whatever the device: on
    CUDA, every unseeded sample then failed). Recorded, since a CPU-only machine has one device."""
    import ferrokv.step_sampling as step_sampling

    made = []

    class Recording(step_sampling.Sampler):
        def __init__(self, *args, **kwargs):
            made.append(kwargs)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(step_sampling, "Sampler", Recording)
    engine = make_engine(llama_path, seed=3)
    assert made == [{"seed": 3, "device": engine.device}]
    assert engine.step_sampler.sampler.generator.device == engine.device


def test_requests_admitted_together_hit_the_prefix_their_first_computes(llama_path, hf_greedy):
    """Prefix blocks are registered when scheduled: followers admitted in the same step as the
    request that computes a shared prefix hit it (their attention reads KV written in that very
    step), and every output still equals transformers'."""
    rng = random.Random(77)
    shared = [rng.randrange(3, TINY_VOCAB) for _ in range(10)]  # 2 full blocks of 4 + 2 tokens
    prompts = [shared + [rng.randrange(3, TINY_VOCAB) for _ in range(3 + i)] for i in range(4)]
    engine = make_engine(llama_path, block_size=4, enable_prefix_caching=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"f{i}", {"prompt_token_ids": p}, greedy(8))
    last = run_engine(engine)
    assert [last[f"f{i}"].num_cached_tokens for i in range(4)] == [0, 8, 8, 8]
    for i, p in enumerate(prompts):
        assert last[f"f{i}"].outputs[0].token_ids == hf_greedy(llama_path, p, 8), i
    assert engine.stats()["cached_prompt_tokens"] == 24
    assert_no_leak(engine)


def test_top_k_and_logprobs_beyond_the_vocabulary_mean_the_whole_vocabulary(llama_path):
    """Huge values are legal (an int, >= the checks' bounds) and never overflow the core's 32-bit
    fields: top_k >= V keeps every token (as top_k off), logprobs >= V returns every token."""
    from helpers.engine_faults import run_requests, tiny_engine

    engine = tiny_engine(llama_path, max_logprobs=-1)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    sampled = dict(temperature=1.0, seed=3, max_tokens=6)
    final, _ = run_requests(engine, [
        ("off", prompt, SamplingParams(**sampled)),
        ("huge", prompt, SamplingParams(**sampled, top_k=2**70)),
        ("all", prompt, SamplingParams(temperature=0.0, max_tokens=2, logprobs=-1)),
        ("many", prompt, SamplingParams(temperature=0.0, max_tokens=2, logprobs=2**70)),
    ])
    assert final["huge"].outputs[0].token_ids == final["off"].outputs[0].token_ids
    # Stop ids outside the vocabulary could never be sampled: refused naming them (vLLM's).
    greedy = dict(temperature=0.0, max_tokens=6)
    stop = run_requests(engine, [("g", prompt, SamplingParams(**greedy))])[0]["g"].outputs[0].token_ids[2]
    with pytest.raises(ValueError, match=r"stop_token_ids has token ids out of the vocabulary .*\[1099511627776, "):
        engine.add_request("far", prompt, SamplingParams(**greedy, stop_token_ids=[2**70, 2**40, stop]))
    final2, _ = run_requests(engine, [
        ("hot", prompt, SamplingParams(temperature=1e300, repetition_penalty=1e300, seed=1, max_tokens=3)),
    ])
    assert final2["hot"].outputs[0].finish_reason == "length"
    V = engine.vocab_size
    assert [len(e) for e in final["many"].outputs[0].logprobs] == [V, V]
    assert final["many"].outputs[0].logprobs == final["all"].outputs[0].logprobs


@pytest.mark.parametrize("kind", ["DELTA", "CUMULATIVE"])
def test_every_streamed_output_of_a_cache_hit_carries_its_cached_tokens(llama_path, kind):
    """vLLM sets ``num_cached_tokens`` before building each output, the first one included (its
    servers read it from the first output of a stream)."""
    from ferrokv.outputs import RequestOutputKind

    prompt = {"prompt_token_ids": list(range(3, 3 + 13))}  # 3 full blocks of 4 + 1 token
    engine = make_engine(llama_path, block_size=4, enable_prefix_caching=True)
    engine.add_request("warm", prompt, greedy(2))
    run_engine(engine)
    engine.add_request("hit", prompt, greedy(3, output_kind=RequestOutputKind[kind]))
    seen = []
    while engine.has_unfinished_requests():
        seen += [o.num_cached_tokens for o in engine.step() if o.request_id == "hit"]
    assert seen == [12] * 3
    assert_no_leak(engine)


def test_an_engine_made_and_stepped_under_inference_mode_works(llama_path):
    """The caller's torch.inference_mode() does not make the engine's tensors inference tensors:
    steps (on the engine loop's thread, outside that mode) write the KV cache in place."""
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with torch.inference_mode():
        llm = LLM(str(llama_path), device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN)
        got = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
        engine = make_engine(llama_path)
        engine.add_request("a", prompt, sp)
        stepped = run_engine(engine)["a"].outputs[0].token_ids
    expected = LLM(str(llama_path), device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN).generate(
        [prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert list(got) == list(expected) == list(stepped)
