"""Turns one ``SchedulerOutput`` into logits: block ops, input tensors, forward pass.

Invariants: the model's weights and the KV cache are on the runner's device (checked at
construction: ``DeviceMismatchError`` otherwise); the scheduler's numpy arrays become tensors
through ``InputBuffers`` (zero-copy views on the CPU; one pinned buffer and one non-blocking copy
per step on a GPU). On the CPU a step's tensors alias the scheduler's buffers, block tables that
view its batch matrix (``block_tables_is_view``) included, so they are valid until the step's
``update()``, which the engine calls only after the step's forward pass; ``prepare`` (the
scheduler's thread) reads the step, ``forward`` reads only what ``prepare`` made, so it may run on
another thread (rows a stop or an abort ends meanwhile are only marked dead, never moved); the attention
metadata is built once per step and shared by every layer; logits are computed only for the rows
that sample, then for the prompt positions whose logprobs a request asked for (after them).
On a GPU with decode graphs (``ferrokv.cuda_graphs``), a step whose every sequence decodes one
token replays the captured forward pass of its batch size; other steps run eagerly.
Costs per step on the CPU: O(tokens + sequences) host work, independent of the sequences' lengths
and of the number of requests waiting or finished; a GPU upload adds O(sequences * max_blocks)
bytes copied.
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
from ferrokv.cuda_graphs import DecodeGraphs
from ferrokv.input_buffers import InputBuffers
from ferrokv.kv_cache import PagedKVCache

logger = logging.getLogger("ferrokv")


@dataclass(slots=True)
class StepInputs:
    """One step's model inputs, on the runner's device."""

    input_ids: Tensor | None  # int64 [T]; None when the step computes no token
    positions: Tensor | None  # int64 [T]
    meta: AttentionMetadata | None
    logits_indices: Tensor | None  # int64 [R + P]; None when no row samples and P = 0, or every token samples
    every_token_samples: bool  # logits row i is token i, for every token: the hidden states as they are
    # Block operations to apply before the forward pass (int32 pairs, flattened).
    swap_out: np.ndarray
    swap_in: np.ndarray
    copy_ops: np.ndarray


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: PagedKVCache, device: torch.device,
                 graphs: DecodeGraphs | None = None) -> None:
        weight = next(model.parameters(), None)
        if weight is not None:
            check_same_device("the model", weight.device, "the model runner", device)
        if kv_cache.layers:
            check_same_device("the KV cache", kv_cache.layers[0][0].device, "the model runner", device)
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.buffers = InputBuffers(device)
        self.graphs = graphs

    def prepare(self, out: SchedulerOutput, prompt_indices: np.ndarray | None = None) -> StepInputs:
        """The step's tensors; call between ``schedule()`` and ``update()`` (block tables), on
        the thread that drives the scheduler. Everything the forward pass needs is copied or
        viewed here, so ``forward`` touches neither the scheduler nor ``out``.
        ``prompt_indices`` (int64 [P]): token indices whose logits follow the sampling rows'
        (prompt logprobs)."""
        ops = (out.swap_out, out.swap_in, out.copy_ops)
        if out.num_tokens == 0:
            return StepInputs(None, None, None, None, False, *ops)
        qsl = out.query_start_loc
        seq_lens = out.seq_lens
        # Possibly a strided view of the scheduler's persistent batch matrix (rows wider than this
        # step's M). It holds still until this step's update(), which comes after its forward
        # pass: the CPU reads it in place (no copy growing with the sequences' lengths), a device
        # upload copies it into the staging buffer.
        block_tables = out.block_tables
        arrays = [out.input_ids, out.positions, out.slot_mapping, qsl, seq_lens, block_tables]
        # Every token a single-token decode that samples once (each decode samples at least one
        # row, so R = T means exactly one, at its own token): logits row i is token i, and the
        # hidden states need no gather (a copy of [T, hidden] on the CPU, a kernel on a GPU).
        plp = prompt_indices is not None and len(prompt_indices) > 0
        every_token = out.num_decode_tokens == out.num_tokens == out.num_rows and not plp
        logits_indices = out.logits_indices if out.num_rows and not every_token else None
        if plp:
            logits_indices = prompt_indices if logits_indices is None else np.concatenate([logits_indices, prompt_indices])
        if logits_indices is not None:
            arrays.append(logits_indices)
        staged = self.buffers.stage(arrays)
        input_ids, positions, slot_mapping, qsl_t, seq_lens_t, tables_t = staged[:6]
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=qsl_t,
            seq_lens=seq_lens_t,
            block_tables=tables_t,
            max_query_len=out.max_query_len,
            max_seq_len=out.max_seq_len,
            query_start_loc_host=qsl.astype(np.int64),
            seq_lens_host=seq_lens.astype(np.int64),
            prompt_lens_host=out.prompt_lens,
        )
        return StepInputs(input_ids, positions, meta, staged[6] if logits_indices is not None else None,
                          every_token, *ops)

    # No torch.no_grad() here: the models' forward and compute_logits run under their own, so
    # nothing here records a graph, and a context per step is host time for nothing.
    def forward(self, inputs: StepInputs) -> Tensor | None:
        """Applies the block operations and runs the model; returns float32 logits
        ``[num_rows + P, vocab]`` (the sampling rows, then ``prepare``'s prompt indices) or None
        if there are none. Reads only ``inputs``: it may run off
        the scheduler's thread."""
        self.kv_cache.apply_block_ops(inputs.swap_out, inputs.swap_in, inputs.copy_ops)
        if inputs.meta is None:
            return None
        if inputs.every_token_samples and self.graphs is not None:
            size = self.graphs.size_for(inputs.input_ids.shape[0], inputs.meta.block_tables.shape[1])
            if size is not None:
                return self.model.compute_logits(self.graphs.run(size, inputs.input_ids, inputs.positions, inputs.meta))
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache.layers, inputs.meta)
        if inputs.every_token_samples:
            return self.model.compute_logits(hidden)
        if inputs.logits_indices is None:
            return None
        return self.model.compute_logits(hidden.index_select(0, inputs.logits_indices))

    def execute(self, out: SchedulerOutput) -> Tensor | None:
        """``prepare`` then ``forward``, on this thread."""
        return self.forward(self.prepare(out))
