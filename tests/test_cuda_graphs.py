"""Decode CUDA graphs (ferrokv.cuda_graphs): which engines capture them and which sizes; on a GPU,
that replayed decode steps give the eager steps' tokens (and transformers'), padded sizes and
mixed steps included."""

import os

import pytest
import torch

from ferrokv.cuda_graphs import MAX_CAPTURE_BATCH, capture_sizes
from ferrokv.engine_args import EngineArgs
from ferrokv.engine_setup import uses_decode_graphs
from ferrokv.models.config import RopeConfig

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("max_num_seqs,expected", [
    (1, [1]), (2, [1, 2]), (3, [1, 2, 4]), (8, [1, 2, 4, 8]), (9, [1, 2, 4, 8, 16]),
    (100, [1, 2, 4, *range(8, 105, 8)]), (512, [1, 2, 4, *range(8, 513, 8)]), (4096, [1, 2, 4, *range(8, 513, 8)]),
])
def test_capture_sizes_are_vllms_up_to_the_first_that_holds_max_num_seqs(max_num_seqs, expected):
    assert capture_sizes(max_num_seqs) == expected
    assert capture_sizes(max_num_seqs)[-1] >= min(max_num_seqs, MAX_CAPTURE_BATCH)


def _rope(rope_type: str = "default", max_positions: int = 1024) -> RopeConfig:
    return RopeConfig(rope_type=rope_type, theta=10000.0, head_dim=16, max_position_embeddings=max_positions,
                      factor=2.0 if rope_type == "dynamic" else 1.0)


@pytest.mark.parametrize("device,backend,eager,rope,max_len,uses", [
    ("cuda", "triton", False, _rope(), 512, True),
    ("cuda", "triton", True, _rope(), 512, False),  # enforce_eager
    ("cuda", "torch", False, _rope(), 512, False),  # the torch backend reads host lengths
    ("cpu", "torch", False, _rope(), 512, False),
    ("cpu", "triton", False, _rope(), 512, False),  # the interpreter
    ("cuda", "triton", False, _rope("dynamic", 256), 512, False),  # frequencies from host lengths
    ("cuda", "triton", False, _rope("dynamic", 1024), 512, True),  # never rescales at this length
])
def test_which_engines_replay_decode_graphs(device, backend, eager, rope, max_len, uses):
    args = EngineArgs(enforce_eager=eager)
    assert uses_decode_graphs(args, torch.device(device), backend, rope, max_len) is uses


# ------------------------------------------------------------------------------------------------
# On a GPU
# ------------------------------------------------------------------------------------------------
def _llm(path, **kw):
    from ferrokv import LLM

    return LLM(str(path), device="cuda", dtype="float32", max_model_len=256, kv_cache_memory_bytes=1 << 27,
               max_num_seqs=24, **kw)


@needs_cuda
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_replayed_decode_steps_give_the_eager_tokens_and_transformers(tiny_model_dir, hf_model, arch):
    from ferrokv import SamplingParams

    path = tiny_model_dir(arch, arch)
    # 13 and 3 sequences run in padded sizes (16, 4); the second batch hits the prefix cache, and
    # staggered lengths end sequences mid-run (smaller batches, other sizes).
    prompts = [[(7 * i + 13 * j) % 300 + 3 for j in range(5 + 9 * i)] for i in range(13)]
    params = [SamplingParams(temperature=0, max_tokens=6 + 2 * i, ignore_eos=True) for i in range(13)]
    graphed, eager = _llm(path), _llm(path, enforce_eager=True)
    assert graphed.llm_engine.runner.graphs is not None and eager.llm_engine.runner.graphs is None
    for batch in (prompts, prompts[:3], prompts):
        inputs = [{"prompt_token_ids": p} for p in batch]
        a = graphed.generate(inputs, params[:len(batch)], use_tqdm=False)
        b = eager.generate(inputs, params[:len(batch)], use_tqdm=False)
        assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert graphed.llm_engine.runner.graphs.replays > 0
    torch.backends.cuda.matmul.allow_tf32 = False
    hf = hf_model(path).cuda()
    for p, o, sp in zip(prompts, a, params):
        ref = hf.generate(torch.tensor([p]).cuda(), max_new_tokens=sp.max_tokens, do_sample=False)[0, len(p):]
        assert list(o.outputs[0].token_ids) == ref.tolist()
    hf.cpu()


@needs_cuda
def test_replayed_decode_steps_sample_as_the_eager_ones(tiny_model_dir):
    from ferrokv import SamplingParams

    path = tiny_model_dir("llama", "llama")
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=5, n=3, max_tokens=12, ignore_eos=True)
    inputs = [{"prompt_token_ids": [5 + i, 9, 11 + i]} for i in range(5)]
    a = _llm(path).generate(inputs, sp, use_tqdm=False)
    b = _llm(path, enforce_eager=True).generate(inputs, sp, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in a] == [[c.token_ids for c in o.outputs] for o in b]


# ------------------------------------------------------------------------------------------------
# On the CPU: everything but the CUDA mechanics. A graph replays the captured kernels on the
# static buffers into its output; ``EagerReplay`` does that eagerly (Triton interpreted), so
# the copies into the static buffers, the padding rows and the routing are what is tested.
# ------------------------------------------------------------------------------------------------
class EagerReplay:
    def __init__(self, graphs, size: int, hidden: torch.Tensor) -> None:
        self.graphs, self.size, self.hidden = graphs, size, hidden

    def replay(self) -> None:
        self.hidden.copy_(self.graphs._forward(self.size, self.graphs._meta(self.size)))


def _cpu_triton_llm(path, **kw):
    from ferrokv import LLM

    return LLM(str(path), device="cpu", dtype="float32", attention_backend="triton", max_model_len=96,
               block_size=4, num_kv_blocks=160, max_num_seqs=16, **kw)


def _attach_replays(llm):
    from ferrokv.cuda_graphs import DecodeGraphs

    engine = llm.llm_engine
    graphs = DecodeGraphs(engine.model, engine.kv_cache.layers, torch.device("cpu"), 16, 96 // 4)
    hidden = engine.model.config.hidden_size
    for size in graphs.sizes:
        replay = EagerReplay(graphs, size, torch.empty(size, hidden))
        graphs._graphs[size] = (replay, replay.hidden)  # as a capture leaves it: the graph and its output
    engine.runner.graphs = graphs
    return graphs


def test_replayed_steps_pad_route_and_give_the_eager_tokens_on_the_cpu(tiny_model_dir):
    from ferrokv import SamplingParams

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton backend on the CPU needs TRITON_INTERPRET=1 (tests/conftest.py sets it)")
    path = tiny_model_dir("llama", "llama")
    replayed, eager = _cpu_triton_llm(path), _cpu_triton_llm(path)
    graphs = _attach_replays(replayed)
    assert graphs.sizes == [1, 2, 4, 8, 16]
    # 5 and 3 sequences run in sizes 8 and 4 (padding rows); staggered lengths shrink the batch.
    prompts = [[(7 * i + 13 * j) % 300 + 3 for j in range(3 + 5 * i)] for i in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True) for i in range(5)]
    for batch in (prompts, prompts[:3]):
        inputs = [{"prompt_token_ids": p} for p in batch]
        a = replayed.generate(inputs, params[:len(batch)], use_tqdm=False)
        b = eager.generate(inputs, params[:len(batch)], use_tqdm=False)
        assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert graphs.replays > 0
    # Padding rows were left writing nothing and attending to nothing.
    assert graphs.slot_mapping[3:4].tolist() == [-1] and graphs.seq_lens[3:4].tolist() == [0]


def test_what_does_not_replay(tiny_model_dir):
    """Prompt logprobs, a prefill and a batch over the largest size run eagerly; so does a block
    table wider than captured."""
    from ferrokv import SamplingParams

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1")
    llm = _cpu_triton_llm(tiny_model_dir("llama", "llama"))
    graphs = _attach_replays(llm)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=1), use_tqdm=False)
    assert graphs.replays == 0  # a prefill that samples its one token
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, prompt_logprobs=1), use_tqdm=False)
    assert graphs.replays == 2  # the two decodes after the prefill (prompt logprobs only in the prefill)
    assert graphs.size_for(16, 24) == 16 and graphs.size_for(17, 24) is None and graphs.size_for(3, 25) is None
    assert graphs.size_for(0, 1) is None and graphs.size_for(3, 24) == 4


def test_a_capture_that_fails_leaves_the_engine_eager(tiny_model_dir, caplog):
    """Here the failure is real: there is no CUDA device to capture on (or, on a GPU, the CPU
    model's weights are not on it)."""
    from ferrokv.engine_setup import capture_decode_graphs

    llm = _cpu_triton_llm(tiny_model_dir("llama", "llama"))
    engine = llm.llm_engine
    with caplog.at_level("WARNING", logger="ferrokv"):
        got = capture_decode_graphs(EngineArgs(), engine.model, engine.kv_cache, torch.device("cuda"), 96)
    assert got is None and "CUDA graphs: capture failed" in caplog.text and "every step runs eagerly" in caplog.text
