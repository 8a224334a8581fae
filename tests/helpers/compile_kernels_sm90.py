"""Compile every ferrokv Triton kernel for an sm_90 GPU target, without a GPU (run as a script).

Why: the interpreter accepts code a real GPU compile rejects (e.g. ``tl.dot`` with a dimension
< 16, or constructs the NVIDIA lowering does not support). Compiling to a cubin with the ptxas
bundled in the triton wheel catches those on CPU-only CI. It must run in a process where
TRITON_INTERPRET is unset at import time, hence a script. Cost: ~10-20 s cold, less when cached.
"""
from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from ferrokv.kernels.copy_blocks import _copy_blocks_kernel  # noqa: E402
from ferrokv.kernels.paged_attention_decode import _paged_attention_decode_kernel  # noqa: E402
from ferrokv.kernels.paged_attention_prefill import _paged_attention_prefill_kernel  # noqa: E402
from ferrokv.kernels.reshape_and_cache import _reshape_and_cache_kernel  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def _compile(kernel, ptr_types: dict[str, str], constexprs: dict[str, object]) -> None:
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in ptr_types:
            sig[name] = ptr_types[name]
        elif name.startswith("scale"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    triton.compile(ASTSource(kernel, sig, constexprs), target=TARGET)


def main() -> int:
    for dt in ("fp32", "bf16"):
        p = f"*{dt}"
        _compile(_reshape_and_cache_kernel,
                 {"key_ptr": p, "value_ptr": p, "k_cache_ptr": p, "v_cache_ptr": p, "slot_mapping_ptr": "*i64"},
                 dict(NUM_KV_HEADS=3, HEAD_DIM=64, BLOCK_H=4, BLOCK_D=64, BLOCK_SIZE=16))
        ptrs = {"out_ptr": p, "q_ptr": p, "k_cache_ptr": p, "v_cache_ptr": p, "block_tables_ptr": "*i32",
                "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32"}
        common = dict(BLOCK_N=32, BLOCK_SIZE=16, DOT_FP32=False, IEEE=dt == "fp32")
        # SmolLM2 shape (G=3, D=64) without window; MHA with a window and a non-pow2 head_dim.
        for group, d, window in ((3, 64, 0), (1, 80, 4096)):
            bd = max(16, triton.next_power_of_2(d))
            _compile(_paged_attention_decode_kernel, ptrs,
                     dict(GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=d, BLOCK_D=bd,
                          SLIDING_WINDOW=window, **common))
            gp = triton.next_power_of_2(group)
            _compile(_paged_attention_prefill_kernel, ptrs,
                     dict(GROUP=group, GROUP_PAD=gp, BLOCK_Q=max(1, 64 // gp), HEAD_DIM=d, BLOCK_D=bd,
                          SLIDING_WINDOW=window, **common))
        _compile(_copy_blocks_kernel, {"k_cache_ptr": p, "v_cache_ptr": p, "block_mapping_ptr": "*i64"},
                 dict(BLOCK_NUMEL=3072, BLOCK=1024))
    print("compiled all kernels for sm_90")
    return 0


if __name__ == "__main__":
    sys.exit(main())
