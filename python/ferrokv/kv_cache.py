"""The paged KV cache tensors: sizing, allocation, and the block ops the scheduler emits.

Layout: per layer, ``k`` and ``v`` of shape ``[num_blocks, block_size, num_kv_heads, head_dim]``;
block 0 is the null block (padding only). A CPU pool of the same layout backs swap preemption.

Sizing follows the seeds' formula for the bytes one block holds,
``M_KV(block) = 2 (K and V) * num_layers * num_kv_heads * head_dim * block_size * dtype_bytes``,
so ``num_blocks = budget_bytes // M_KV(block)``.

Invariants: the ops of one step run before its forward pass, in the order swap-out, swap-in,
copy-on-write (a block swapped in may be copied in the same step, never the reverse).
Costs: memory is allocated once at startup; each op is one gather/scatter per layer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

logger = logging.getLogger("ferrokv")


def kv_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
    """M_KV of one block: K and V of every layer for ``block_size`` tokens."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * num_kv_heads * head_dim * block_size * elem


def kv_bytes_per_sequence(num_layers: int, num_kv_heads: int, head_dim: int, seq_len: int, dtype: torch.dtype) -> int:
    """The seeds' M_KV for one sequence of ``seq_len`` tokens stored contiguously."""
    return kv_bytes_per_block(num_layers, num_kv_heads, head_dim, seq_len, dtype)


@dataclass(slots=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """One block of one layer's K (or V) cache: the only place the layout is spelled out."""
        return (self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.num_layers, self.num_kv_heads, self.head_dim, self.block_size, self.dtype)

    def swap_pool_bytes(self, num_cpu_blocks: int, device: torch.device) -> int:
        """Host memory the swap pool takes: K and V of each layer, one tensor each; pinned ones
        (``pins_swap_pool``) come from torch's caching host allocator, which rounds each up to a
        power of two."""
        per_tensor = num_cpu_blocks * self.bytes_per_block // (2 * self.num_layers)
        if pins_swap_pool(device) and per_tensor > 1:
            per_tensor = 1 << (per_tensor - 1).bit_length()
        return 2 * self.num_layers * per_tensor


def pins_swap_pool(device: torch.device) -> bool:
    """Pinned host memory lets swap copies to and from a GPU run asynchronously."""
    return device.type == "cuda"


_Layers = list[tuple[Tensor, Tensor]]  # per layer (k, v), each [num_blocks, *block_shape]


class PagedKVCache:
    """Per-layer paged K/V tensors on the model's device plus an optional CPU swap pool."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, num_cpu_blocks: int, device: torch.device) -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.device = device
        self.layers = self._allocate(num_blocks, device, pin=False)
        self.cpu_layers = self._allocate(num_cpu_blocks, torch.device("cpu"), pin=pins_swap_pool(device))

    def _allocate(self, num_blocks: int, device: torch.device, pin: bool) -> _Layers:
        if num_blocks == 0:
            return []
        shape = (num_blocks, *self.spec.block_shape)
        dt = self.spec.dtype
        # Zeroed so that never-written slots hold finite values.
        return [
            (torch.zeros(shape, dtype=dt, device=device, pin_memory=pin),
             torch.zeros(shape, dtype=dt, device=device, pin_memory=pin))
            for _ in range(self.spec.num_layers)
        ]

    def apply_block_ops(self, swap_out: np.ndarray, swap_in: np.ndarray, copy_ops: np.ndarray) -> None:
        """Runs one step's ops ([K, 2] int32 (src, dst) pairs each) in the required order."""
        if swap_out.size:
            self._move_blocks(swap_out, self.layers, self.cpu_layers)
        if swap_in.size:
            self._move_blocks(swap_in, self.cpu_layers, self.layers)
        if copy_ops.size:
            if self.device.type == "cuda":
                from ferrokv.kernels.copy_blocks import copy_blocks

                mapping = torch.from_numpy(copy_ops.astype(np.int64)).to(self.device)
                copy_blocks([k for k, _ in self.layers], [v for _, v in self.layers], mapping)
            else:
                self._move_blocks(copy_ops, self.layers, self.layers)

    @staticmethod
    def _move_blocks(pairs: np.ndarray, src: _Layers, dst: _Layers) -> None:
        """Block ``d`` of ``dst`` := block ``s`` of ``src`` for every (s, d) pair, every layer; the
        two sides may be one cache (all sources are gathered before any write) or two devices."""
        s = torch.from_numpy(pairs[:, 0].astype(np.int64))
        d = torch.from_numpy(pairs[:, 1].astype(np.int64))
        s_dev, d_dev = s.to(src[0][0].device), d.to(dst[0][0].device)
        # A copy to the host must be complete before the host reads it (index_copy_ on the CPU
        # runs at once); one to the device is ordered by the stream.
        non_blocking = dst[0][0].device.type != "cpu"
        for (sk, sv), (dk, dv) in zip(src, dst):
            dk.index_copy_(0, d_dev, sk.index_select(0, s_dev).to(dk.device, non_blocking=non_blocking))
            dv.index_copy_(0, d_dev, sv.index_select(0, s_dev).to(dv.device, non_blocking=non_blocking))
