"""What an engine derives from its arguments and model before it serves: the device, the dtype,
the EOS token ids, and how many KV blocks the cache gets.

Invariants: each function reads only its arguments (and, for the KV budget on CUDA, the free
device memory); a choice the user cannot satisfy raises ``ValueError`` naming the field.
Costs: once per engine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ferrokv.engine_args import DTYPE_ALIASES, EngineArgs
from ferrokv.kv_cache import KVCacheSpec

__all__ = ["eos_token_ids", "num_kv_blocks", "resolve_device", "resolve_dtype"]

_DTYPES = {name: getattr(torch, canonical) for name, canonical in DTYPE_ALIASES.items()}
_CPU_DEFAULT_KV_BYTES = 1 << 30


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but no CUDA device is available")
    return dev


def resolve_dtype(name: str, config: Mapping[str, Any], device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # half precision matmuls are slow (and bf16 is inexact) on CPUs
    cfg = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16").replace("torch.", "")
    return _DTYPES.get(cfg, torch.bfloat16) if cfg in ("float16", "bfloat16") else torch.bfloat16


def eos_token_ids(tokenizer: Any, config: Mapping[str, Any], model_path: Path, vocab_size: int) -> tuple[int, ...]:
    """The tokenizer's EOS, then the config's, then generation_config.json's (in the vocabulary,
    each once); the first is the core's EOS, the others stop tokens unless ``ignore_eos``."""
    ids: list[int] = []

    def add(v: Any) -> None:
        for x in v if isinstance(v, list) else [v]:
            if isinstance(x, int) and x not in ids and 0 <= x < vocab_size:
                ids.append(x)

    add(tokenizer.eos_token_id)
    add(config.get("eos_token_id"))
    gen = model_path / "generation_config.json"
    if gen.is_file():
        from ferrokv.model_loader import read_json

        add(read_json(gen).get("eos_token_id"))
    return tuple(ids)


def num_kv_blocks(a: EngineArgs, spec: KVCacheSpec, device: torch.device, max_model_len: int) -> int:
    """``num_kv_blocks`` if given, else what ``kv_cache_memory`` (or, on CUDA, the free memory
    under ``gpu_memory_utilization``; on the CPU 1 GiB, capped at what every sequence at full
    length could use) holds."""
    per_block = spec.bytes_per_block
    if a.num_kv_blocks is not None:
        return a.num_kv_blocks
    if a.kv_cache_memory is not None:
        budget = a.kv_cache_memory
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        budget = int(total * a.gpu_memory_utilization) - used
    else:
        budget = _CPU_DEFAULT_KV_BYTES
    n = budget // per_block
    if device.type == "cpu" and a.kv_cache_memory is None:
        n = min(n, a.max_num_seqs * math.ceil(max_model_len / a.block_size) + 1)
    if n < 2:
        raise ValueError(
            f"kv_cache_memory: {budget} bytes hold {n} KV blocks of {per_block} bytes; at least 2 are needed"
        )
    return int(n)
