"""Engine setup (``ferrokv.engine_setup``): device and dtype choice, EOS ids, KV block count."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch

from ferrokv.engine_args import EngineArgs
from ferrokv.engine_setup import activation_bytes_estimate, eos_token_ids, num_kv_blocks, resolve_device, resolve_dtype
from ferrokv.kv_cache import KVCacheSpec
from ferrokv.sampling_params import SamplingParams


def test_device_and_dtype():
    assert resolve_device("cpu").type == "cpu"
    if not torch.cuda.is_available():
        assert resolve_device("auto").type == "cpu"
        with pytest.raises(ValueError, match="device='cuda'"):
            resolve_device("cuda")
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", {"torch_dtype": "bfloat16"}, cpu) == torch.float32
    assert resolve_dtype("auto", {"torch_dtype": "float16"}, torch.device("cuda")) == torch.float16
    assert resolve_dtype("auto", {"torch_dtype": "float32"}, torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float16", {}, cpu) == torch.float16


def test_eos_ids_are_the_tokenizers_then_the_generation_configs_else_the_configs(tmp_path):
    """vLLM reads generation_config.json and falls back to config.json only without it: a config
    EOS the generation config leaves out does not stop (as in transformers' generate)."""
    class Tok:
        eos_token_id = 2
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2, 999]}))
    assert eos_token_ids(Tok(), {"eos_token_id": [3, 2]}, tmp_path / "generation_config.json", 100) == (2, 7)
    assert eos_token_ids(Tok(), {"eos_token_id": [3, 2]}, None, vocab_size=100) == (2, 3)


def test_eos_ids_come_from_the_generation_config_engine_args_name(tiny_model_dir, tmp_path):
    """vLLM reads the extra EOS ids from the generation config it reads: a folder given instead of
    the model's; the model's own with generation_config='vllm' too (which only drops the sampling
    defaults: a model's <|eot_id|> must still stop)."""
    import shutil

    from ferrokv import LLM

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 5], "temperature": 0.7}))
    folder = tmp_path / "gen"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2], "temperature": 0.5}))
    kw = dict(device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=16)
    llm = LLM(str(model), generation_config=str(folder), **kw)
    assert 2 in llm.llm_engine.eos_token_ids and 5 not in llm.llm_engine.eos_token_ids
    assert llm.llm_engine.default_sampling_params == {"temperature": 0.5}
    plain = LLM(str(model), generation_config="vllm", **kw)
    assert 5 in plain.llm_engine.eos_token_ids and 2 not in plain.llm_engine.eos_token_ids
    assert plain.llm_engine.default_sampling_params == {}
    for x in (llm, plain):
        x.engine_loop.shutdown()


def test_kv_blocks_from_a_count_a_budget_or_the_cpu_default():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32)
    cpu = torch.device("cpu")
    assert num_kv_blocks(EngineArgs(num_kv_blocks=40), spec, cpu, 128) == 40
    assert num_kv_blocks(EngineArgs(kv_cache_memory=10 * spec.bytes_per_block), spec, cpu, 128) == 10
    # CPU default: capped at every sequence at full length (+ the null block).
    assert num_kv_blocks(EngineArgs(max_num_seqs=4), spec, cpu, 128) == 4 * 8 + 1
    with pytest.raises(ValueError, match="kv_cache_memory"):
        num_kv_blocks(EngineArgs(kv_cache_memory=spec.bytes_per_block), spec, cpu, 128)


def test_max_model_len_beyond_the_models_positions_is_refused_unless_allowed(monkeypatch):
    from ferrokv.engine_setup import checked_max_model_len

    for name in ("FERROKV_ALLOW_LONG_MAX_MODEL_LEN", "VLLM_ALLOW_LONG_MAX_MODEL_LEN"):
        monkeypatch.delenv(name, raising=False)
    rule = "config.json's max_position_embeddings"
    assert checked_max_model_len(None, 512, rule) == 512 and checked_max_model_len(100, 512, rule) == 100
    with pytest.raises(ValueError, match=r"max_model_len=100000 is more than the model's 512 positions "
                                         r"\(config.json's max_position_embeddings\); set FERROKV_ALLOW"):
        checked_max_model_len(100_000, 512, rule)
    for name in ("FERROKV_ALLOW_LONG_MAX_MODEL_LEN", "VLLM_ALLOW_LONG_MAX_MODEL_LEN"):  # vLLM's name works too
        with monkeypatch.context() as m:
            m.setenv(name, "1")
            assert checked_max_model_len(100_000, 512, rule) == 100_000


def test_a_kv_cache_the_machine_cannot_hold_is_a_value_error_naming_its_setting():
    from ferrokv.engine_setup import _available_cpu_memory, allocate_kv_cache

    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32)
    cpu = torch.device("cpu")
    huge = 2 * (_available_cpu_memory() or 1 << 45) // spec.bytes_per_block
    for args, name in ((EngineArgs(num_gpu_blocks_override=huge), "num_gpu_blocks_override"),
                       (EngineArgs(kv_cache_memory_bytes=huge * spec.bytes_per_block), "kv_cache_memory_bytes")):
        with pytest.raises(ValueError, match=rf"^{name}: {huge} KV blocks of {spec.bytes_per_block} bytes"):
            allocate_kv_cache(args, spec, num_kv_blocks(args, spec, cpu, 128), cpu)
    with pytest.raises(ValueError, match="num_cpu_blocks"):
        allocate_kv_cache(EngineArgs(num_cpu_blocks=huge), spec, 4, cpu)
    assert allocate_kv_cache(EngineArgs(), spec, 4, cpu).num_blocks == 4


def test_a_pinned_swap_pool_is_checked_at_the_size_the_host_allocator_gives_it(monkeypatch):
    """On a GPU the swap pool is pinned, and torch's caching host allocator rounds each of its 2 x
    num_layers tensors up to a power of two: the memory check counts that, refusing before
    allocating (no GPU needed: the check comes first)."""
    from ferrokv import engine_setup

    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32)
    exact = 3 * spec.bytes_per_block  # 4 tensors of 6 KiB each, pinned as 8 KiB each
    assert spec.swap_pool_bytes(3, torch.device("cpu")) == exact
    assert spec.swap_pool_bytes(3, torch.device("cuda")) == 4 * 8192 > exact
    monkeypatch.setattr(engine_setup, "_available_cpu_memory", lambda: exact + 1024)
    with pytest.raises(ValueError, match=r"num_cpu_blocks, 32768 bytes of host memory\) need more memory"):
        engine_setup.allocate_kv_cache(EngineArgs(num_cpu_blocks=3), spec, 4, torch.device("cuda"))


# ------------------------------------------------------------------------------------------------
# EngineArgs: vLLM's names, ferrokv's former names as aliases, vLLM's arguments accepted as no-ops
# ------------------------------------------------------------------------------------------------
def test_vllm_names_and_their_aliases_give_the_same_kv_blocks():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32)
    cpu = torch.device("cpu")
    assert num_kv_blocks(EngineArgs(num_gpu_blocks_override=40), spec, cpu, 128) == 40
    assert num_kv_blocks(EngineArgs(kv_cache_memory_bytes=10 * spec.bytes_per_block), spec, cpu, 128) == 10
    a = EngineArgs(num_kv_blocks=40, kv_cache_memory=7)
    assert (a.num_gpu_blocks_override, a.kv_cache_memory_bytes) == (40, 7)
    assert (a.num_kv_blocks, a.kv_cache_memory) == (None, None)  # folded


@pytest.mark.parametrize("kw, match", [
    (dict(num_kv_blocks=8, num_gpu_blocks_override=8), "num_kv_blocks=8 and num_gpu_blocks_override=8 were both given"),
    (dict(kv_cache_memory=1, kv_cache_memory_bytes=2), "kv_cache_memory=1 and kv_cache_memory_bytes=2 were both given"),
    (dict(num_kv_blocks=0), "num_kv_blocks must be a positive integer, got 0"),
    (dict(kv_cache_memory="1G"), "kv_cache_memory must be a positive integer, got '1G'"),
])
def test_an_alias_and_its_name_together_or_bad_values_fail(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(**kw)


@pytest.mark.parametrize("kw, match", [
    (dict(num_gpu_blocks_override=1), "invalid num_gpu_blocks_override=1: must be >= 2"),
    (dict(kv_cache_memory_bytes=-1), "kv_cache_memory_bytes must be a positive integer, got -1"),
    (dict(tensor_parallel_size=2), "tensor_parallel_size=2 is not supported yet"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be a positive integer, got 0"),
    (dict(tensor_parallel_size=True), "tensor_parallel_size must be a positive integer, got True"),
    (dict(quantization="awq"), "quantization='awq' is not supported yet"),
    (dict(enforce_eager="yes"), "enforce_eager must be True or False, got 'yes'"),
    (dict(trust_remote_code=1), "trust_remote_code must be True or False, got 1"),
    (dict(swap_space=-1), "swap_space must be a number of GiB >= 0, got -1"),
    (dict(disable_log_stats="no"), "disable_log_stats must be True or False, got 'no'"),
    (dict(enable_chunked_prefill=False), "enable_chunked_prefill=False is not supported"),
    (dict(kv_cache_dtype="fp8"), "kv_cache_dtype must be one of auto; got 'fp8'"),
    (dict(load_format="npcache"), "load_format must be one of auto, safetensors, pt; got 'npcache'"),
    (dict(tokenizer_mode="slow"), "tokenizer_mode must be one of auto, hf; got 'slow'"),
    (dict(logprobs_mode="processed_logprobs"), "logprobs_mode must be one of raw_logprobs; got 'processed_logprobs'"),
    (dict(dtype=torch.float64), "dtype must be one of .*; got 'float64'"),
    (dict(enable_prefix_caching="no"), "enable_prefix_caching must be True or False, got 'no'"),
    (dict(gpu_memory_utilization="0.5"), r"gpu_memory_utilization must be in \(0, 1\], got '0.5'"),
    (dict(gpu_memory_utilization=True), r"gpu_memory_utilization must be in \(0, 1\], got True"),
])
def test_vllm_arguments_check_their_values(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(**kw).validate()


def test_vllm_arguments_at_supported_values_are_accepted():
    EngineArgs(enforce_eager=True, tensor_parallel_size=1, trust_remote_code=True, quantization=None).validate()
    EngineArgs(enforce_eager=False, trust_remote_code=False).validate()
    # What scripts written for vLLM commonly pass.
    EngineArgs(swap_space=8, disable_log_stats=True, enable_chunked_prefill=True, kv_cache_dtype="auto",
               load_format="safetensors", tokenizer_mode="auto", logprobs_mode="raw_logprobs").validate()
    # vLLM takes a dtype as a torch.dtype or a name in any letter case.
    for given, name in ((torch.bfloat16, "bfloat16"), (torch.float16, "float16"), (torch.float32, "float32"),
                        ("BFloat16", "bfloat16"), ("Half", "half"), ("AUTO", "auto")):
        args = EngineArgs(dtype=given)
        args.validate()
        assert args.dtype == name


def test_llm_takes_both_names_and_refuses_remote_code(tiny_model_dir, tmp_path):
    from ferrokv import LLM

    path = tiny_model_dir("llama", "llama")
    common = dict(device="cpu", dtype="float32", max_model_len=32, block_size=4)
    for kw in (dict(num_gpu_blocks_override=9), dict(num_kv_blocks=9)):
        llm = LLM(str(path), enforce_eager=True, trust_remote_code=True, **common, **kw)
        assert llm.llm_engine.scheduler.num_blocks == 9
        llm.engine_loop.shutdown()
    with pytest.raises(ValueError, match="num_kv_blocks=9 and num_gpu_blocks_override=9 were both given"):
        LLM(str(path), num_kv_blocks=9, num_gpu_blocks_override=9, **common)
    remote = tmp_path / "remote"
    remote.mkdir()
    for f in path.iterdir():
        (remote / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((remote / "config.json").read_text())
    cfg.update(architectures=["MyCustomForCausalLM"], auto_map={"AutoModelForCausalLM": "modeling_my.MyModel"})
    (remote / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="auto_map.*which ferrokv never executes"):
        LLM(str(remote), trust_remote_code=True, **common)


def test_a_kv_cache_smaller_than_max_model_len_is_warned_about(tiny_model_dir, caplog):
    """vLLM refuses to start then; here small caches are allowed (tests and tiny machines use
    them), with a warning that long requests will be refused."""
    from ferrokv import LLM

    path = tiny_model_dir("llama", "llama")
    common = dict(device="cpu", dtype="float32", max_model_len=64, block_size=4)
    for blocks, warned in ((9, True), (17, False)):  # 8 or 16 usable blocks of 4 tokens: 32 or 64 tokens
        caplog.clear()
        with caplog.at_level("WARNING", logger="ferrokv"):
            llm = LLM(str(path), num_kv_blocks=blocks, **common)
        llm.engine_loop.shutdown()
        assert ("the KV cache holds 32 tokens, fewer than max_model_len=64" in caplog.text) == warned, caplog.text


def test_a_step_budget_below_max_num_seqs_is_raised_with_a_warning(tiny_model_dir, caplog):
    """vLLM refuses max_num_batched_tokens < max_num_seqs; here it is raised to max_num_seqs, and
    said (pressure7: it was silent, and a budget of 4 prefilled 40 tokens in one step)."""
    from ferrokv import LLM

    path = tiny_model_dir("llama", "llama")
    for budget, warned in ((4, True), (None, False), (8, False)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="ferrokv"):
            llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=64, max_num_seqs=8,
                      max_num_batched_tokens=budget)
        llm.engine_loop.shutdown()
        message = "max_num_batched_tokens=4 is raised to max_num_seqs=8"
        assert (message in caplog.text) == warned, caplog.text


def test_swap_preemption_without_a_cpu_pool_is_warned_about(tiny_model_dir, caplog):
    """vLLM's swap_space does not size ferrokv's pool (num_cpu_blocks does): swap mode without one
    recomputes, and the startup log says so (a vLLM-style config never swapped, silently)."""
    from ferrokv import LLM

    path = tiny_model_dir("llama", "llama")
    common = dict(device="cpu", dtype="float32", max_model_len=64, block_size=4, preemption_mode="swap")
    for extra, warned in ((dict(swap_space=4), True), (dict(num_cpu_blocks=8), False)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="ferrokv"):
            llm = LLM(str(path), **common, **extra)
        llm.engine_loop.shutdown()
        assert ("preemption_mode='swap' with num_cpu_blocks=0" in caplog.text) == warned, caplog.text


def test_a_model_folder_without_a_tokenizer_says_so_and_names_tokenizer(tiny_model_dir, tmp_path):
    from ferrokv import LLM

    path = tiny_model_dir("llama", "llama")
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        (bare / f).write_bytes((path / f).read_bytes())
    with pytest.raises(ValueError, match=r"model: '.*bare' has no tokenizer \(tokenizer.json.*give tokenizer="):
        LLM(str(bare), device="cpu", dtype="float32", max_model_len=32, num_kv_blocks=16)
    llm = LLM(str(bare), tokenizer=str(path), device="cpu", dtype="float32", max_model_len=32, num_kv_blocks=16)
    assert llm.generate([5, 6, 7], use_tqdm=False)[0].outputs[0].token_ids
    llm.engine_loop.shutdown()


def test_max_model_len_auto_is_the_models_capped_at_what_the_kv_cache_holds(tiny_model_dir):
    """vLLM's max_model_len=-1 ("auto" on the command line): the model's context, or the longest
    sequence the KV cache can hold when that is less."""
    from ferrokv import LLM, SamplingParams
    from ferrokv.cli import _parser

    path = tiny_model_dir("llama")  # 512 positions
    roomy = LLM(str(path), max_model_len=-1, num_kv_blocks=64, block_size=16)
    assert roomy.llm_engine.max_model_len == 512
    tight = LLM(str(path), max_model_len=-1, num_kv_blocks=9, block_size=16)
    assert tight.llm_engine.max_model_len == 8 * 16
    out = tight.generate({"prompt_token_ids": list(range(5, 5 + 120))}, SamplingParams(max_tokens=50,
                                                                                       ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8 * 16 - 120 and out[0].outputs[0].finish_reason == "length"
    assert _parser().parse_args(["generate", "--max-model-len", "auto"]).max_model_len == -1
    assert EngineArgs(max_model_len="auto").max_model_len == EngineArgs(max_model_len=" AUTO ").max_model_len == -1
    with pytest.raises(ValueError, match=r"max_model_len must be a positive integer or -1 / 'auto' .*, got 'big'"):
        EngineArgs(max_model_len="big").validate()
    for llm in (roomy, tight):
        llm.engine_loop.shutdown()


def test_default_max_model_len_counts_the_rope_scaling_factor(tiny_model_dir):
    """vLLM's default context: max_position_embeddings times a linear/dynamic factor (yarn: the
    original positions times it), so a scaled model takes the prompts it was scaled for."""
    from ferrokv import LLM, SamplingParams

    path = tiny_model_dir("linear-rope-16", "llama", rope_scaling={"rope_type": "linear", "factor": 4.0},
                          max_position_embeddings=16)
    llm = LLM(str(path), num_kv_blocks=64)
    assert llm.llm_engine.max_model_len == 64
    out = llm.generate({"prompt_token_ids": list(range(5, 35))}, SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) >= 1  # a 30-token prompt, beyond the 16 positions


def test_hf_overrides_set_config_keys_on_top_of_the_models(tiny_model_dir, tmp_path):
    """vLLM's hf_overrides (how Qwen documents turning YaRN on, a rope_scaling): the model runs as
    if its config.json had those keys."""
    import json
    import shutil

    from ferrokv import LLM, SamplingParams

    base = tiny_model_dir("llama")
    rope = {"rope_scaling": {"rope_type": "linear", "factor": 8.0}, "max_position_embeddings": 32}
    edited = tmp_path / "edited"
    shutil.copytree(base, edited)
    cfg = json.loads((edited / "config.json").read_text())
    (edited / "config.json").write_text(json.dumps({**cfg, **rope}))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(5, 45))}
    over = LLM(str(base), num_kv_blocks=64, hf_overrides=rope)
    want = LLM(str(edited), num_kv_blocks=64)
    plain = LLM(str(base), num_kv_blocks=64, max_model_len=256)
    assert over.llm_engine.max_model_len == want.llm_engine.max_model_len == 256  # 32 positions x 8
    got = over.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert got != plain.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids  # the override mattered
    with pytest.raises(ValueError, match="hf_overrides must be a dict of config.json keys"):
        EngineArgs(hf_overrides=[("max_position_embeddings", 8)]).validate()


def test_gpu_memory_utilization_is_this_instances_share(monkeypatch):
    """vLLM's per-instance fraction: memory another process holds does not count against it (two
    instances at 0.45 share a GPU); this process's own (the weights) does; a share larger than
    the free memory is refused naming gpu_memory_utilization. CUDA's memory queries are stubbed:
    no GPU here."""
    gib = 1 << 30
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (50 * gib, 100 * gib))  # 50 held elsewhere
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 5 * gib)  # our weights
    cuda = torch.device("cuda")
    n = num_kv_blocks(EngineArgs(gpu_memory_utilization=0.45), spec, cuda, 128, activation_bytes=gib)
    assert n == (45 * gib - 5 * gib - gib) // spec.bytes_per_block  # less the weights and the activations
    with pytest.raises(ValueError, match=r"gpu_memory_utilization: 0\.6 .* less the 5368709120 this process holds and "
                       r"an estimated 1073741824 for a step's activations, 57982058496 are left for the KV cache, but "
                       r"only 53687091200 bytes are free"):
        num_kv_blocks(EngineArgs(gpu_memory_utilization=0.6), spec, cuda, 128, activation_bytes=gib)
    # Nothing left once the weights and the activations are counted: refused, saying how it splits.
    with pytest.raises(ValueError, match=r"0\.1 .* is 10737418240; less the 5368709120 this process holds and an "
                       r"estimated 6442450944 for a step's activations, -1073741824 are left for the KV cache: "
                       r"raise it"):
        num_kv_blocks(EngineArgs(gpu_memory_utilization=0.1), spec, cuda, 128, activation_bytes=6 * gib)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 45 * gib - 4096)
    with pytest.raises(ValueError, match="gpu_memory_utilization: 4096 bytes hold 0 KV blocks"):
        num_kv_blocks(EngineArgs(gpu_memory_utilization=0.45), spec, cuda, 128)


def test_a_cuda_device_is_resolved_with_its_index(monkeypatch):
    """``cuda``/``auto`` name the current CUDA device by index: the engine lock makes it each
    calling thread's current device, and torch.cuda.set_device refuses a device without one.
    CUDA is stubbed: no GPU here."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    assert resolve_device("cuda") == resolve_device("auto") == torch.device("cuda", 2)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cpu") == torch.device("cpu")


def test_activation_estimate_of_a_llama3_8b_step():
    """The GPU budget leaves room for a step's activations (vLLM measures them with a profiling
    run, about 1-3 GiB for this model at its defaults); they grow with the token budget, the
    sequences' logits rows and the vocabulary."""
    from types import SimpleNamespace
    mc = SimpleNamespace(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, vocab_size=128256)
    cuda, gib = torch.device("cuda"), 1 << 30
    base = activation_bytes_estimate(mc, EngineArgs(), torch.bfloat16, cuda)
    assert 1 * gib < base < 3 * gib
    assert activation_bytes_estimate(mc, EngineArgs(max_num_batched_tokens=16384), torch.bfloat16, cuda) > base
    assert activation_bytes_estimate(mc, EngineArgs(max_num_seqs=512), torch.bfloat16, cuda) > base
    assert activation_bytes_estimate(mc, EngineArgs(), torch.float32, cuda) > base


def _peak_bytes(fn) -> int:
    """Peak bytes of the tensors ``fn`` allocates and holds at once (the profiler's allocation
    records, in order)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as d:
        trace = Path(d) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    live = peak = 0
    for _, nbytes in sorted((e["ts"], e["args"]["Bytes"]) for e in events if e.get("name") == "[memory]"):
        live += nbytes
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9, logprobs=5),
                                    dict(temperature=0.7, top_k=50, top_p=0.9, min_p=0.01, logprobs=2,
                                         presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2)])
def test_the_sampler_fits_the_activation_estimates_allowance(params):
    """A sampling step's peak memory beside its logits stays within ``SAMPLER_FP32_BUFFERS``
    float32 ``[rows, V]`` buffers, with flat rows (every top-p row takes the redo's sort)."""
    import numpy as np
    from ferrokv.engine_setup import SAMPLER_FP32_BUFFERS
    from ferrokv.sampler import SamplingMetadata, SamplingRow, sample_async
    R, V = 8, 5000
    logits = (torch.randn(R, V, generator=torch.Generator().manual_seed(0)) * 0.3).to(torch.bfloat16)
    rows = [SamplingRow(SamplingParams(seed=i, **params), uniform=float(u))
            for i, u in enumerate(np.random.default_rng(0).random(R))]
    md = SamplingMetadata.build(rows, V)
    peak = _peak_bytes(lambda: sample_async(logits, md).result())
    assert peak <= R * V * SAMPLER_FP32_BUFFERS * 4


def test_the_triton_backend_on_a_cpu_without_the_interpreter_is_refused_before_the_weights_load(
        llama_path, monkeypatch):
    """Not a server that starts healthy and fails every step: the setting is refused at load,
    naming it and what it needs."""
    from ferrokv import model_loader
    from ferrokv.engine_setup import load_engine

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(model_loader, "load_model", lambda *a, **k: pytest.fail("the weights were loaded"))
    with pytest.raises(ValueError, match="attention_backend='triton' needs a CUDA device .* got device='cpu'"):
        load_engine(EngineArgs(model=str(llama_path), device="cpu", attention_backend="triton"))


def test_an_install_without_triton_runs_the_torch_backend_and_names_what_the_triton_one_needs(llama_path):
    """triton is declared for Linux x86-64 only: elsewhere (a CPU-only torch on another platform)
    the engine must still load and generate, and asking for Triton must say what is missing."""
    import subprocess
    import sys

    script = f"""
import sys
sys.modules["triton"] = None  # as if not installed: its import raises ImportError
from ferrokv import LLM, SamplingParams
llm = LLM({str(llama_path)!r}, device="cpu", dtype="float32", max_model_len=64, block_size=4,
          num_gpu_blocks_override=64)
out = llm.generate([{{"prompt_token_ids": [5, 6, 7]}}], SamplingParams(max_tokens=3, ignore_eos=True, n=2),
                   use_tqdm=False)
assert [len(c.token_ids) for c in out[0].outputs] == [3, 3]
assert not any(m == "triton" or m.startswith("triton.") for m, v in sys.modules.items() if v is not None)
try:
    LLM({str(llama_path)!r}, device="cpu", attention_backend="triton")
except ValueError as e:
    assert "attention_backend='triton' needs the triton package" in str(e), e
else:
    raise AssertionError("the triton backend loaded without triton")
print("ok")
"""
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout + res.stderr


def test_too_many_sequences_is_named_before_max_model_len_is_known():
    from ferrokv._core import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match=r"max_num_seqs=300000000: must be <= 2\^28") as e:
        EngineArgs(model="x", max_num_seqs=300_000_000, max_num_batched_tokens=300_000_000).validate()
    assert e.value.field == "max_num_seqs"


def test_a_dropped_engine_is_freed_before_the_next_one_loads(tiny_model_dir):
    """``del llm`` leaves the engine in reference cycles until the collector runs: the next engine
    collects it before it loads, so the old KV cache is gone (on a GPU: not counted against the
    new one's share, nor held twice) even with the collector off (lifecycle9)."""
    import gc
    import weakref

    from ferrokv import LLM

    path = str(tiny_model_dir("llama"))
    was_enabled = gc.isenabled()
    gc.disable()  # only an explicit collection can free the cycles
    try:
        first = LLM(path, num_kv_blocks=64)
        cache = weakref.ref(first.llm_engine.kv_cache)
        del first
        assert cache() is not None  # held by the cycles
        second = LLM(path, num_kv_blocks=64)
        assert cache() is None
        assert second.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)[0].finished
    finally:
        if was_enabled:
            gc.enable()
