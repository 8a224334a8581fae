"""Per-step attention metadata, built once per model step and shared by every layer.

Invariants (S sequences, T tokens in the flattened batch, sequences back to back):
- ``query_start_loc[i]:query_start_loc[i+1]`` are the rows of sequence ``i`` in the batch; rows past
  ``query_start_loc[S]`` are padding (their ``slot_mapping`` is -1, their output is zero).
- The new tokens of sequence ``i`` sit at positions ``seq_lens[i]-query_len_i ... seq_lens[i]-1``;
  positions before that are already in the paged KV cache (chunked prefill / decode).
- ``block_tables[i, j]`` is the physical block holding positions ``j*block_size ... (j+1)*block_size-1``;
  rows are padded with block 0, the null block, which is never read for a valid position.
- Physical slot = ``block_id * block_size + offset``; slot -1 means "do not write".

Costs: ``build`` does O(T + S*max_blocks) host work and one host→device copy per tensor. The host
copies (numpy) let the torch backend plan its loops without a device sync per layer; derived index
tensors are cached in ``plans`` so that they are built once per step, not once per layer.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: Tensor  # int64 [T]; -1 = padding token, not written
    query_start_loc: Tensor  # int32 [S+1]
    seq_lens: Tensor  # int32 [S], context length after this step
    block_tables: Tensor  # int32 [S, max_blocks], padded with block 0
    max_query_len: int
    max_seq_len: int
    # Host (numpy int64) copies, so that planning never syncs with the device; filled lazily from the
    # device tensors when a caller did not provide them.
    query_start_loc_host: np.ndarray | None = None  # int64 [S+1]
    seq_lens_host: np.ndarray | None = None  # int64 [S]
    # Host [S] (any int dtype): the length of each sequence's prompt (dynamic RoPE rescales a prompt
    # token's angles for it, as transformers does when it computes the prompt in one call). None:
    # each sequence's prompt is this step's context (seq_lens), as transformers sees one call.
    prompt_lens_host: np.ndarray | None = None
    # Backend-private caches derived from this metadata (index tensors, masks), keyed by the backend.
    # They live here because the metadata's lifetime is exactly one step.
    plans: dict[Any, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.query_start_loc_host is None:
            self.query_start_loc_host = self.query_start_loc.cpu().numpy().astype(np.int64)
        if self.seq_lens_host is None:
            self.seq_lens_host = self.seq_lens.cpu().numpy().astype(np.int64)
        if self.prompt_lens_host is None:
            self.prompt_lens_host = self.seq_lens_host

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens_host.shape[0])

    @property
    def num_actual_tokens(self) -> int:
        """Rows that belong to a sequence; rows past this are padding."""
        return int(self.query_start_loc_host[-1])

    @property
    def query_lens_host(self) -> np.ndarray:
        return np.diff(self.query_start_loc_host)

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]] | np.ndarray,
        block_size: int,
        device: torch.device | str = "cpu",
        num_tokens: int | None = None,
    ) -> "AttentionMetadata":
        """Build the metadata (slot mapping included) from per-sequence host lists.

        ``num_tokens`` pads the batch to that many rows (padding rows get slot -1).
        """
        q = np.asarray(query_lens, dtype=np.int64)
        s = np.asarray(seq_lens, dtype=np.int64)
        if q.shape != s.shape:
            raise ValueError(f"query_lens and seq_lens differ in length: {q.shape} vs {s.shape}")
        if np.any(q > s):
            raise ValueError("query_lens: a sequence has more new tokens than its seq_len")
        num_seqs = q.shape[0]
        max_blocks = max([len(b) for b in block_tables], default=0)
        max_blocks = max(max_blocks, 1)
        bt = np.zeros((num_seqs, max_blocks), dtype=np.int64)
        for i, row in enumerate(block_tables):
            bt[i, : len(row)] = row
        need = (s + block_size - 1) // block_size
        if num_seqs and np.any(need > max_blocks):
            raise ValueError("block_tables: a sequence has fewer blocks than its seq_len needs")
        qsl = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(q, out=qsl[1:])
        total = int(qsl[-1])
        if num_tokens is None:
            num_tokens = total
        if num_tokens < total:
            raise ValueError(f"num_tokens={num_tokens} is smaller than the {total} query tokens")
        # Positions of the new tokens, vectorised: seq id per token, then offset inside the query.
        seq_of_tok = np.repeat(np.arange(num_seqs), q)
        pos = (s - q)[seq_of_tok] + (np.arange(total) - qsl[:-1][seq_of_tok])
        slots = np.full(num_tokens, -1, dtype=np.int64)
        slots[:total] = bt[seq_of_tok, pos // block_size] * block_size + pos % block_size
        dev = torch.device(device)
        return cls(
            slot_mapping=torch.from_numpy(slots).to(dev),
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(s.astype(np.int32)).to(dev),
            block_tables=torch.from_numpy(bt.astype(np.int32)).to(dev),
            max_query_len=int(q.max()) if num_seqs else 0,
            max_seq_len=int(s.max()) if num_seqs else 0,
            query_start_loc_host=qsl,
            seq_lens_host=s,
        )

    def positions(self) -> Tensor:
        """int64 [T] positions of the new tokens (padding rows get 0); handy for tests and runners."""
        qsl = self.query_start_loc_host
        q = np.diff(qsl)
        seq_of_tok = np.repeat(np.arange(self.num_seqs), q)
        pos = np.zeros(self.slot_mapping.shape[0], dtype=np.int64)
        pos[: qsl[-1]] = (self.seq_lens_host - q)[seq_of_tok] + (np.arange(qsl[-1]) - qsl[:-1][seq_of_tok])
        return torch.from_numpy(pos).to(self.slot_mapping.device)
