"""Turns one ``SchedulerOutput`` into logits: block ops, input tensors, forward pass.

Invariants: the scheduler's numpy arrays are wrapped with ``torch.from_numpy`` (no copy on the
CPU, one host-to-device copy each on a GPU), except the block tables, which view the scheduler's
read-only batch matrix and are compacted to ``[S, M]`` once; the attention metadata is built
once per step and shared by every layer; logits are computed only for the rows that sample.
Costs per step: O(tokens + sequences * max_blocks) host work, independent of the number of
requests waiting or finished.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import Tensor

from ferrokv._core import SchedulerOutput
from ferrokv.attention import AttentionMetadata
from ferrokv.kv_cache import PagedKVCache

logger = logging.getLogger("ferrokv")


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: PagedKVCache, device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device

    def _tensor(self, a: np.ndarray) -> Tensor:
        if not a.flags.writeable:
            # The block tables view the scheduler's persistent (read-only) batch matrix, with
            # rows wider than the step's M: one compact copy, which a device upload makes anyway.
            a = a.copy(order="C")
        t = torch.from_numpy(a)
        return t if self.device.type == "cpu" else t.to(self.device, non_blocking=True)

    @torch.no_grad()
    def execute(self, out: SchedulerOutput) -> Tensor | None:
        """Runs the step; returns float32 logits ``[num_rows, vocab]`` or None if nothing samples."""
        self.kv_cache.apply_block_ops(out.swap_out, out.swap_in, out.copy_ops)
        if out.num_tokens == 0:
            return None
        qsl = out.query_start_loc
        seq_lens = out.seq_lens
        meta = AttentionMetadata(
            slot_mapping=self._tensor(out.slot_mapping),
            query_start_loc=self._tensor(qsl),
            seq_lens=self._tensor(seq_lens),
            block_tables=self._tensor(out.block_tables),
            max_query_len=int(np.diff(qsl).max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc_host=qsl.astype(np.int64),
            seq_lens_host=seq_lens.astype(np.int64),
        )
        hidden = self.model(self._tensor(out.input_ids), self._tensor(out.positions), self.kv_cache.layers, meta)
        if out.num_rows == 0:
            return None
        rows = hidden.index_select(0, self._tensor(out.logits_indices))
        return self.model.compute_logits(rows)
