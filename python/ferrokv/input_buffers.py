"""Step inputs as device tensors from the scheduler's numpy arrays, in buffers reused every step.

On the CPU a step's arrays are wrapped as they are (``torch.from_numpy``: zero-copy views of the
scheduler's buffers, strided ones included). On a GPU they are packed into one pinned host buffer (each array at a
16-byte aligned offset) and moved with one non-blocking copy into one device buffer; the step's
tensors are typed views of it. Both buffers live across steps and only grow.

Invariants: the host buffer is rewritten only after the previous step's copy has completed (a
step waits for its sampled tokens, which the stream orders after the copy; ``stage`` also waits
on the copy's event, which costs nothing then); the device buffer is rewritten by a copy queued
on the same stream after the previous step's kernels, so those never read the next step's data.
The copy's event is recorded on the stream current at each step (the copy's own), so a caller
that steps the engine under another stream now and then stays ordered.
Costs per step: on a GPU, one numpy copy per array into pinned memory, one host-to-device copy,
one event record and one tensor slice per array (typed views of the device buffer are made once
per buffer); on the CPU one ``from_numpy`` per array.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

__all__ = ["InputBuffers"]

# The scheduler's arrays are read-only views, and torch warns (once per process) that its tensors
# cannot be: nothing writes to a step's input tensors. The first wrap runs with that warning muted.
_first_wrap = True


def _wrap(arrays: list[np.ndarray]) -> list[torch.Tensor]:
    global _first_wrap
    if _first_wrap:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            tensors = [torch.from_numpy(a) for a in arrays]
        _first_wrap = False
        return tensors
    return [torch.from_numpy(a) for a in arrays]  # strided views too

_ALIGN = 16
_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
                 np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64,
                 np.dtype(np.bool_): torch.bool}


class InputBuffers:
    """Stages a step's arrays on the device (see the module docs)."""

    __slots__ = ("device", "_host", "_host_np", "_dev", "_dev_typed", "_copied")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._host: torch.Tensor | None = None  # uint8 [size], pinned
        self._host_np: np.ndarray | None = None  # its numpy view
        self._dev: torch.Tensor | None = None  # uint8 [size], on the device
        self._dev_typed: dict[np.dtype, torch.Tensor] = {}  # _dev viewed as each dtype, made once
        # The copy's completion: one event, made once (creating one per step costs host time).
        self._copied: torch.cuda.Event | None = None

    def stage(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """The arrays as tensors on the device, same shapes and dtypes."""
        if self.device.type == "cpu":
            return _wrap(arrays)
        offsets, total = [], 0
        for a in arrays:
            offsets.append(total)
            total += -(-a.nbytes // _ALIGN) * _ALIGN
        self._reserve(total)
        assert self._host is not None and self._host_np is not None and self._dev is not None
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has read the host buffer
        host = self._host_np
        for a, off in zip(arrays, offsets):
            host[off:off + a.nbytes].view(a.dtype).reshape(a.shape)[...] = a  # one (strided) copy
        self._dev[:total].copy_(self._host[:total], non_blocking=True)
        if self._copied is None:
            self._copied = torch.cuda.Event()
        self._copied.record(torch.cuda.current_stream(self.device))
        # One slice of a typed view per array (a reshape only for the 2-D block tables).
        staged = []
        for a, off in zip(arrays, offsets):
            flat = self._typed(a.dtype)[off // a.itemsize:off // a.itemsize + a.size]
            staged.append(flat if a.ndim == 1 else flat.view(a.shape))
        return staged

    def _typed(self, dtype: np.dtype) -> torch.Tensor:
        typed = self._dev_typed.get(dtype)
        if typed is None:
            assert self._dev is not None
            typed = self._dev_typed[dtype] = self._dev.view(_TORCH_DTYPES[dtype])
        return typed

    def _reserve(self, nbytes: int) -> None:
        if self._host is not None and self._host.numel() >= nbytes:
            return
        size = max(nbytes, 2 * (0 if self._host is None else self._host.numel()), 1 << 16)
        size = -(-size // _ALIGN) * _ALIGN  # every typed view of it is whole
        if self._copied is not None:
            self._copied.synchronize()  # the old buffers may still be read by a queued copy
        self._host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        self._host_np = self._host.numpy()
        self._dev = torch.empty(size, dtype=torch.uint8, device=self.device)
        self._dev_typed = {}
