"""Turns one ``SchedulerOutput`` into logits: block ops, input tensors, forward pass.

Invariants: the model's weights and the KV cache are on the runner's device (checked at
construction: ``DeviceMismatchError`` otherwise); the scheduler's numpy arrays are wrapped with
``torch.from_numpy`` (no copy on the CPU, one host-to-device copy each on a GPU), except block
tables that view the scheduler's batch matrix (``block_tables_is_view``), which are compacted to
``[S, M]`` once, so no tensor of a step aliases memory a later step rewrites; the attention
metadata is built once per step and shared by every layer; logits are computed only for the rows
that sample.
Costs per step: O(tokens + sequences * max_blocks) host work, independent of the number of
requests waiting or finished.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ferrokv._core import SchedulerOutput
from ferrokv.attention import AttentionMetadata
from ferrokv.checks import check_same_device
from ferrokv.kv_cache import PagedKVCache

logger = logging.getLogger("ferrokv")


@dataclass(slots=True)
class StepInputs:
    """One step's model inputs, on the runner's device."""

    input_ids: Tensor  # int64 [T]
    positions: Tensor  # int64 [T]
    meta: AttentionMetadata
    logits_indices: Tensor | None  # int64 [R]; None when no row samples


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: PagedKVCache, device: torch.device) -> None:
        weight = next(model.parameters(), None)
        if weight is not None:
            check_same_device("the model", weight.device, "the model runner", device)
        if kv_cache.layers:
            check_same_device("the KV cache", kv_cache.layers[0][0].device, "the model runner", device)
        self.model = model
        self.kv_cache = kv_cache
        self.device = device

    def _tensor(self, a: np.ndarray) -> Tensor:
        t = torch.from_numpy(a)
        return t if self.device.type == "cpu" else t.to(self.device, non_blocking=True)

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        """The step's tensors; call between ``schedule()`` and ``update()`` (block tables)."""
        qsl = out.query_start_loc
        seq_lens = out.seq_lens
        block_tables = out.block_tables
        if out.block_tables_is_view:
            # Rows of the scheduler's persistent batch matrix, wider than this step's M and
            # rewritten by later steps: one compact copy, which a device upload makes anyway.
            block_tables = block_tables.copy(order="C")
        meta = AttentionMetadata(
            slot_mapping=self._tensor(out.slot_mapping),
            query_start_loc=self._tensor(qsl),
            seq_lens=self._tensor(seq_lens),
            block_tables=self._tensor(block_tables),
            max_query_len=int(np.diff(qsl).max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc_host=qsl.astype(np.int64),
            seq_lens_host=seq_lens.astype(np.int64),
        )
        logits_indices = self._tensor(out.logits_indices) if out.num_rows else None
        return StepInputs(self._tensor(out.input_ids), self._tensor(out.positions), meta, logits_indices)

    @torch.no_grad()
    def execute(self, out: SchedulerOutput) -> Tensor | None:
        """Runs the step; returns float32 logits ``[num_rows, vocab]`` or None if nothing samples."""
        self.kv_cache.apply_block_ops(out.swap_out, out.swap_in, out.copy_ops)
        if out.num_tokens == 0:
            return None
        inputs = self.prepare(out)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache.layers, inputs.meta)
        if inputs.logits_indices is None:
            return None
        return self.model.compute_logits(hidden.index_select(0, inputs.logits_indices))
