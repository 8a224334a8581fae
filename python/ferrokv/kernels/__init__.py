"""Triton kernels for the paged KV cache (shipped inside the wheel).

Each kernel module has: the ``@triton.jit`` kernel (shape comment on every pointer, int64 offsets),
a Python launcher that validates its arguments (``ValueError`` naming the argument), and a pure-torch
reference (from ``ferrokv.attention.torch_backend``) that the tests compare against.

Importing this package never needs a GPU; launching a kernel needs one, or ``TRITON_INTERPRET=1``
set before import (the test suite does that on CPU machines).
"""
from .copy_blocks import copy_blocks, copy_blocks_reference
from .paged_attention_decode import paged_attention_decode, paged_attention_decode_reference
from .paged_attention_prefill import paged_attention_prefill, paged_attention_prefill_reference
from .reshape_and_cache import reshape_and_cache, reshape_and_cache_reference

__all__ = [
    "copy_blocks",
    "copy_blocks_reference",
    "paged_attention_decode",
    "paged_attention_decode_reference",
    "paged_attention_prefill",
    "paged_attention_prefill_reference",
    "reshape_and_cache",
    "reshape_and_cache_reference",
]
