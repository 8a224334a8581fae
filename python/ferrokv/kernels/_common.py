"""Launcher helpers shared by the kernels: argument validation and interpreter detection.

All checks are host-side metadata checks (shape/dtype/device), O(1), no device sync.
"""
from __future__ import annotations

import os

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (read at launch; the decorator read it at import)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int | None = None,
    dtypes: tuple[torch.dtype, ...] | None = None,
    device: torch.device | None = None,
    contiguous: bool = False,
) -> Tensor:
    """``contiguous``: the kernel reads ``t`` at ``ptr + i`` (no stride passed), so a strided view
    would be read wrongly (or out of bounds)."""
    if not isinstance(t, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (the kernel reads its elements back to back), "
                         f"got strides {t.stride()}")
    return t


def check_device_ok(name: str, t: Tensor) -> None:
    """Kernels run on CUDA tensors, or on CPU tensors under the interpreter."""
    if t.device.type != "cuda" and not interpreting():
        raise ValueError(f"{name} is on {t.device}; Triton kernels need CUDA tensors (or TRITON_INTERPRET=1)")


def check_cache_pair(k_cache: object, v_cache: object) -> tuple[Tensor, Tensor]:
    check_tensor("k_cache", k_cache, ndim=4, dtypes=FLOAT_DTYPES)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=FLOAT_DTYPES, device=k_cache.device)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} differs from k_cache shape {tuple(k_cache.shape)}")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache dtype {v_cache.dtype} differs from k_cache dtype {k_cache.dtype}")
    check_device_ok("k_cache", k_cache)
    return k_cache, v_cache
