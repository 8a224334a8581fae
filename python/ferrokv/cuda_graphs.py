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
Capture runs on one stream of the engine's device, in thread-local mode (another engine's thread
may work meanwhile); a capture that fails leaves the thread's device and stream as they were, and
the engine runs eagerly.
Costs: at startup, two forward passes per size (warm-up and capture); per replayed step, a list
lookup, five copies and two fills into the static buffers, one replay and the logits' matmul.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from torch import Tensor

from ferrokv.attention.metadata import AttentionMetadata

__all__ = ["DecodeGraphs", "capture_sizes"]

MAX_CAPTURE_BATCH = 512
# vLLM's default capture sizes: 1, 2, 4, then every multiple of 8 up to 512.
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
        # The smallest captured size >= T, for each T (0: none), looked up once per step.
        self._size_of = [0] * (self.max_batch + 1)
        for t in range(1, self.max_batch + 1):
            self._size_of[t] = next(s for s in self.sizes if s >= t)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self._pool = None
        self.replays = 0  # decode steps served by a graph

    def capture(self) -> float:
        """Captures every size, largest first (the smaller ones reuse its memory pool); returns
        the seconds it took. The thread's current device and stream are as before, whatever
        happens."""
        t0 = time.perf_counter()
        with torch.cuda.device(self.device):
            before = torch.cuda.current_stream(self.device)
            try:
                self._capture_all()
            finally:  # a capture that fails in its end leaves the thread on the capture stream
                torch.cuda.set_stream(before)
        return time.perf_counter() - t0

    def _capture_all(self) -> None:
        # One stream of this device for every warm-up and capture: torch's own capture stream is
        # made once per process on whichever device was current then (another engine's), and
        # each new stream would keep a cuBLAS workspace of its own.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        for size in reversed(self.sizes):
            meta = self._meta(size)
            with torch.cuda.stream(stream):  # warm-up: Triton compiles, cuBLAS picks kernels, outside capture
                self._forward(size, meta)
            graph = torch.cuda.CUDAGraph()
            # thread_local: another engine's thread in this process may sync or pin memory meanwhile.
            with torch.cuda.graph(graph, pool=self._pool, stream=stream, capture_error_mode="thread_local"):
                hidden = self._forward(size, meta)
            if self._pool is None:
                self._pool = graph.pool()
            self._graphs[size] = (graph, hidden)
        torch.cuda.current_stream(self.device).wait_stream(stream)
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

    def size_for(self, num_tokens: int, width: int) -> int | None:
        """The captured size a decode step of ``num_tokens`` sequences whose block tables are
        ``width`` wide runs in, if any (a wider table than captured runs eagerly)."""
        if num_tokens >= len(self._size_of) or width > self.block_tables.shape[1]:
            return None
        size = self._size_of[num_tokens]
        return size or None

    def run(self, size: int, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata) -> Tensor:
        """Replays the graph of ``size`` rows on this step's ``T`` decode tokens; returns their
        hidden states ``[T, hidden]`` (a view of the graph's output, valid until the next replay)."""
        t = input_ids.shape[0]
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        self.slot_mapping[:t].copy_(meta.slot_mapping)
        self.seq_lens[:t].copy_(meta.seq_lens)
        self.block_tables[:t, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        if size > t:  # padding rows: no KV write, no attention
            self.slot_mapping[t:size].fill_(-1)
            self.seq_lens[t:size].zero_()
        graph, hidden = self._graphs[size]
        graph.replay()
        self.replays += 1
        return hidden[:t]
