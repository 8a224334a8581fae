"""Triton kernels for the paged KV cache (shipped inside the wheel).

Each kernel module has the ``@triton.jit`` kernel (shape comment on every pointer, int64 offsets)
and a Python launcher that validates its arguments (``ValueError`` naming the argument); the
pure-torch references the tests compare against live in ``reference.py``. The kernels import
nothing from the rest of ferrokv (tests/test_kernels.py checks it), so the attention backends can
depend on them without a cycle.

Importing this package never needs a GPU; launching a kernel needs one, or ``TRITON_INTERPRET=1``
set before import (the test suite does that on CPU machines).
"""
from .copy_blocks import copy_blocks
from .paged_attention_decode import paged_attention_decode
from .paged_attention_prefill import paged_attention_prefill
from .reference import (
    copy_blocks_reference,
    paged_attention_decode_reference,
    paged_attention_prefill_reference,
    reshape_and_cache_reference,
)
from .reshape_and_cache import reshape_and_cache

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
