"""Engine setup (``ferrokv.engine_setup``): device and dtype choice, EOS ids, KV block count."""

from __future__ import annotations

import json

import pytest
import torch

from ferrokv.engine_args import EngineArgs
from ferrokv.engine_setup import eos_token_ids, num_kv_blocks, resolve_device, resolve_dtype
from ferrokv.kv_cache import KVCacheSpec


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


def test_eos_ids_merge_tokenizer_config_and_generation_config(tmp_path):
    class Tok:
        eos_token_id = 2
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2, 999]}))
    assert eos_token_ids(Tok(), {"eos_token_id": [3, 2]}, tmp_path, vocab_size=100) == (2, 3, 7)


def test_kv_blocks_from_a_count_a_budget_or_the_cpu_default():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32)
    cpu = torch.device("cpu")
    assert num_kv_blocks(EngineArgs(num_kv_blocks=40), spec, cpu, 128) == 40
    assert num_kv_blocks(EngineArgs(kv_cache_memory=10 * spec.bytes_per_block), spec, cpu, 128) == 10
    # CPU default: capped at every sequence at full length (+ the null block).
    assert num_kv_blocks(EngineArgs(max_num_seqs=4), spec, cpu, 128) == 4 * 8 + 1
    with pytest.raises(ValueError, match="kv_cache_memory"):
        num_kv_blocks(EngineArgs(kv_cache_memory=spec.bytes_per_block), spec, cpu, 128)
