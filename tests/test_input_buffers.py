"""InputBuffers: a step's arrays as tensors on the runner's device (zero-copy on the CPU; one
pinned buffer and one copy on a GPU, whose typed views are made once per buffer)."""

import numpy as np
import pytest
import torch

from ferrokv.input_buffers import InputBuffers

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def step_arrays(n: int, width: int, seed: int) -> list[np.ndarray]:
    """A step's kinds of arrays: int64 and int32 vectors, and a strided [n, m] view of a wider
    block-table matrix (as the scheduler hands its batch matrix)."""
    rng = np.random.default_rng(seed)
    matrix = rng.integers(0, 1 << 30, (n, width), dtype=np.int32)
    return [rng.integers(0, 1 << 40, n, dtype=np.int64), np.arange(n, dtype=np.int64),
            rng.integers(0, 1 << 20, n + 1, dtype=np.int32), rng.integers(0, 100, n, dtype=np.int32),
            matrix[:, : max(1, width // 3)], rng.random(n).astype(np.float32), np.zeros(0, dtype=np.int64)]


def as_host(t: torch.Tensor) -> np.ndarray:
    return t.cpu().numpy()


@pytest.mark.parametrize("device", DEVICES)
def test_staged_tensors_equal_the_arrays_in_shape_dtype_and_values_step_after_step(device):
    buffers = InputBuffers(torch.device(device))
    # Growing steps (the buffers regrow), then a smaller one (they are reused).
    for step, (n, width) in enumerate([(3, 4), (64, 40), (700, 90), (5, 7)]):
        arrays = step_arrays(n, width, step)
        staged = buffers.stage(arrays)
        assert len(staged) == len(arrays)
        for a, t in zip(arrays, staged):
            assert t.device.type == device
            assert tuple(t.shape) == a.shape
            assert t.dtype == torch.from_numpy(np.ascontiguousarray(a)).dtype
            np.testing.assert_array_equal(as_host(t), a)


def test_the_cpu_wraps_the_arrays_without_copying():
    arrays = step_arrays(8, 12, 0)
    staged = InputBuffers(torch.device("cpu")).stage(arrays)
    for a, t in zip(arrays, staged):
        if a.size:
            assert t.data_ptr() == a.ctypes.data  # the scheduler's own memory, strided views included
    assert staged[4].stride() == (12, 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_step_queued_after_the_previous_steps_kernels_does_not_change_what_they_read():
    """The device buffer is rewritten by a copy queued after the previous step's kernels: a kernel
    queued on the first step's tensors reads the first step's values."""
    buffers = InputBuffers(torch.device("cuda"))
    first = step_arrays(256, 30, 1)
    staged = buffers.stage(first)
    torch.cuda._sleep(50_000_000)  # keeps the stream busy, so the next copy waits behind it
    sums = [t.to(torch.float64).sum() for t in staged]
    second = step_arrays(256, 30, 2)
    buffers.stage(second)
    for a, s in zip(first, sums):
        assert float(s) == pytest.approx(float(a.astype(np.float64).sum()))
