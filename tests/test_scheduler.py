"""Tests of the ``ferrokv._core`` bindings: the arrays of a step (dtypes, shapes, zero-copy
views, lifetimes, the read-only block-table view), argument conversion at the Python boundary,
keywords and methods reaching the core, stats and properties, the exception classes, GIL
release, and one end-to-end prefill/decode/finish smoke test.

Scheduling semantics are tested in Rust: unit tests beside each module of
``rust/ferrokv-core/src/scheduler/`` and the property test of the invariants in
``rust/ferrokv-core/tests/properties.rs``. Exact block ids expected here follow from fresh
pools handing out blocks 1, 2, 3, ... in order.
"""

from __future__ import annotations

import gc
import re
import sys
import threading
import time

import numpy as np
import pytest

import ferrokv
from ferrokv import (
    CacheCapacityError,
    DuplicateRequestError,
    FerrokvError,
    FinishedSequence,
    InvalidArgumentError,
    PromptTooLongError,
    Scheduler,
    SchedulerOutput,
    SchedulerStateError,
    UnknownRequestError,
    UnknownSequenceError,
)
from ferrokv._core import validate_scheduler_config

# name -> (dtype, shape in terms of S seqs, T tokens, R rows, M max blocks, K pairs, F/P ids,
# B min_tokens bans)
ARRAYS = {
    "req_ids": (np.int64, "S"),
    "seq_ids": (np.int64, "S"),
    "query_start_loc": (np.int32, "S+1"),
    "seq_lens": (np.int32, "S"),
    "block_tables": (np.int32, "S,M"),
    "input_ids": (np.int64, "T"),
    "positions": (np.int64, "T"),
    "slot_mapping": (np.int64, "T"),
    "logits_indices": (np.int64, "R"),
    "row_req_ids": (np.int64, "R"),
    "row_seq_ids": (np.int64, "R"),
    "row_sample_index": (np.int32, "R"),
    "row_temperature": (np.float32, "R"),
    "row_top_k": (np.int32, "R"),
    "row_top_p": (np.float32, "R"),
    "row_min_p": (np.float32, "R"),
    "row_presence": (np.float32, "R"),
    "row_frequency": (np.float32, "R"),
    "row_repetition": (np.float32, "R"),
    "row_num_logprobs": (np.int32, "R"),
    "row_uniform": (np.float64, "R"),
    "row_batch_rows": (np.int32, "R"),
    "row_num_output": (np.int32, "R"),
    "banned_rows": (np.int64, "B"),
    "banned_tokens": (np.int64, "B"),
    "copy_ops": (np.int32, "K,2"),
    "swap_out": (np.int32, "K,2"),
    "swap_in": (np.int32, "K,2"),
    "finished_req_ids": (np.int64, "F"),
    "preempted_req_ids": (np.int64, "P"),
}

STATS_KEYS = {
    "steps", "requests_added", "requests_finished", "requests_aborted", "capacity_aborts",
    "preemptions", "swap_preemptions", "recompute_preemptions", "prompt_tokens",
    "prompt_tokens_computed", "output_tokens_recomputed", "cached_prompt_tokens",
    "first_admission_cached_tokens", "prefix_cache_queried_tokens", "decode_tokens", "generated_tokens",
    "max_running_seqs",
    "max_step_tokens", "cancelled_steps", "cow_copies", "blocks_swapped_out", "blocks_swapped_in", "prefix_evictions",
    "num_blocks", "num_free_blocks", "num_used_blocks", "num_cached_blocks", "num_shared_blocks",
    "num_block_refs", "num_used_token_slots", "block_size", "num_waiting", "num_running",
    "num_running_seqs", "num_waiting_seqs", "step_tokens_sum",
    # Steps by the tokens they scheduled, one key per bucket of vLLM's iteration_tokens_total.
    *(f"step_tokens_le_{b}" for b in (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, "inf")),
}  # fmt: skip


def make(num_blocks=16, block_size=4, budget=16, **kw) -> Scheduler:
    """Small scheduler like the Rust unit tests' ``cfg(num_blocks, block_size, budget)``."""
    kw.setdefault("max_num_seqs", min(budget, 8))
    kw.setdefault("max_model_len", 1024)
    kw.setdefault("watermark", 0.0)
    return Scheduler(num_blocks, block_size=block_size, max_num_batched_tokens=budget, **kw)


def toks(rid: int, n: int) -> list[int]:
    """The Rust tests' prompt for request ``rid``: distinct per request."""
    return [100 + t + rid * 1000 for t in range(n)]


def check_output(out: SchedulerOutput, s: Scheduler | None = None) -> dict[str, np.ndarray]:
    """Dtypes, shapes and the exact relations between the arrays of one step.

    With ``s`` (called right after ``schedule()``), input_ids are also checked against each
    sequence's tokens.
    """
    assert isinstance(out, SchedulerOutput)
    a = {name: getattr(out, name) for name in ARRAYS}
    S, T, R, bs = out.num_seqs, out.num_tokens, out.num_rows, out.block_size
    M = a["block_tables"].shape[1]
    dims = {"S": (S,), "S+1": (S + 1,), "T": (T,), "R": (R,), "S,M": (S, M)}
    for name, (dtype, shape) in ARRAYS.items():
        arr = a[name]
        assert arr.dtype == dtype, (name, arr.dtype)
        if name == "block_tables":
            # Rows are contiguous; a view of the batch matrix has a row stride >= M.
            assert arr.ndim == 2 and arr.strides[1] == arr.itemsize, arr.strides
            assert arr.strides[0] >= arr.shape[1] * arr.itemsize, arr.strides
        else:
            assert arr.flags.c_contiguous, name
        if shape in dims:
            assert arr.shape == dims[shape], (name, arr.shape, shape)
        elif shape == "K,2":
            assert arr.ndim == 2 and arr.shape[1] == 2, (name, arr.shape)
        else:
            assert arr.ndim == 1, (name, arr.shape)
    assert out.num_prefill_tokens + out.num_decode_tokens == T
    assert 0 <= out.num_decode_tokens <= S

    qsl, lens, bt = a["query_start_loc"], a["seq_lens"], a["block_tables"]
    pos, slots = a["positions"], a["slot_mapping"]
    assert qsl[0] == 0 and qsl[-1] == T
    assert np.all(np.diff(qsl) >= 1), "every scheduled sequence gets at least one token"
    expect_m = int(max((-(-int(n) // bs) for n in lens), default=0))
    assert M == expect_m, (M, expect_m)
    assert len(set(a["seq_ids"].tolist())) == S
    for i in range(S):
        lo, hi = int(qsl[i]), int(qsl[i + 1])
        n = int(lens[i])
        # Positions: contiguous, ending at seq_lens - 1.
        assert pos[lo:hi].tolist() == list(range(n - (hi - lo), n)), (i, pos[lo:hi], n)
        nb = -(-n // bs)
        assert np.all(bt[i, :nb] > 0), ("block 0 is never allocated", bt[i])
        assert np.all(bt[i, nb:] == 0), ("padded with the null block", bt[i])
        assert len(set(bt[i, :nb].tolist())) == nb
        p = pos[lo:hi]
        np.testing.assert_array_equal(slots[lo:hi], bt[i, p // bs].astype(np.int64) * bs + p % bs)
        if s is not None:
            seq_tokens = s.seq_tokens(int(a["seq_ids"][i]))
            assert a["input_ids"][lo:hi].tolist() == [seq_tokens[int(q)] for q in p]
            assert s.seq_block_table(int(a["seq_ids"][i])) == bt[i, :nb].tolist()
    # Every token writes its own slot.
    assert len(set(slots.tolist())) == T
    # Rows: each samples the last token of a sequence that completes its tokens this step.
    last_token = {int(qsl[i + 1]) - 1: i for i in range(S)}
    for r in range(R):
        li = int(a["logits_indices"][r])
        assert li in last_token, (r, li)
        i = last_token[li]
        assert a["row_req_ids"][r] == a["req_ids"][i]
        if a["row_seq_ids"][r] != a["seq_ids"][i]:
            # A sample of an n > 1 request forked off this prompt row by update().
            assert a["row_sample_index"][r] > 0
    assert len(set(a["row_seq_ids"].tolist())) == R
    for name in ("copy_ops", "swap_out", "swap_in"):
        assert np.all(a[name] >= 0)
    check_sampling_columns(out, a)
    if len(a["copy_ops"]):
        assert np.all(a["copy_ops"] > 0) and len(set(a["copy_ops"][:, 1].tolist())) == len(a["copy_ops"])
    return a


def check_sampling_columns(out: SchedulerOutput, a: dict[str, np.ndarray]) -> None:
    """The sampling columns of one step: bans name its rows, draws are in [0, 1) (0 for greedy
    rows), only samples forked at update have no batch row, and the flags match the columns."""
    R = out.num_rows
    rows, banned = a["banned_rows"], a["banned_tokens"]
    assert rows.shape == banned.shape
    assert np.all((rows >= 0) & (rows < R)) and np.all(banned >= 0)
    temp, u, br = a["row_temperature"], a["row_uniform"], a["row_batch_rows"]
    assert np.all(temp >= 0) and np.all((u >= 0) & (u < 1)) and np.all(u[temp == 0] == 0)
    assert np.all(br >= -1) and np.all(a["row_sample_index"][br < 0] > 0)
    assert len(set(br[br >= 0].tolist())) == int((br >= 0).sum()), "one logits row per batch row"
    assert np.all(a["row_num_output"] >= 0) and np.all(a["row_num_logprobs"] >= -1)
    flags = (out.num_greedy_rows, out.max_top_k, out.any_top_p, out.any_min_p, out.any_penalties, out.any_logprobs)
    assert [type(f) for f in flags] == [int, int, bool, bool, bool, bool]
    penalties = (a["row_presence"] != 0) | (a["row_frequency"] != 0) | (a["row_repetition"] != 1)
    assert flags == (
        int((temp == 0).sum()),
        max(int(a["row_top_k"].max(initial=0)), 0),
        bool((a["row_top_p"] < 1).any()),
        bool((a["row_min_p"] > 0).any()),
        bool(penalties.any()),
        bool((a["row_num_logprobs"] >= 0).any()),
    )


def step(s: Scheduler, tok: int = 7, check: bool = True):
    """One schedule/update with every row sampling ``tok``; returns (output, finished)."""
    out = s.schedule()
    if check:
        check_output(out, s)
        s.check_invariants()
    done = s.update(out, np.full(out.num_rows, tok, np.int64))
    if check:
        s.check_invariants()
    return out, done


def drain(s: Scheduler, tok: int = 7, max_steps: int = 10_000) -> list[FinishedSequence]:
    done: list[FinishedSequence] = []
    for _ in range(max_steps):
        if not s.has_unfinished():
            return done
        done += step(s, tok)[1]
    raise AssertionError("scheduler did not drain")


def assert_all_free(s: Scheduler) -> None:
    s.check_invariants()
    assert not s.has_unfinished()
    assert s.num_free_blocks == s.num_blocks - 1
    st = s.stats()
    assert st["num_used_blocks"] == 0 and st["num_free_blocks"] == s.num_blocks - 1



# ---------------------------------------------------------------------------------------------
# The arrays of a step


def test_a_request_prefills_in_chunks_decodes_and_finishes_through_python():
    s = make(16, 4, 8)
    s.add_request(1, toks(1, 10), 3)
    out = s.schedule()
    a = check_output(out, s)
    assert (out.num_tokens, out.num_rows, out.num_prefill_tokens) == (8, 0, 8)
    assert "num_seqs=1" in repr(out)
    assert a["logits_indices"].shape == (0,) and a["row_seq_ids"].shape == (0,)
    assert a["block_tables"].tolist() == [[1, 2]]
    assert a["slot_mapping"].tolist() == list(range(4, 12))
    assert a["positions"].tolist() == list(range(8))
    assert s.update(out, []) == []
    out = s.schedule()
    a = check_output(out, s)
    assert (out.num_tokens, out.num_rows) == (2, 1)
    assert a["positions"].tolist() == [8, 9] and a["seq_lens"].tolist() == [10]
    assert a["block_tables"].tolist() == [[1, 2, 3]]
    assert a["slot_mapping"].tolist() == [12, 13]
    assert a["logits_indices"].tolist() == [1]
    s.update(out, [7])
    out, _ = step(s)
    assert out.input_ids.tolist() == [7] and out.positions.tolist() == [10]
    assert out.num_decode_tokens == 1
    _, done = step(s)
    assert [(d.request_id, d.reason, d.request_finished) for d in done] == [(1, "length", True)]
    st = s.stats()
    assert (st["prompt_tokens_computed"], st["decode_tokens"], st["generated_tokens"]) == (10, 2, 3)
    out, _ = step(s)
    assert out.finished_req_ids.tolist() == [1] and out.num_tokens == 0
    assert_all_free(s)


def test_an_empty_step_has_empty_arrays_of_the_right_shapes():
    s = make()
    out = s.schedule()
    a = check_output(out)
    assert (out.num_seqs, out.num_tokens, out.num_rows, out.num_prefill_tokens, out.num_decode_tokens) == (0,) * 5
    assert a["query_start_loc"].tolist() == [0]
    assert a["block_tables"].shape == (0, 0)
    for name in ("copy_ops", "swap_out", "swap_in"):
        assert a[name].shape == (0, 2), name
    for name in ARRAYS:
        if name not in ("query_start_loc", "block_tables"):
            assert a[name].size == 0, name
    assert s.update(out, []) == []


def test_block_ops_are_k_by_2_pairs_of_block_ids():
    # 6 usable blocks of 2 tokens: the fourth step swaps request 2 out, a later one back in.
    s = make(7, 2, 16, preemption_mode="swap", num_cpu_blocks=8)
    s.add_request(1, toks(1, 4), 8)
    s.add_request(2, toks(2, 4), 8)
    for _ in range(3):
        step(s, 1)
    out, _ = step(s, 1)
    assert out.swap_out.tolist() == [[3, 0], [4, 1], [6, 2]]  # (gpu, cpu)
    swap_in = [o.swap_in for o in (step(s, 1)[0] for _ in range(20)) if len(o.swap_in)]
    assert swap_in and swap_in[0].shape == (3, 2) and swap_in[0][:, 0].tolist() == [0, 1, 2]  # (cpu, gpu)
    drain(s)
    assert_all_free(s)
    # A fork's first write into the shared block 2 copies it into block 3: (src, dst).
    s = make(16, 4, 16)
    s.add_request(3, toks(3, 5), 4)
    step(s)
    s.fork_sequence(s.request_seq_ids(3)[0])
    out, _ = step(s)
    assert out.copy_ops.tolist() == [[2, 3]]
    drain(s)
    assert_all_free(s)


# ---------------------------------------------------------------------------------------------
# Zero-copy hand-off


def test_arrays_are_views_of_rust_memory_created_once():
    s = make(16, 4, 16)
    s.add_request(1, toks(1, 6), 3, n=2)
    out = s.schedule()
    for name in ARRAYS:
        arr = getattr(out, name)
        assert isinstance(arr, np.ndarray)
        assert not arr.flags.owndata, f"{name}: numpy owns the buffer (a copy)"
        assert arr.base is not None, name
        assert not isinstance(arr.base, np.ndarray), f"{name}: a view of a numpy-owned copy"
        again = getattr(out, name)
        assert again is arr, f"{name}: a new object on each access"
        assert again.__array_interface__["data"][0] == arr.__array_interface__["data"][0]
    s.update(out, [1, 2])


def test_arrays_stay_valid_after_scheduler_and_output_are_gone():
    s = make(64, 4, 64)
    for r in range(4):
        s.add_request(r, toks(r, 5 + r), 4)
    step(s)
    out = s.schedule()
    arrays = {name: getattr(out, name) for name in ARRAYS}
    expected = {name: arr.copy() for name, arr in arrays.items()}
    s.update(out, np.full(out.num_rows, 3))
    del s, out
    gc.collect()
    # Churn the allocator so freed memory would be reused.
    for k in range(20):
        t = make(64, 4, 64)
        t.add_request(k, list(range(50)), 5)
        drain(t)
        junk = [np.full(1000, -1, np.int64) for _ in range(10)]
        del t, junk
    gc.collect()
    for name, arr in arrays.items():
        np.testing.assert_array_equal(arr, expected[name], err_msg=name)
    assert arrays["input_ids"].sum() == expected["input_ids"].sum()


def test_block_tables_are_a_read_only_view_of_the_batch_while_every_sequence_runs():
    s = make(32, 4, 32)
    for r in range(3):
        s.add_request(r, toks(r, 5), 6)
    step(s)
    out = s.schedule()
    bt = out.block_tables
    assert out.num_seqs == 3 and bt.shape == (3, 2)
    assert out.block_tables_is_view
    assert bt.base is s, "the view keeps the scheduler (and its matrix) alive"
    assert not bt.flags.writeable
    with pytest.raises(ValueError):
        bt[0, 0] = 7
    for i, seq in enumerate(out.seq_ids.tolist()):
        assert bt[i, : len(s.seq_block_table(seq))].tolist() == s.seq_block_table(seq)
    # The matrix is persistent: the next step's view starts at the same address.
    s.update(out, np.full(out.num_rows, 5))
    nxt = s.schedule()
    assert nxt.block_tables.__array_interface__["data"][0] == bt.__array_interface__["data"][0]
    s.update(nxt, np.full(nxt.num_rows, 5))


def test_block_tables_must_be_read_before_update():
    s = make(32, 4, 32)
    s.add_request(1, toks(1, 5), 6)
    step(s)
    out = s.schedule()
    s.update(out, [1])
    with pytest.raises(SchedulerStateError, match="between schedule\\(\\) and update\\(\\)"):
        out.block_tables
    # Reading it in time works, also from a later step.
    nxt = s.schedule()
    assert nxt.block_tables.shape == (1, 2)
    s.update(nxt, [1])


def test_a_step_without_every_running_sequence_gets_a_compact_copy():
    # A higher-priority prompt admitted behind a finishing prefill takes the whole budget of the
    # next step, so the (lower-priority) decode after it in the running order is left out: its
    # row is skipped and the step's block tables are a compact copy.
    s = make(64, 4, 8, max_num_seqs=4, policy="priority")
    s.add_request(2, toks(2, 20), 4, priority=0)
    left_out = None
    for _ in range(10):
        if s.num_waiting == 0 and s.num_running == 1:
            s.add_request(3, toks(3, 20), 4, priority=-1)
        out = s.schedule()
        a = check_output(out, s)
        if out.num_seqs < s.num_running_seqs:
            left_out = (out, a)
        s.update(out, np.full(out.num_rows, 9))
        if left_out:
            break
    assert left_out, "no step left a running sequence out"
    out, a = left_out
    bt = a["block_tables"]
    assert bt.flags.c_contiguous and not isinstance(bt.base, Scheduler)
    assert not out.block_tables_is_view
    assert out.block_tables is bt, "a copy stays readable after update()"
    drain(s)
    assert_all_free(s)


def test_arrays_read_after_update_are_the_step_that_was_scheduled():
    # Arrays are created lazily; reading them only after update() still gives that step's
    # data (the buffers belong to the output object, not to the scheduler).
    s = make(16, 4, 16)
    s.add_request(1, toks(1, 5), 4)
    out = s.schedule()
    s.update(out, [42])
    nxt = s.schedule()
    assert out.input_ids.tolist() == toks(1, 5)
    assert out.positions.tolist() == list(range(5))
    assert nxt.input_ids.tolist() == [42]
    s.update(nxt, [1])


# ---------------------------------------------------------------------------------------------
# Sampling columns


HOT = dict(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, presence_penalty=0.5, frequency_penalty=-0.25,
           repetition_penalty=1.25, logprobs=3)


def test_sampling_keywords_reach_every_logits_row_of_their_request():
    s = make(64, 4, 64)
    s.add_request(1, toks(1, 5), 4)  # the defaults: greedy, nothing enabled
    s.add_request(2, toks(2, 3), 4, n=2, seed=7, **HOT)
    s.add_request(3, toks(3, 4), 4, temperature=1.0, top_k=-5, logprobs=0, min_tokens=2, eos_token_id=2,
                  stop_token_ids=[9, 2])
    out = s.schedule()
    a = check_output(out, s)
    assert out.row_req_ids.tolist() == [1, 2, 2, 3] and out.row_sample_index.tolist() == [0, 0, 1, 0]
    f32 = lambda *v: np.array(v, np.float32)  # noqa: E731
    np.testing.assert_array_equal(a["row_temperature"], f32(0, 0.8, 0.8, 1.0))
    np.testing.assert_array_equal(a["row_top_p"], f32(1, 0.9, 0.9, 1))
    np.testing.assert_array_equal(a["row_min_p"], f32(0, 0.05, 0.05, 0))
    np.testing.assert_array_equal(a["row_presence"], f32(0, 0.5, 0.5, 0))
    np.testing.assert_array_equal(a["row_frequency"], f32(0, -0.25, -0.25, 0))
    np.testing.assert_array_equal(a["row_repetition"], f32(1, 1.25, 1.25, 1))
    assert a["row_top_k"].tolist() == [0, 5, 5, -1]  # any top_k <= 0 is off
    assert a["row_num_logprobs"].tolist() == [-1, 3, 3, 0]
    assert a["row_batch_rows"].tolist() == [0, 1, -1, 2]  # sample 1 of request 2 is forked at update
    assert a["row_num_output"].tolist() == [0, 0, 0, 0]
    u = a["row_uniform"].tolist()
    assert u[0] == 0.0 and len({u[1], u[2], u[3]}) == 3 and all(0 < x < 1 for x in u[1:])
    # Request 3 is under min_tokens: EOS and its stop ids are banned (EOS, also a stop id, once).
    assert sorted(zip(a["banned_rows"].tolist(), a["banned_tokens"].tolist())) == [(3, 2), (3, 9)]
    assert (out.num_greedy_rows, out.max_top_k, out.any_top_p, out.any_min_p, out.any_penalties,
            out.any_logprobs) == (1, 5, True, True, True, True)
    s.update(out, [5, 5, 5, 5])
    out, _ = step(s, 5)  # every sequence decodes: the same columns from the batch rows
    assert sorted(out.row_batch_rows.tolist()) == [0, 1, 2, 3] and out.row_num_output.tolist() == [1] * 4
    by_seq = dict(zip(out.row_seq_ids.tolist(), out.row_temperature.tolist()))
    assert sorted(by_seq.values()) == pytest.approx([0.0, 0.8, 0.8, 1.0])
    (row3,) = np.flatnonzero(out.row_req_ids == 3)
    assert sorted(zip(out.banned_rows.tolist(), out.banned_tokens.tolist())) == [(row3, 2), (row3, 9)]
    out, _ = step(s, 5)
    assert out.banned_rows.size == 0 and out.banned_tokens.size == 0, "min_tokens are out"
    drain(s)
    assert_all_free(s)
    # Each flag on its own (greedy, seeded or not, draws nothing).
    for kw, flags in [
        (dict(temperature=0.0, seed=3), (1, 0, False, False, False, False)),
        (dict(top_k=3), (0, 3, False, False, False, False)),
        (dict(top_p=0.5), (0, 0, True, False, False, False)),
        (dict(min_p=0.5), (0, 0, False, True, False, False)),
        (dict(repetition_penalty=0.9), (0, 0, False, False, True, False)),
        (dict(logprobs=0), (0, 0, False, False, False, True)),
    ]:
        one = make(16, 4, 16)
        one.add_request(1, toks(1, 3), 2, **dict(temperature=1.0) | kw)
        out, _ = step(one)
        assert (out.num_greedy_rows, out.max_top_k, out.any_top_p, out.any_min_p, out.any_penalties,
                out.any_logprobs) == flags, kw
        assert (out.row_uniform[0] == 0.0) == (kw.get("temperature") == 0.0), kw


def _draws(out: SchedulerOutput) -> dict[int, float]:
    """Request id -> its (only) row's uniform draw in this step."""
    return dict(zip(out.row_req_ids.tolist(), out.row_uniform.tolist()))


def test_seed_takes_any_int_and_seeds_equal_mod_2_64_draw_alike():
    s = make(64, 4, 64)
    seeds = {1: -1, 2: 2**64 - 1, 3: 5, 4: 5 + 2**64, 5: 5 - 2**64, 6: 2**200 + 5, 7: None, 8: 2**64 + 6}
    for rid, seed in seeds.items():
        s.add_request(rid, toks(rid, 4), 3, temperature=1.0, seed=seed)
    for _ in range(3):
        out = s.schedule()
        check_output(out, s)
        d = _draws(out)
        assert d[1] == d[2] and d[3] == d[4] == d[5] == d[6], d
        assert len({d[1], d[3], d[7], d[8]}) == 4, d
        s.update(out, np.full(out.num_rows, 7))
    assert_all_free(s)


def test_sampling_seed_keys_the_draws_of_unseeded_requests_only():
    def draws(**kw) -> list[tuple[float, float]]:
        s = make(64, 4, 64, **kw)
        s.add_request(1, toks(1, 4), 3, temperature=1.0)
        s.add_request(2, toks(2, 4), 3, temperature=1.0, seed=11)
        got = []
        while s.has_unfinished():
            d = _draws(step(s)[0])
            got.append((d[1], d[2]))
        assert_all_free(s)
        return got

    base = draws()
    assert len(base) == 3
    assert draws(sampling_seed=None) == base and draws(sampling_seed=0) == base and draws(sampling_seed=2**64) == base
    other = draws(sampling_seed=1)
    assert all(u1 != v1 and u2 == v2 for (u1, u2), (v1, v2) in zip(base, other)), (base, other)
    assert draws(sampling_seed=-1) == draws(sampling_seed=2**64 - 1) != base


# ---------------------------------------------------------------------------------------------
# Deferred step results (no text layer: the records wait; see test_text_layer.py for text)


def _empty_results(results) -> bool:
    records, rows, deltas = results
    assert isinstance(rows, np.ndarray) and rows.dtype == np.int64 and rows.ndim == 1
    return records == [] and rows.size == 0 and deltas == []


def test_update_with_defer_text_keeps_the_steps_records_for_take_step_results_once():
    s = make(32, 4, 16)
    s.add_request(1, toks(1, 3), 2)
    s.add_request(2, toks(2, 3), 4)
    assert _empty_results(s.take_step_results()), "nothing deferred yet"
    out = s.schedule()
    assert s.update(out, [7, 7], defer_text=True) == []
    seq1 = s.request_seq_ids(1)[0]
    assert s.output_tokens(seq1) == [7], "the tokens are appended at once"
    nxt = s.schedule()  # schedule does not wait for the results
    with pytest.raises(SchedulerStateError, match="take_step_results"):
        s.update(nxt, [8, 8], defer_text=True)
    s.check_invariants()
    assert s.output_tokens(seq1) == [7], "the refused update changed nothing"
    assert _empty_results(s.take_step_results())
    assert s.update(nxt, [8, 8], defer_text=True) == [], "the step stayed in flight"
    records, rows, deltas = s.take_step_results()
    assert [(r.request_id, r.reason, r.output_token_ids, r.request_finished) for r in records] == [
        (1, "length", [7, 8], True)
    ]
    assert records[0].text is None and records[0].times is not None
    assert rows.dtype == np.int64 and rows.size == 0 and deltas == []
    assert _empty_results(s.take_step_results()), "taken once"
    out = s.schedule()
    s.update(out, [9], defer_text=True)
    assert _empty_results(s.take_step_results())
    out = s.schedule()
    s.update(out, [9], defer_text=True)  # request 2's last token
    with pytest.raises(UnknownRequestError):
        s.abort(1)  # runs the deferred step first, even failing; its records wait to be taken
    assert [(r.request_id, r.reason, r.output_token_ids) for r in s.take_step_results()[0]] == [
        (2, "length", [7, 8, 9, 9])
    ]
    assert_all_free(s)


# ---------------------------------------------------------------------------------------------
# Keywords and methods reach the core


def _finish(s: Scheduler, rid: int, tokens: list[int]):
    """Feeds ``tokens`` to request ``rid`` (the only one) until it finishes; returns (n, fin)."""
    for i, t in enumerate(tokens):
        out = s.schedule()
        check_output(out, s)
        assert out.row_req_ids.tolist() == [rid]
        done = s.update(out, [t])
        s.check_invariants()
        if done:
            assert len(done) == 1 and done[0].request_id == rid and done[0].request_finished
            return i + 1, done[0]
    raise AssertionError("did not finish")



@pytest.mark.parametrize(
    "kwargs, tokens, n, reason, stop_token",
    [
        (dict(eos_token_id=2), [1, 1, 2, 1], 3, "stop", None),
        (dict(stop_token_ids=[5, 6]), [1, 6, 1], 2, "stop", 6),
        (dict(), [1] * 10, 4, "length", None),  # max_tokens=4
        (dict(eos_token_id=2, min_tokens=3), [2, 2, 2, 1], 3, "stop", None),
        (dict(eos_token_id=2, ignore_eos=True), [2, 2, 2, 2], 4, "length", None),
    ],
    ids=["eos_token_id", "stop_token_ids", "max_tokens", "min_tokens", "ignore_eos"],
)
def test_stop_keywords_reach_the_core_and_finish_reasons_come_back_as_strings(kwargs, tokens, n, reason, stop_token):
    s = make(32, 4, 16)
    s.add_request(1, toks(1, 3), 4, **kwargs)
    count, fin = _finish(s, 1, tokens)
    assert isinstance(fin, FinishedSequence)
    assert (count, fin.reason, fin.stop_token_id) == (n, reason, stop_token)
    assert fin.sample_index == 0 and "request_finished=True" in repr(fin)
    assert_all_free(s)


def test_prefix_cache_keywords_and_methods_reach_the_core():
    prompt = list(range(13))
    s = make(32, 4, 64)
    s.add_request(1, prompt, 2)
    drain(s)
    s.add_request(2, prompt, 2)
    s.add_request(3, prompt, 2, cache_salt="tenant")
    step(s)
    assert (s.num_cached_tokens(2), s.num_cached_tokens(3)) == (12, 0)
    drain(s)
    s.reset_prefix_cache()
    assert s.stats()["num_cached_blocks"] == 0
    off = make(32, 4, 64, enable_prefix_caching=False)
    for rid in (1, 2):
        off.add_request(rid, prompt, 2)
        step(off)
    assert off.num_cached_tokens(2) == 0
    drain(off)
    assert_all_free(off)


def test_fork_and_drop_return_python_values():
    s = make(16, 4, 16, max_num_seqs=4)
    s.add_request(1, toks(1, 5), 10, reserve_seqs=3)
    assert s.num_running_seqs == 0
    out = s.schedule()
    assert s.num_running_seqs == 3, "reserve_seqs holds the beam's slots"
    parent = int(out.row_seq_ids[0])
    child = s.fork_sequence(parent, 42)  # in flight: the child's token
    assert isinstance(child, int) and s.request_seq_ids(1) == [parent, child]
    s.update(out, [41])
    assert s.seq_tokens(parent)[5:] == [41] and s.seq_tokens(child)[5:] == [42]
    grandchild = s.fork_sequence(child)  # between steps: no token
    assert s.seq_tokens(grandchild) == s.seq_tokens(child)
    assert s.drop_sequence(parent) is False
    assert s.drop_sequence(child) is False
    assert s.drop_sequence(grandchild) is True
    assert_all_free(s)


@pytest.mark.parametrize(
    "make_ids",
    [
        list,
        tuple,
        lambda v: range(v[0], v[-1] + 1),
        lambda v: np.array(v, np.int64),
        lambda v: np.array(v, np.int32),
        lambda v: np.array(v, np.uint16),
        lambda v: np.repeat(np.array(v, np.int64), 2)[::2],  # not contiguous
    ],
    ids=["list", "tuple", "range", "int64", "int32", "uint16", "strided"],
)
def test_token_id_inputs_of_every_kind(make_ids):
    s = make(16, 4, 16)
    s.add_request(1, make_ids([10, 11, 12, 13, 14]), 3, stop_token_ids=make_ids([20, 21]))
    assert s.seq_tokens(s.request_seq_ids(1)[0]) == [10, 11, 12, 13, 14]
    out = s.schedule()
    assert s.update(out, make_ids([30])) == []
    out = s.schedule()
    (fin,) = s.update(out, make_ids([21]))
    assert (fin.reason, fin.stop_token_id, fin.request_finished) == ("stop", 21, True)
    assert_all_free(s)



def test_prefix_cache_counters_count_each_requests_first_admission():
    """What the server's prefix_cache_queries/hits report: prompt tokens and the hits among them
    at each request's first admission (hits never exceed queries, whatever preemption re-admits),
    and nothing for a request aborted before it ran (vLLM counts prompt tokens once prefilled)."""
    s = make(num_blocks=9, block_size=4, budget=64, enable_prefix_caching=True, max_num_seqs=4)
    for rid in range(4):  # 4 x 12 tokens, nothing shared: decodes outgrow the cache and preempt
        s.add_request(rid, toks(rid, 12), 8)
    s.add_request(9, toks(9, 5), 4)
    s.abort(9)
    drain(s)
    st = s.stats()
    assert st["preemptions"] > 0 and st["cached_prompt_tokens"] > 0  # re-admissions hit their own blocks
    assert (st["prompt_tokens"], st["first_admission_cached_tokens"]) == (48, 0)
    assert st["prefix_cache_queried_tokens"] == 48


@pytest.mark.parametrize("caching", [True, False])
def test_prefix_cache_queries_leave_out_requests_that_never_read_the_cache(caching):
    """vLLM's queries: a request that skips cache hits (prompt logprobs) looks nothing up, nor
    does any request with caching off."""
    s = make(num_blocks=32, block_size=4, budget=64, enable_prefix_caching=caching, max_num_seqs=4)
    s.add_request(1, toks(1, 12), 2)
    s.add_request(2, toks(1, 12), 2, skip_cache_hits=True)
    drain(s)
    st = s.stats()
    assert (st["prompt_tokens"], st["prefix_cache_queried_tokens"]) == (24, 12 if caching else 0)


def test_stats_and_properties():
    s = Scheduler(64, block_size=8, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=100)
    assert set(s.stats()) == STATS_KEYS
    assert all(isinstance(v, int) for v in s.stats().values())
    assert (s.num_blocks, s.block_size, s.max_num_seqs, s.max_model_len) == (64, 8, 4, 100)
    assert (s.num_free_blocks, s.num_waiting, s.num_running, s.num_running_seqs, s.num_unfinished) == (63, 0, 0, 0, 0)
    s.add_request(7, list(range(5)), 3, n=3)  # each of n samples counts, as vLLM's child requests
    assert (s.stats()["num_waiting"], s.stats()["num_waiting_seqs"]) == (1, 3)
    s.abort(7)
    assert s.stats()["num_waiting_seqs"] == 0
    s.add_request(1, list(range(20)), 3)
    assert s.num_waiting == 1 and s.num_unfinished == 1 and s.has_unfinished()
    step(s)
    st = s.stats()
    assert (st["num_running"], st["num_running_seqs"], st["num_used_blocks"]) == (1, 1, 3)
    assert st["num_used_token_slots"] == 20 and st["max_step_tokens"] == 20
    assert (st["step_tokens_le_16"], st["step_tokens_le_32"], st["step_tokens_sum"]) == (0, 1, 20)
    assert st["requests_added"] == 2 and st["prompt_tokens"] == 20  # (the aborted one was never admitted)
    assert "running=1" in repr(s)
    drain(s)
    assert s.stats()["requests_finished"] == 1



# ---------------------------------------------------------------------------------------------
# Errors


BAD_INPUT_CLASSES = [
    InvalidArgumentError,
    DuplicateRequestError,
    UnknownRequestError,
    UnknownSequenceError,
    PromptTooLongError,
    CacheCapacityError,
]


def test_error_hierarchy():
    for cls in BAD_INPUT_CLASSES:
        assert issubclass(cls, FerrokvError) and issubclass(cls, ValueError), cls
        assert issubclass(cls, InvalidArgumentError)
        assert not issubclass(cls, RuntimeError)
        assert cls.__module__ == "ferrokv"
        assert getattr(ferrokv._core, cls.__name__) is cls
    assert issubclass(SchedulerStateError, FerrokvError) and issubclass(SchedulerStateError, RuntimeError)
    assert not issubclass(SchedulerStateError, ValueError)
    assert issubclass(FerrokvError, Exception) and not issubclass(FerrokvError, ValueError)


def _sched_with_a_running_request() -> Scheduler:
    s = Scheduler(64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, watermark=0.0)
    s.add_request(1, toks(1, 10), 4)
    step(s)
    return s


@pytest.mark.parametrize(
    "call, exc, fragments",
    [
        (lambda s: s.add_request(1, [1, 2, 3], 4), DuplicateRequestError, ["request_id=1"]),
        (lambda s: s.add_request(2, [], 4), InvalidArgumentError, ["prompt_token_ids"]),
        (lambda s: s.add_request(2, np.array([], np.int64), 4), InvalidArgumentError, ["prompt_token_ids"]),
        (lambda s: s.add_request(2, [1], 0), InvalidArgumentError, ["max_tokens=0"]),
        (lambda s: s.add_request(2, [1], -3), InvalidArgumentError, ["max_tokens=-3"]),
        (lambda s: s.add_request(2, list(range(300)), 4), PromptTooLongError, ["300", "max_model_len=256"]),
        (lambda s: s.add_request(2, [1, -5], 4), InvalidArgumentError, ["prompt_token_ids=-5"]),
        (lambda s: s.add_request(2, np.array([1, -5], np.int32), 4), InvalidArgumentError, ["prompt_token_ids=-5"]),
        (lambda s: s.add_request(2, [2**32], 4), InvalidArgumentError, ["prompt_token_ids=4294967296"]),
        (lambda s: s.add_request(-2, [1], 4), InvalidArgumentError, ["request_id=-2"]),
        (lambda s: s.add_request(2, "hello world", 4), InvalidArgumentError, ["prompt_token_ids", "string"]),
        (lambda s: s.add_request(2, [1.5, 2.0], 4), InvalidArgumentError, ["prompt_token_ids"]),
        (lambda s: s.add_request(2, [1], 4, n=0), InvalidArgumentError, ["n=0"]),
        (lambda s: s.add_request(2, [1], 4, n=9), InvalidArgumentError, ["n=9", "max_num_seqs"]),
        (lambda s: s.add_request(2, [1], 4, min_tokens=5), InvalidArgumentError, ["min_tokens=5"]),
        (lambda s: s.add_request(2, [1], 4, min_tokens=-1), InvalidArgumentError, ["min_tokens=-1"]),
        (lambda s: s.add_request(2, [1], 4, reserve_seqs=9), InvalidArgumentError, ["reserve_seqs=9", "max_num_seqs"]),
        (lambda s: s.add_request(2, [1], 4, reserve_seqs=-1), InvalidArgumentError, ["reserve_seqs=-1"]),
        (lambda s: s.add_request(2, [1], 4, eos_token_id=-1), InvalidArgumentError, ["eos_token_id=-1"]),
        (lambda s: s.add_request(2, [1], 4, stop_token_ids=[3, -2]), InvalidArgumentError, ["stop_token_ids=-2"]),
        (lambda s: s.add_request(2, [1], 4, stop_token_ids="ab"), InvalidArgumentError, ["stop_token_ids"]),
        (lambda s: s.add_request(2, list(range(200)), 56), CacheCapacityError, ["request_id=2", "64", "63"]),
        (lambda s: s.add_request(2, [1], 4, temperature=-1), InvalidArgumentError, ["temperature=-1", ">= 0"]),
        (lambda s: s.add_request(2, [1], 4, temperature=float("inf")), InvalidArgumentError, ["temperature=inf"]),
        (lambda s: s.add_request(2, [1], 4, temperature=1e300), InvalidArgumentError,
         ["temperature=1e300", "float32 range"]),
        (lambda s: s.add_request(2, [1], 4, repetition_penalty=-1e39), InvalidArgumentError,
         ["repetition_penalty=-1e39", "float32 range"]),
        (lambda s: s.add_request(2, [1], 4, top_p=0), InvalidArgumentError, ["top_p=0", "(0, 1]"]),
        (lambda s: s.add_request(2, [1], 4, top_p=1.5), InvalidArgumentError, ["top_p=1.5"]),
        (lambda s: s.add_request(2, [1], 4, min_p=2), InvalidArgumentError, ["min_p=2", "[0, 1]"]),
        (lambda s: s.add_request(2, [1], 4, repetition_penalty=0), InvalidArgumentError, ["repetition_penalty=0"]),
        (lambda s: s.add_request(2, [1], 4, logprobs=-1), InvalidArgumentError, ["logprobs=-1"]),
        (lambda s: s.add_request(2, [1], 4, presence_penalty=float("nan")), InvalidArgumentError,
         ["presence_penalty=NaN", "finite"]),
        (lambda s: s.add_request(2, [1], 4, frequency_penalty=float("-inf")), InvalidArgumentError,
         ["frequency_penalty=-inf"]),
        (lambda s: s.add_request(2, [1], 4, seed="x"), InvalidArgumentError, ["seed=str", "int"]),
        (lambda s: s.add_request(2, [1], 4, seed=1.0), InvalidArgumentError, ["seed=float"]),
        (lambda s: s.abort(99), UnknownRequestError, ["request_id=99"]),
        (lambda s: s.abort(-1), InvalidArgumentError, ["request_id=-1"]),
        (lambda s: s.num_cached_tokens(99), UnknownRequestError, ["request_id=99"]),
        (lambda s: s.request_seq_ids(99), UnknownRequestError, ["request_id=99"]),
        (lambda s: s.fork_sequence(999), UnknownSequenceError, ["seq_id=999"]),
        (lambda s: s.fork_sequence(-1), InvalidArgumentError, ["seq_id=-1"]),
        (lambda s: s.fork_sequence(0, 5), InvalidArgumentError, ["next_token=5", "no step in flight"]),
        (lambda s: s.fork_sequence(0, -5), InvalidArgumentError, ["next_token=-5"]),
        (lambda s: s.drop_sequence(999), UnknownSequenceError, ["seq_id=999"]),
        (lambda s: s.seq_tokens(999), UnknownSequenceError, ["seq_id=999"]),
        (lambda s: s.seq_block_table(999), UnknownSequenceError, ["seq_id=999"]),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else None,
)
def test_bad_input_raises_a_typed_error_and_changes_nothing(call, exc, fragments):
    s = _sched_with_a_running_request()
    before = s.stats()
    with pytest.raises(exc) as info:
        call(s)
    assert type(info.value) is exc
    assert isinstance(info.value, FerrokvError) and isinstance(info.value, ValueError)
    for frag in fragments:
        assert frag in str(info.value), (frag, str(info.value))
    # Nothing changed; the scheduler keeps working and leaks nothing.
    s.check_invariants()
    after = s.stats()
    assert after == before
    assert s.num_unfinished == 1
    s.add_request(2, toks(2, 7), 3)
    done = drain(s)
    assert sorted(d.request_id for d in done if d.request_finished) == [1, 2]
    assert_all_free(s)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(preemption_mode="lifo"), 'preemption_mode="lifo"'),
        (dict(policy="lru"), 'policy="lru"'),
        (dict(num_blocks=1), "num_blocks=1"),
        (dict(num_blocks=-4), "num_blocks=-4"),
        (dict(block_size=0), "block_size=0"),
        (dict(block_size=12), "block_size=12"),
        (dict(max_num_seqs=1 << 20, max_num_batched_tokens=1 << 20, max_model_len=1 << 20), "max_model_len=1048576"),
        (dict(max_num_seqs=0), "max_num_seqs=0"),
        (dict(max_num_seqs=64, max_num_batched_tokens=32), "max_num_batched_tokens=32"),
        (dict(max_model_len=0), "max_model_len=0"),
        (dict(num_cpu_blocks=-1), "num_cpu_blocks=-1"),
        (dict(watermark=1.0), "watermark=1"),
        (dict(watermark=-0.1), "watermark=-0.1"),
        # Sizes that used to abort the process (SIGABRT) or wrap around.
        (dict(num_blocks=32, block_size=2**40), f"block_size={2**40}"),
        (dict(num_blocks=4, block_size=2**62), f"block_size={2**62}"),
        (dict(num_blocks=2**31), f"num_blocks={2**31}"),
        (dict(num_blocks=8, num_cpu_blocks=2**32 - 2), f"num_cpu_blocks={2**32 - 2}"),
        (dict(num_blocks=8, num_cpu_blocks=2**33), f"num_cpu_blocks={2**33}"),
        (dict(sampling_seed="x"), "sampling_seed=str"),
        (dict(sampling_seed=1.5), "sampling_seed=float"),
    ],
)
def test_bad_config_raises_invalid_argument(kwargs, field):
    args = dict(num_blocks=16) | kwargs
    with pytest.raises(InvalidArgumentError) as info:
        Scheduler(**args)
    assert field in str(info.value), str(info.value)
    assert isinstance(info.value, ValueError)
    assert f"{info.value.field}={info.value.value}" == field and info.value.reason in str(info.value)
    if kwargs.keys() <= VALIDATE_ARGS.keys():  # the same rule, checked without building a Scheduler
        with pytest.raises(InvalidArgumentError, match=re.escape(str(info.value))):
            validate_scheduler_config(**VALIDATE_ARGS | kwargs)


# Engine-like settings for validate_scheduler_config: the block count and model length not known yet.
VALIDATE_ARGS = dict(block_size=16, max_num_seqs=256, num_blocks=None, max_model_len=None, num_cpu_blocks=0,
                     preemption_mode="recompute", policy="fcfs")


def test_validate_scheduler_config_lets_unknown_settings_pass():
    validate_scheduler_config(**VALIDATE_ARGS)
    # The token budget follows max_num_seqs (an engine raises it), and an unknown model length
    # does not count against the batch-matrix limit...
    validate_scheduler_config(**VALIDATE_ARGS | dict(max_num_seqs=1 << 16, block_size=1))
    # ...until it is known.
    with pytest.raises(InvalidArgumentError, match="max_model_len=16384") as info:
        validate_scheduler_config(**VALIDATE_ARGS | dict(max_num_seqs=1 << 16, block_size=1, max_model_len=1 << 14))
    assert info.value.field == "max_model_len"
    assert InvalidArgumentError("a message").field is None


def test_out_of_order_calls_raise_scheduler_state_error_and_recover():
    s = _sched_with_a_running_request()
    stale = s.schedule()
    s.update(stale, [1])
    with pytest.raises(SchedulerStateError, match="no step in flight"):
        s.update(stale, [1])  # nothing in flight
    out = s.schedule()
    with pytest.raises(SchedulerStateError, match="in flight") as info:
        s.schedule()  # twice without update
    assert isinstance(info.value, RuntimeError) and not isinstance(info.value, ValueError)
    with pytest.raises(SchedulerStateError, match=f"step {stale.step_id}.*step {out.step_id}"):
        s.update(stale, [1])  # the output of another step
    # A bad token list is bad input (ValueError), and the step stays in flight.
    with pytest.raises(InvalidArgumentError, match=r"sampled_token_ids=<2 tokens>.*\(1\)"):
        s.update(out, [1, 2])
    with pytest.raises(InvalidArgumentError, match="sampled_token_ids=-1"):
        s.update(out, [-1])
    with pytest.raises(InvalidArgumentError, match="sampled_token_ids"):
        s.update(out, "a")
    with pytest.raises(InvalidArgumentError, match="sampled_token_ids"):
        s.update(out, np.array([1.5]))
    s.check_invariants()
    assert s.update(out, np.array([1], np.int32)) == []
    s.add_request(2, toks(2, 3), 2)
    drain(s)
    assert_all_free(s)



def test_update_rejects_another_schedulers_output():
    a, b = make(16, 4, 16), make(16, 4, 16)
    a.add_request(1, toks(1, 3), 4)
    b.add_request(1, toks(1, 3), 4)
    out_a, out_b = a.schedule(), b.schedule()
    with pytest.raises(SchedulerStateError):
        a.update(out_b, np.array([1], np.int32))
    a.update(out_a, np.array([1], np.int32))
    b.update(out_b, np.array([1], np.int32))
    a.check_invariants()



# ---------------------------------------------------------------------------------------------
# GIL


def _big_scheduler(num_requests: int = 2048, prompt_len: int = 512) -> Scheduler:
    """One schedule() admits ~1M prompt tokens: tens of ms in schedule() and in update()."""
    s = Scheduler(
        num_blocks=1 + num_requests * (prompt_len // 16 + 2),
        block_size=16,
        max_num_seqs=num_requests,
        max_num_batched_tokens=2_000_000,
        max_model_len=4096,
    )
    base = np.arange(prompt_len, dtype=np.int64)
    for r in range(num_requests):
        s.add_request(r, base + r * prompt_len, 2)
    return s


def _busy_python(seconds: float) -> None:
    """Holds the GIL (pure bytecode; a forced switch needs a 0.5 s wait, see below)."""
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        pass


def test_schedule_and_update_release_the_gil():
    # A ticker thread stamps perf_counter() and sleeps 0.2 ms (sleeping releases the GIL). With
    # the switch interval at 0.5 s, a thread waiting for the GIL only forces the holder to drop
    # it after waiting 0.5 s, so if schedule()/update() (each well under 0.5 s) held the GIL,
    # no stamp could fall strictly inside [t0, t1]: the main thread holds the GIL from just
    # before t0 (it reacquires it after its own short sleep) until it next sleeps, after t1.
    # The control (a GIL-holding pure-Python busy loop of similar length, measured the same
    # way) must show no stamp at all, which proves that the measurement can fail.
    stamps: list[float] = []
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            stamps.append(time.perf_counter())
            time.sleep(0.0002)

    windows: dict[str, list[tuple[float, float]]] = {"schedule": [], "update": [], "control": []}

    def timed(name: str, fn):
        time.sleep(0.002)
        t0 = time.perf_counter()
        result = fn()
        t1 = time.perf_counter()
        windows[name].append((t0, t1))
        return result

    old = sys.getswitchinterval()
    thread = threading.Thread(target=ticker, daemon=True)
    sys.setswitchinterval(0.5)
    thread.start()
    try:
        for _ in range(3):
            s = _big_scheduler()
            out = timed("schedule", s.schedule)
            sampled = np.zeros(out.num_rows, np.int64)
            timed("update", lambda: s.update(out, sampled))
            timed("control", lambda: _busy_python(0.02))
            assert out.num_tokens == 2048 * 512 and out.num_rows == 2048
            del s, out
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(old)
    inside = {name: [sum(1 for x in stamps if t0 < x < t1) for t0, t1 in ws] for name, ws in windows.items()}
    durations = {name: [round(t1 - t0, 4) for t0, t1 in ws] for name, ws in windows.items()}
    assert len(stamps) > 10, "the ticker thread did not run"
    for name in windows:
        assert max(durations[name]) < 0.4, f"{name} too slow for the argument above: {durations}"
    assert inside["control"] == [0, 0, 0], f"the measurement cannot see a held GIL: {inside}, {durations}"
    assert max(inside["schedule"]) >= 1, f"no progress of another thread during schedule(): {inside}, {durations}"
    # Since blocks are registered at schedule time, this update only stages tokens: too short
    # (well under a switch interval) for another thread to be seen, unless it was.
    assert max(inside["update"]) >= 1 or max(durations["update"]) < 0.005, f"update(): {inside}, {durations}"


def test_request_times_are_on_time_monotonic_and_travel_with_the_finished_record():
    s = make()
    before = time.monotonic()
    s.add_request(1, toks(1, 3), max_tokens=2)
    queued, scheduled, first, last, finished = s.request_times(1)
    after = time.monotonic()
    assert before <= queued <= after, "the core's clock is anchored to time.monotonic()"
    assert (scheduled, first, last, finished) == (0.0, 0.0, 0.0, 0.0)
    done = []
    while s.has_unfinished():
        out = s.schedule()
        done += s.update(out, np.full(out.num_rows, 7, np.int64))
    end = time.monotonic()
    (f,) = done
    assert f.request_finished and f.times is not None
    assert queued <= f.times[1] <= f.times[2] <= f.times[3] <= f.times[4] <= end
    assert f.times[0] == queued
    with pytest.raises(UnknownRequestError):
        s.request_times(1)
