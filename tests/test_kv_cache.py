"""``ferrokv.kv_cache``: the block size formula, allocation (shapes, the memory budget) and the block
ops of a step (copy-on-write, swap out and back in, their order).

Tiny caches on the CPU, plus the GPU (copy-on-write by the Triton kernel, pinned swap pool) when
one is present. Cache contents are random so that a wrong block or layer cannot pass by chance.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ferrokv.engine import EngineArgs, LLMEngine
from ferrokv.kv_cache import KVCacheSpec, PagedKVCache, kv_bytes_per_block, kv_bytes_per_sequence

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
SPEC = KVCacheSpec(num_layers=2, num_kv_heads=3, head_dim=8, block_size=4, dtype=torch.float32)
NO_OPS = np.zeros((0, 2), dtype=np.int32)


def _pairs(*pairs: tuple[int, int]) -> np.ndarray:
    return np.array(pairs, dtype=np.int32).reshape(-1, 2)


def _filled(num_blocks: int, num_cpu_blocks: int, device: str, seed: int = 0) -> PagedKVCache:
    cache = PagedKVCache(SPEC, num_blocks, num_cpu_blocks, torch.device(device))
    g = torch.Generator().manual_seed(seed)
    for k, v in cache.layers + cache.cpu_layers:
        k.copy_(torch.randn(k.shape, generator=g))
        v.copy_(torch.randn(v.shape, generator=g))
    return cache


def _snapshot(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    return [t.cpu().clone() for kv in layers for t in kv]  # k0, v0, k1, v1, ...


# ------------------------------------------------------------------------------------------------
def test_bytes_per_block_is_the_seeds_formula():
    # 2 (K and V) * 2 layers * 3 kv heads * 8 head_dim * 4 tokens * 4 bytes
    assert SPEC.bytes_per_block == kv_bytes_per_block(2, 3, 8, 4, torch.float32) == 2 * 2 * 3 * 8 * 4 * 4
    assert kv_bytes_per_block(32, 32, 128, 16, torch.float16) == 8 * 1024 * 1024  # Llama-2-7B, 16 tokens
    assert kv_bytes_per_sequence(2, 3, 8, 10, torch.bfloat16) == 2 * 2 * 3 * 8 * 10 * 2


@pytest.mark.parametrize("device", DEVICES)
def test_allocation_shapes_match_the_formula(device):
    cache = PagedKVCache(SPEC, num_blocks=5, num_cpu_blocks=3, device=torch.device(device))
    assert len(cache.layers) == len(cache.cpu_layers) == SPEC.num_layers
    tensors = [t for kv in cache.layers for t in kv]
    for t in tensors:
        assert t.shape == (5, 4, 3, 8) and t.dtype == torch.float32 and t.device.type == device
        assert t.is_contiguous() and torch.count_nonzero(t) == 0
    assert len({t.data_ptr() for t in tensors}) == len(tensors), "every layer's K and V own their memory"
    assert sum(t.numel() * t.element_size() for t in tensors) == 5 * SPEC.bytes_per_block
    for t in (t for kv in cache.cpu_layers for t in kv):
        assert t.shape == (3, 4, 3, 8) and t.device.type == "cpu"
        assert t.is_pinned() == (device == "cuda")
    assert PagedKVCache(SPEC, 5, 0, torch.device(device)).cpu_layers == []


def test_engine_sizes_the_cache_from_the_memory_budget(tiny_model_dir):
    path = tiny_model_dir("llama", "llama")  # 2 layers, 2 kv heads, head_dim 16
    per_block = 2 * 2 * 2 * 16 * 4 * 4  # block_size 4, fp32
    args = dict(model=str(path), device="cpu", dtype="float32", max_model_len=64, block_size=4)
    engine = LLMEngine(EngineArgs(**args, kv_cache_memory=11 * per_block - 1))
    assert engine.kv_cache.spec.bytes_per_block == per_block
    assert engine.kv_cache.num_blocks == engine.scheduler.num_blocks == 10
    assert engine.kv_cache.layers[0][0].shape == (10, 4, 2, 16)
    with pytest.raises(ValueError, match="kv_cache_memory"):
        LLMEngine(EngineArgs(**args, kv_cache_memory=2 * per_block - 1))


# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_copy_on_write_copies_blocks_in_every_layer(device):
    cache = _filled(8, 0, device)
    before = _snapshot(cache.layers)
    cache.apply_block_ops(NO_OPS, NO_OPS, _pairs((3, 5), (1, 2), (7, 0)))
    after = _snapshot(cache.layers)
    for b, a in zip(before, after):
        expected = b.clone()
        expected[[5, 2, 0]] = b[[3, 1, 7]]
        assert torch.equal(a, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_swap_out_and_back_in_preserves_contents(device):
    cache = _filled(8, 4, device)
    before = _snapshot(cache.layers)
    cache.apply_block_ops(_pairs((2, 0), (4, 3)), NO_OPS, NO_OPS)
    for (ck, cv), (k, v) in zip(cache.cpu_layers, cache.layers):
        assert torch.equal(ck[[0, 3]], k[[2, 4]].cpu()) and torch.equal(cv[[0, 3]], v[[2, 4]].cpu())
    for k, v in cache.layers:  # the blocks are reused by other sequences meanwhile
        k[[2, 4]] = -1.0
        v[[2, 4]] = -1.0
    cache.apply_block_ops(NO_OPS, _pairs((3, 6), (0, 1)), NO_OPS)  # back in, to other blocks
    after = _snapshot(cache.layers)
    for b, a in zip(before, after):
        assert torch.equal(a[6], b[4]) and torch.equal(a[1], b[2])
        assert torch.equal(a[[0, 3, 5, 7]], b[[0, 3, 5, 7]]), "blocks no op names are untouched"


@pytest.mark.parametrize("device", DEVICES)
def test_one_steps_ops_run_swap_out_then_swap_in_then_copy(device):
    """Block 2 is swapped out and reused for a swapped-in block in the same step, which is then
    copied (copy-on-write of a block that came back): only that order gives these contents."""
    cache = _filled(8, 4, device)
    gpu, cpu = _snapshot(cache.layers), _snapshot(cache.cpu_layers)
    cache.apply_block_ops(_pairs((2, 0)), _pairs((1, 2)), _pairs((2, 5)))
    for g, c, g2, c2 in zip(gpu, cpu, _snapshot(cache.layers), _snapshot(cache.cpu_layers)):
        assert torch.equal(c2[0], g[2]), "swap-out read block 2 before swap-in overwrote it"
        assert torch.equal(g2[2], c[1]) and torch.equal(g2[5], c[1]), "the copy saw the swapped-in block"
