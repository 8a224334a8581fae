"""CUDA graphs for decode steps: the model's forward pass over B single-token sequences,
captured once per batch size at startup and replayed, so that a decode step costs the host a few
launches instead of every layer's (vLLM's default; ``enforce_eager`` turns it off).

A step is replayed when every sequence decodes one token (``StepInputs.every_token_samples``) and
there are at most ``max_batch`` of them; it runs in the smallest captured size ``B >= T``, whose
rows past ``T`` are padding: slot -1 (the KV write skips it) and sequence length 0 (the decode
kernel writes zeros), so they touch no cache block. Prefill and mixed steps run eagerly.

Invariants: the graphs read only the static buffers here (inputs and block tables, the KV cache's
tensors, the weights), whose addresses never change; ``run`` copies the step's inputs into them
on the stream the graphs replay on, after the previous step's kernels; the logits are computed
eagerly from the graph's hidden states (one ``[B, V]`` buffer per size would cost gigabytes).
Capture runs the forward pass with every row padding, so it writes no KV.
Costs: at startup, two forward passes per size (warm-up and capture); per replayed step, six
copies and two fills into the static buffers, one replay and the logits' matmul.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch
from torch import Tensor

from ferrokv.attention.metadata import AttentionMetadata

logger = logging.getLogger("ferrokv")

__all__ = ["DecodeGraphs", "capture_sizes"]

# vLLM's default capture sizes: 1, 2, 4, then every multiple of 8 up to 512.
MAX_CAPTURE_BATCH = 512


_VLLM_SIZES = (1, 2, 4, *range(8, MAX_CAPTURE_BATCH + 1, 8))


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes captured for an engine of ``max_num_seqs`` sequences: vLLM's, up to the
    first that holds them all (at most ``MAX_CAPTURE_BATCH``)."""
    cap = min(max(int(max_num_seqs), 1), MAX_CAPTURE_BATCH)
    return [s for s in _VLLM_SIZES if s < cap] + [next(s for s in _VLLM_SIZES if s >= cap)]


class DecodeGraphs:
    """The captured decode graphs of one model and KV cache (module docs)."""

    def __init__(self, model: torch.nn.Module, kv_layers: list[tuple[Tensor, Tensor]], device: torch.device,
                 max_num_seqs: int, max_blocks_per_seq: int) -> None:
        self.model = model
        self.kv_layers = kv_layers
        self.device = device
        self.sizes = capture_sizes(max_num_seqs)
        self.max_batch = self.sizes[-1]
        b, dev = self.max_batch, device
        self.input_ids = torch.zeros(b, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(b, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((b,), -1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.zeros(b, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(b, max(int(max_blocks_per_seq), 1), dtype=torch.int32, device=dev)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self._pool = None
        self.replays = 0  # decode steps served by a graph

    def capture(self) -> float:
        """Captures every size, largest first (the smaller ones reuse its memory pool); returns
        the seconds it took."""
        t0 = time.perf_counter()
        with torch.cuda.device(self.device):
            self._capture_all()
        return time.perf_counter() - t0

    def _capture_all(self) -> None:
        torch.cuda.synchronize(self.device)
        for size in reversed(self.sizes):
            meta = self._meta(size)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm-up: Triton compiles and cuBLAS picks its kernels outside the capture
                self._forward(size, meta)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                hidden = self._forward(size, meta)
            if self._pool is None:
                self._pool = graph.pool()
            self._graphs[size] = (graph, hidden)
        torch.cuda.synchronize(self.device)

    def _meta(self, size: int) -> AttentionMetadata:
        """The decode metadata of a ``size``-row batch over the static buffers (its host fields
        describe the shape only: the decode path reads lengths from the device)."""
        ones = np.ones(size, dtype=np.int64)
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], query_start_loc=self.query_start_loc[:size + 1],
            seq_lens=self.seq_lens[:size], block_tables=self.block_tables[:size], max_query_len=1, max_seq_len=1,
            query_start_loc_host=np.arange(size + 1, dtype=np.int64), seq_lens_host=ones, prompt_lens_host=ones)

    def _forward(self, size: int, meta: AttentionMetadata) -> Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_layers, meta)

    def size_for(self, num_tokens: int) -> int | None:
        """The captured size a decode step of ``num_tokens`` sequences runs in, if any."""
        if num_tokens > self.max_batch or num_tokens < 1:
            return None
        for s in self.sizes:
            if s >= num_tokens:
                return s
        return None

    def run(self, size: int, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata) -> Tensor:
        """Replays the graph of ``size`` rows on this step's ``T`` decode tokens; returns their
        hidden states ``[T, hidden]`` (a view of the graph's output, valid until the next replay)."""
        t = input_ids.shape[0]
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        self.slot_mapping[:t].copy_(meta.slot_mapping)
        self.seq_lens[:t].copy_(meta.seq_lens)
        width = meta.block_tables.shape[1]
        if width > self.block_tables.shape[1]:
            raise ValueError(f"block_tables has {width} columns, more than the captured {self.block_tables.shape[1]}")
        self.block_tables[:t, :width].copy_(meta.block_tables)
        if size > t:  # padding rows: no KV write, no attention
            self.slot_mapping[t:size].fill_(-1)
            self.seq_lens[t:size].zero_()
        graph, hidden = self._graphs[size]
        graph.replay()
        self.replays += 1
        return hidden[:t]
