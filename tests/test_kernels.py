"""Triton kernels (interpreter on CPU, native on a GPU) and the torch attention backend against the
pure-torch references (``ferrokv.kernels.reference``).

Shapes are tiny on purpose: the interpreter runs each program in numpy. The int32-overflow case
uses a lazily committed anonymous mapping, so a cache with more than 2**31 elements costs a few
pages of real memory.
"""
from __future__ import annotations

import ast
import mmap
import random
from pathlib import Path

import pytest
import torch

from ferrokv.attention import TorchAttentionBackend
from ferrokv.attention.metadata import AttentionMetadata
from ferrokv.kernels import (
    copy_blocks,
    copy_blocks_reference,
    paged_attention_decode,
    paged_attention_decode_reference,
    paged_attention_prefill,
    paged_attention_prefill_reference,
    reshape_and_cache,
    reshape_and_cache_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _layout(ctx_and_q: list[tuple[int, int]], block_size: int, seed: int, num_tokens_pad: int = 0):
    """Metadata for sequences given as (cached prefix length, new tokens), on shuffled blocks."""
    rng = random.Random(seed)
    seq_lens = [c + q for c, q in ctx_and_q]
    need = sum((s + block_size - 1) // block_size for s in seq_lens)
    free = list(range(1, need + 6))  # a few unused blocks; 0 stays the null block
    rng.shuffle(free)
    tables = []
    for s in seq_lens:
        n = (s + block_size - 1) // block_size
        tables.append([free.pop() for _ in range(n)])
    q_lens = [q for _, q in ctx_and_q]
    meta = AttentionMetadata.build(q_lens, seq_lens, tables, block_size, device=DEVICE,
                                   num_tokens=sum(q_lens) + num_tokens_pad)
    return meta, need + 6


def _caches(num_blocks: int, block_size: int, hkv: int, d: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype).to(DEVICE)
    return k, v


def _close(a, b, dtype):
    torch.testing.assert_close(a.float().cpu(), b.float().cpu(), atol=TOL[dtype], rtol=TOL[dtype])


def test_metadata_build_slots_and_positions():
    """Seq 0: 2 cached + 3 new tokens on blocks [7, 2] (block size 4); seq 1: a fresh 1-token prompt."""
    meta = AttentionMetadata.build([3, 1], [5, 1], [[7, 2], [5]], 4, num_tokens=6)
    assert meta.slot_mapping.tolist() == [7 * 4 + 2, 7 * 4 + 3, 2 * 4 + 0, 5 * 4 + 0, -1, -1]
    assert meta.positions().tolist() == [2, 3, 4, 0, 0, 0]
    assert meta.query_start_loc.tolist() == [0, 3, 4] and meta.query_start_loc.dtype == torch.int32
    assert meta.block_tables.tolist() == [[7, 2], [5, 0]] and meta.block_tables.dtype == torch.int32
    assert (meta.max_query_len, meta.max_seq_len, meta.num_actual_tokens) == (3, 5, 4)
    with pytest.raises(ValueError, match="block_tables"):
        AttentionMetadata.build([3], [9], [[1, 2]], 4)


# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_reshape_and_cache(dtype, block_size):
    hkv, d = 2, 16
    meta, nb = _layout([(0, 5), (3, 1), (block_size, block_size), (7, 2 * block_size + 1)], block_size, seed=block_size,
                       num_tokens_pad=3)
    k_cache, v_cache = _caches(nb, block_size, hkv, d, dtype, seed=1)
    T = meta.slot_mapping.shape[0]
    key = torch.randn(T, hkv, d).to(dtype).to(DEVICE)
    value = torch.randn(T, hkv, d).to(dtype).to(DEVICE)
    ref_k, ref_v = reshape_and_cache_reference(key, value, k_cache, v_cache, meta.slot_mapping)
    before = k_cache.clone()
    reshape_and_cache_reference(key, value, k_cache, v_cache, meta.slot_mapping)
    assert torch.equal(before, k_cache), "the reference must not mutate its inputs"
    reshape_and_cache(key, value, k_cache, v_cache, meta.slot_mapping)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def test_reshape_and_cache_strided_inputs():
    """key/value as views of a fused qkv projection (non-contiguous token stride)."""
    hkv, d, bs = 2, 8, 8
    meta, nb = _layout([(0, 9), (4, 3)], bs, seed=3)
    T = meta.slot_mapping.shape[0]
    qkv = torch.randn(T, 3 * hkv, d, device=DEVICE)
    key, value = qkv[:, hkv : 2 * hkv], qkv[:, 2 * hkv :]
    k_cache, v_cache = _caches(nb, bs, hkv, d, torch.float32, seed=2)
    ref_k, ref_v = reshape_and_cache_reference(key, value, k_cache, v_cache, meta.slot_mapping)
    reshape_and_cache(key, value, k_cache, v_cache, meta.slot_mapping)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


# ------------------------------------------------------------------------------------------------
DECODE_CASES = [
    # (dtype, block_size, num_kv_heads, group, head_dim, window)
    (torch.float32, 8, 2, 1, 16, None),
    (torch.float32, 16, 1, 4, 16, None),
    (torch.float32, 32, 2, 2, 32, 7),
    (torch.float32, 8, 1, 6, 20, None),  # non-pow2 group and head_dim (masked padding)
    (torch.float16, 8, 2, 2, 16, 5),
    (torch.float16, 16, 1, 8, 16, None),
    (torch.float16, 32, 2, 1, 16, None),
    (torch.bfloat16, 8, 1, 4, 16, None),
    (torch.bfloat16, 16, 2, 2, 16, 9),
    (torch.bfloat16, 32, 3, 3, 16, None),
]


@pytest.mark.parametrize("dtype,block_size,hkv,group,d,window", DECODE_CASES)
def test_paged_attention_decode(dtype, block_size, hkv, group, d, window):
    # context lengths: 1, an exact multiple of the block size, one past it, a longer ragged one
    lens = [1, block_size, block_size + 1, 2 * block_size + 5]
    meta, nb = _layout([(n - 1, 1) for n in lens], block_size, seed=block_size + group)
    k_cache, v_cache = _caches(nb, block_size, hkv, d, dtype, seed=5)
    query = torch.randn(len(lens), hkv * group, d).to(dtype).to(DEVICE)
    scale = d**-0.5
    ref = paged_attention_decode_reference(query, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, window)
    out = paged_attention_decode(query, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, window)
    _close(out, ref, dtype)


PREFILL_CASES = [
    (torch.float32, 8, 2, 1, 16, None),
    (torch.float32, 16, 1, 4, 16, 6),
    (torch.float32, 32, 2, 2, 16, None),
    (torch.float16, 8, 1, 2, 16, None),
    (torch.float16, 16, 2, 4, 16, 11),
    (torch.bfloat16, 8, 2, 2, 16, 4),
    (torch.bfloat16, 32, 1, 5, 24, None),
]


@pytest.mark.parametrize("dtype,block_size,hkv,group,d,window", PREFILL_CASES)
def test_paged_attention_prefill_chunked(dtype, block_size, hkv, group, d, window):
    bs = block_size
    # (cached prefix, new tokens): fresh prompts, chunks over a paged prefix, decodes mixed in,
    # lengths of 1 and exact block multiples.
    seqs = [(0, 1), (0, bs), (bs, bs), (5, 3), (2 * bs + 3, 1), (3, 2 * bs + 1), (0, 37)]
    meta, nb = _layout(seqs, bs, seed=bs * 7 + group, num_tokens_pad=2)
    k_cache, v_cache = _caches(nb, bs, hkv, d, dtype, seed=6)
    T = meta.slot_mapping.shape[0]
    query = torch.randn(T, hkv * group, d).to(dtype).to(DEVICE)
    scale = d**-0.5
    ref = paged_attention_prefill_reference(
        query, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale, window
    )
    out = paged_attention_prefill(
        query, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, meta.max_query_len,
        scale, window,
    )
    _close(out, ref, dtype)
    assert torch.count_nonzero(out[-2:]) == 0  # padding rows


def test_prefill_grid_keeps_long_queries_on_the_axis_cuda_lets_past_65535(monkeypatch):
    """CUDA caps grid axes 1 and 2 at 65,535: a prefill budget of 2^18 tokens with 16 query heads
    per kv head (4 tokens per program) needs 65,536 tiles, which must ride on axis 0."""
    import sys

    prefill_module = sys.modules[paged_attention_prefill.__module__]  # the package re-exports its name
    grids = []

    class Recorder:
        def __getitem__(self, grid):
            grids.append(grid)
            return lambda *args, **kwargs: None

    monkeypatch.setattr(prefill_module, "_paged_attention_prefill_kernel", Recorder())
    hkv, group, d, bs = 2, 16, 16, 16
    meta, nb = _layout([(0, 5), (3, 2)], bs, seed=1)
    k_cache, v_cache = _caches(nb, bs, hkv, d, torch.float32, seed=2)
    query = torch.zeros(meta.slot_mapping.shape[0], hkv * group, d, device=DEVICE)
    paged_attention_prefill(query, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                            1 << 18, d**-0.5)
    (grid,) = grids
    assert all(n <= 65535 for n in grid[1:]), grid
    assert grid[0] == (1 << 16) * 2  # every tile of both sequences


@pytest.mark.parametrize("dtype,block_size,hkv,group,d,window", PREFILL_CASES)
def test_torch_backend_matches_reference(dtype, block_size, hkv, group, d, window):
    """The CPU backend (block gathers, batched decode SDPA, fresh-prompt shortcut) against the
    reference: KV write then attention, on a batch of fresh prompts, chunks, decodes and padding."""
    bs = block_size
    seqs = [(0, 1), (0, bs), (bs, bs), (5, 3), (2 * bs + 3, 1), (3, 2 * bs + 1), (0, 37), (bs + 2, 1)]
    meta, nb = _layout(seqs, bs, seed=bs * 5 + group, num_tokens_pad=2)
    k_cache, v_cache = _caches(nb, bs, hkv, d, dtype, seed=7)
    T = meta.slot_mapping.shape[0]
    g = torch.Generator().manual_seed(bs + group)
    query, key, value = (torch.randn(T, n, d, generator=g).to(dtype).to(DEVICE) for n in (hkv * group, hkv, hkv))
    scale = d**-0.5
    ref_k, ref_v = reshape_and_cache_reference(key, value, k_cache, v_cache, meta.slot_mapping)
    ref = paged_attention_prefill_reference(
        query, ref_k, ref_v, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale, window
    )
    out = TorchAttentionBackend().forward(query, key, value, k_cache, v_cache, meta, scale=scale, sliding_window=window)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    _close(out, ref, dtype)
    assert torch.count_nonzero(out[-2:]) == 0  # padding rows


def test_write_then_attend_matches_unpaged_causal_attention():
    """End-to-end sanity of the semantics themselves: paged prefill == dense causal SDPA."""
    bs, hkv, group, d = 8, 2, 2, 16
    meta, nb = _layout([(0, 13), (0, 4)], bs, seed=11)
    T = meta.slot_mapping.shape[0]
    q = torch.randn(T, hkv * group, d, device=DEVICE)
    k = torch.randn(T, hkv, d, device=DEVICE)
    v = torch.randn(T, hkv, d, device=DEVICE)
    k_cache = torch.zeros(nb, bs, hkv, d, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    out = paged_attention_prefill(
        q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, meta.max_query_len, d**-0.5
    )
    for s, e in [(0, 13), (13, 17)]:
        dense = torch.nn.functional.scaled_dot_product_attention(
            q[s:e].transpose(0, 1), k[s:e].repeat_interleave(group, 1).transpose(0, 1),
            v[s:e].repeat_interleave(group, 1).transpose(0, 1), is_causal=True,
        ).transpose(0, 1)
        torch.testing.assert_close(out[s:e], dense, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_copy_blocks(dtype, block_size):
    k0, v0 = _caches(10, block_size, 2, 8, dtype, seed=1)
    k1, v1 = _caches(10, block_size, 2, 8, dtype, seed=2)
    mapping = torch.tensor([[3, 7], [1, 2], [9, 0]], dtype=torch.int64, device=DEVICE)
    ref_k, ref_v = copy_blocks_reference([k0, k1], [v0, v1], mapping)
    copy_blocks([k0, k1], [v0, v1], mapping)
    for got, ref in zip([k0, k1, v0, v1], ref_k + ref_v):
        assert torch.equal(got, ref)


def test_copy_blocks_takes_caches_torch_calls_contiguous_and_refuses_strided_blocks():
    """One KV head (MQA) laid out by a transpose: the size-1 dimension's stride differs from a
    fresh tensor's, yet each block is contiguous, as torch says; a block whose elements are
    strided is refused."""
    base_k = torch.randn(10, 4, 8, 1, device=DEVICE)
    k = base_k.transpose(2, 3)  # [10, 4, 1, 8], strides (32, 8, 1, 1)
    v = torch.randn(10, 4, 8, 1, device=DEVICE).transpose(2, 3)
    assert k.is_contiguous() and k.stride() != torch.empty(10, 4, 1, 8).stride()
    mapping = torch.tensor([[3, 7], [1, 2]], dtype=torch.int64, device=DEVICE)
    ref_k, ref_v = copy_blocks_reference([k.clone()], [v.clone()], mapping)
    copy_blocks([k], [v], mapping)
    assert torch.equal(k, ref_k[0]) and torch.equal(v, ref_v[0])
    strided = torch.randn(10, 4, 2, 16, device=DEVICE)[..., ::2]  # [10, 4, 2, 8], every other element
    with pytest.raises(ValueError, match="each block must be contiguous"):
        copy_blocks([strided], [strided.clone()], mapping)


# ------------------------------------------------------------------------------------------------
def _huge_cache(num_blocks: int, block_size: int, hkv: int, d: int, dtype=torch.float16) -> torch.Tensor:
    """A [num_blocks, block_size, hkv, d] CPU tensor over lazily committed anonymous memory."""
    numel = num_blocks * block_size * hkv * d
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0x4000)
    mm = mmap.mmap(-1, nbytes, flags=flags)
    t = torch.frombuffer(mm, dtype=dtype, count=numel).view(num_blocks, block_size, hkv, d)
    t._ferrokv_mmap = mm  # keep the mapping alive as long as the tensor
    return t


@pytest.mark.skipif(DEVICE != "cpu", reason="interpreter-only: on a GPU this needs > 4 GiB of device memory")
def test_int64_offsets_beyond_int32():
    """Block ids whose element offsets (block_id * block_stride) exceed 2**31."""
    bs, hkv, d = 16, 1, 16
    per_block = bs * hkv * d
    nb = (1 << 31) // per_block + 16  # ~4.3 GB of fp16 address space, a few pages touched
    k_big, v_big = _huge_cache(nb, bs, hkv, d), _huge_cache(nb, bs, hkv, d)
    assert (nb - 1) * k_big.stride(0) > 2**31
    hi = [nb - 1, nb - 3, nb - 2]  # the blocks used, all beyond the int32 range
    meta = AttentionMetadata.build([3, 20], [3, 20], [[hi[0]], [hi[1], hi[2]]], bs)
    T = 23
    key = torch.randn(T, hkv, d, dtype=torch.float16)
    value = torch.randn(T, hkv, d, dtype=torch.float16)
    reshape_and_cache(key, value, k_big, v_big, meta.slot_mapping)
    assert torch.equal(k_big[hi[0], :3], key[:3]) and torch.equal(v_big[hi[2], :4], value[19:])
    # Reference on a compact copy holding the same blocks.
    small_tables = [[1], [2, 3]]
    k_small = torch.zeros(4, bs, hkv, d, dtype=torch.float16)
    v_small = torch.zeros_like(k_small)
    for small, big in zip([1, 2, 3], hi):
        k_small[small], v_small[small] = k_big[big], v_big[big]
    small_meta = AttentionMetadata.build([3, 20], [3, 20], small_tables, bs)
    query = torch.randn(T, 2 * hkv, d, dtype=torch.float16)
    ref = paged_attention_prefill_reference(query, k_small, v_small, small_meta.block_tables,
                                            small_meta.query_start_loc, small_meta.seq_lens, d**-0.5)
    out = paged_attention_prefill(query, k_big, v_big, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                                  meta.max_query_len, d**-0.5)
    _close(out, ref, torch.float16)
    dq = query[[2, 22]]
    ref = paged_attention_decode_reference(dq, k_small, v_small, small_meta.block_tables, small_meta.seq_lens, d**-0.5)
    out = paged_attention_decode(dq, k_big, v_big, meta.block_tables, meta.seq_lens, d**-0.5)
    _close(out, ref, torch.float16)
    copy_blocks([k_big], [v_big], torch.tensor([[hi[1], nb - 5]]))
    assert torch.equal(k_big[nb - 5], k_big[hi[1]]) and torch.equal(v_big[nb - 5], v_big[hi[1]])


# ------------------------------------------------------------------------------------------------
def test_launchers_validate_arguments():
    bs, hkv, d = 8, 2, 16
    meta, nb = _layout([(0, 3)], bs, seed=0)
    k_cache, v_cache = _caches(nb, bs, hkv, d, torch.float32, seed=0)
    key = torch.randn(3, hkv, d, device=DEVICE)
    with pytest.raises(ValueError, match="key"):
        reshape_and_cache(key[:, :1], key, k_cache, v_cache, meta.slot_mapping)
    with pytest.raises(ValueError, match="slot_mapping"):
        reshape_and_cache(key, key, k_cache, v_cache, meta.slot_mapping[:2])
    with pytest.raises(ValueError, match="v_cache"):
        reshape_and_cache(key, key, k_cache, v_cache.half(), meta.slot_mapping)
    q = torch.randn(1, 3, d, device=DEVICE)
    with pytest.raises(ValueError, match="heads"):
        paged_attention_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, 1.0)
    q = torch.randn(1, 4, d, device=DEVICE)
    with pytest.raises(ValueError, match="block_tables"):
        paged_attention_decode(q, k_cache, v_cache, meta.block_tables.long(), meta.seq_lens, 1.0)
    with pytest.raises(ValueError, match="query"):
        paged_attention_decode(q.half(), k_cache, v_cache, meta.block_tables, meta.seq_lens, 1.0)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_attention_prefill(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc[:1], meta.seq_lens, 1, 1.0)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, 1.0, sliding_window=0)
    with pytest.raises(ValueError, match="sliding_window must be None or an int, got 4.5"):
        paged_attention_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, 1.0, sliding_window=4.5)
    for scale in (torch.tensor(1.0), 0.0, float("nan"), True):
        with pytest.raises(ValueError, match="scale must be a finite number > 0"):
            paged_attention_prefill(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, 3, scale)
    with pytest.raises(ValueError, match="block_mapping"):
        copy_blocks([k_cache], [v_cache], torch.tensor([[1, 2]], dtype=torch.int32, device=DEVICE))


def test_launchers_refuse_strided_index_tensors_the_kernels_read_back_to_back():
    """slot_mapping, seq_lens and query_start_loc are read at ptr + i: a strided view with the
    same values was read wrongly (writes into the null block, wrong outputs, a segfault)."""
    bs, hkv, d = 4, 2, 16
    meta, nb = _layout([(0, 3), (5, 1)], bs, seed=0)  # two sequences: a strided [S] view is not contiguous
    k_cache, v_cache = _caches(nb, bs, hkv, d, torch.float32, seed=0)
    key = torch.randn(4, hkv, d, device=DEVICE)
    q = torch.randn(2, 4, d, device=DEVICE)

    def strided(t):  # same values, every other element of a wider tensor
        return torch.stack([t, torch.full_like(t, 999)], 1)[:, 0]

    assert torch.equal(strided(meta.slot_mapping), meta.slot_mapping) and not strided(meta.seq_lens).is_contiguous()
    with pytest.raises(ValueError, match="slot_mapping must be contiguous"):
        reshape_and_cache(key, key, k_cache, v_cache, strided(meta.slot_mapping))
    with pytest.raises(ValueError, match="seq_lens must be contiguous"):
        paged_attention_decode(q, k_cache, v_cache, meta.block_tables, strided(meta.seq_lens), 1.0)
    with pytest.raises(ValueError, match="query_start_loc must be contiguous"):
        paged_attention_prefill(q, k_cache, v_cache, meta.block_tables, strided(meta.query_start_loc), meta.seq_lens,
                                1, 1.0)
    with pytest.raises(ValueError, match="max_query_len must be an int >= 0"):
        paged_attention_prefill(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, 1.0, 1.0)


def test_kernels_compile_for_gpu_target():
    """GPU-only compile rules (tl.dot dims >= 16, lowering) checked on CPU: build sm_90 cubins."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "helpers" / "compile_kernels_sm90.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr


def _imported_modules(tree: ast.AST, package: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in a module of ``package``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            out.append((node.lineno, module))
    return out


def test_kernels_import_nothing_from_the_rest_of_ferrokv():
    """kernels/ is a leaf: the attention backends import the kernels, never the reverse (no folder cycle)."""
    kernels = Path(__file__).parent.parent / "python" / "ferrokv" / "kernels"
    files = sorted(kernels.glob("*.py"))
    assert len(files) >= 5, kernels
    bad = [
        f"{f.name}:{line} imports {module}"
        for f in files
        for line, module in _imported_modules(ast.parse(f.read_text(), str(f)), "ferrokv.kernels")
        if module.split(".")[0] == "ferrokv" and not module.startswith("ferrokv.kernels")
    ]
    assert not bad, bad


# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("writer_first", [True, False])
@pytest.mark.parametrize("block_size", [4, 16])
def test_backends_write_every_kv_of_the_step_before_any_attention_reads_it(backend, writer_first, block_size):
    """The scheduler registers a block in the prefix cache when the step that computes it is
    planned, so a sequence admitted in the same step (B) may read blocks another (A) writes in
    that step. Every backend must write all of the step's K/V before attending: B's output
    equals the reference computed with A's K/V already in place, whichever row comes first."""
    from ferrokv.attention import get_attention_backend
    from ferrokv.kernels.reference import paged_attention_prefill_reference, reshape_and_cache_reference

    bs, hkv, group, d = block_size, 2, 2, 16
    a_table, b_tail, c_tail = [3, 1, 5], 2, 4
    # A: a fresh prompt of 2 blocks + 3 tokens. B: took A's 2 full blocks as cache hits, computes
    # 3 tokens. C: a decode whose context is A's first block (a hit) and one of its own.
    rows = [("A", 0, 2 * bs + 3, a_table), ("B", 2 * bs, 3, a_table[:2] + [b_tail]), ("C", bs + 1, 1, a_table[:1] + [c_tail])]
    if not writer_first:
        rows = rows[1:] + rows[:1]
    meta = AttentionMetadata.build([q for _, _, q, _ in rows], [c + q for _, c, q, _ in rows], [t for *_, t in rows],
                                   bs, device=DEVICE)
    # C's own block holds its first position, computed in an earlier step.
    k_cache, v_cache = _caches(6, bs, hkv, d, torch.float32, seed=bs)
    T = meta.slot_mapping.shape[0]
    g = torch.Generator().manual_seed(3)
    query, key, value = (torch.randn(T, n, d, generator=g).to(DEVICE) for n in (hkv * group, hkv, hkv))
    scale = d**-0.5
    ref_k, ref_v = reshape_and_cache_reference(key, value, k_cache, v_cache, meta.slot_mapping)
    ref = paged_attention_prefill_reference(query, ref_k, ref_v, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale, None)
    out = get_attention_backend(backend).forward(query, key, value, k_cache, v_cache, meta, scale=scale)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    _close(out, ref, torch.float32)
