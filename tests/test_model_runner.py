"""``ferrokv.model_runner``: a real scheduler's steps turned into model inputs, and the forward pass.

The expected tensors are derived independently of the runner: positions, slots and tokens from
the sequences' own block tables (``Scheduler.seq_block_table``) and the tokens the test itself
fed in. A tiny random llama on the CPU (torch backend) is compared with transformers.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ferrokv._core import Scheduler, SchedulerOutput
from ferrokv.kv_cache import PagedKVCache
from ferrokv.model_loader import load_model
from ferrokv.model_runner import ModelRunner, StepInputs
from helpers.kv_caches import model_kv_spec

BLOCK_SIZE = 4
NUM_BLOCKS = 48
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model(llama_path):
    return load_model(llama_path, attn_backend="torch")


def _setup(model, budget: int = 64) -> tuple[Scheduler, ModelRunner]:
    sched = Scheduler(NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_seqs=4, max_num_batched_tokens=budget,
                      max_model_len=64)
    kv = PagedKVCache(model_kv_spec(model, BLOCK_SIZE), NUM_BLOCKS, 0, CPU)
    return sched, ModelRunner(model, kv, CPU)


def _check_inputs(sched: Scheduler, out: SchedulerOutput, inp: StepInputs, tokens: dict[int, list[int]]) -> None:
    """``tokens[request_id]``: every token of the request so far (prompt, then sampled ones)."""
    qsl, seq_lens = out.query_start_loc.tolist(), out.seq_lens.tolist()
    ids, pos, slots = [], [], []
    for i, (rid, seq) in enumerate(zip(out.req_ids.tolist(), out.seq_ids.tolist())):
        table = sched.seq_block_table(seq)
        end = seq_lens[i]
        new = range(end - (qsl[i + 1] - qsl[i]), end)
        ids += [tokens[rid][p] for p in new]
        pos += list(new)
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in new]
        row = inp.meta.block_tables[i].tolist()
        assert row[: len(table)] == table and not any(row[len(table):]), (row, table)
    assert inp.input_ids.tolist() == ids and inp.input_ids.dtype == torch.int64
    assert inp.positions.tolist() == pos and inp.positions.dtype == torch.int64
    assert inp.meta.slot_mapping.tolist() == slots
    assert inp.meta.query_start_loc.tolist() == qsl and inp.meta.seq_lens.tolist() == seq_lens
    assert inp.meta.block_tables.dtype == torch.int32 and inp.meta.block_tables.stride(1) == 1  # rows contiguous
    assert inp.meta.max_query_len == max(b - a for a, b in zip(qsl, qsl[1:]))
    assert inp.meta.max_seq_len == max(seq_lens)
    every_token = out.num_rows == out.num_tokens and out.logits_indices.tolist() == list(range(out.num_tokens))
    assert inp.every_token_samples == (every_token and out.num_decode_tokens == out.num_tokens)
    if out.num_rows and not inp.every_token_samples:
        assert inp.logits_indices.tolist() == out.logits_indices.tolist()
    else:
        assert inp.logits_indices is None


def _sample(sched: Scheduler, out: SchedulerOutput, tokens: dict[int, list[int]], token: int = 7) -> list:
    """Feeds ``token`` to every sampling row and records it as the request's next token."""
    for rid in out.row_req_ids.tolist():
        tokens[rid].append(token)
    return sched.update(out, np.full(out.num_rows, token, np.int64))


# ------------------------------------------------------------------------------------------------
def test_prepare_maps_prefill_chunks_and_decodes(model):
    # Budget 8: the 11-token prompt is prefilled in chunks, so steps mix chunks that do not
    # sample yet, finished prompts and decodes.
    sched, runner = _setup(model, budget=8)
    prompts = {0: list(range(10, 21)), 1: [5, 6, 7], 2: [40, 41, 42, 43, 44]}
    tokens = {rid: list(p) for rid, p in prompts.items()}
    for rid, p in prompts.items():
        sched.add_request(rid, p, 5)
    kinds = set()
    while sched.has_unfinished():
        out = sched.schedule()
        _check_inputs(sched, out, runner.prepare(out), tokens)
        kinds.add((out.num_prefill_tokens > 0, out.num_decode_tokens > 0, out.num_rows < out.num_seqs))
        _sample(sched, out, tokens)
    # (prefill tokens, decode tokens, a row that does not sample)
    assert (True, False, True) in kinds, kinds  # a chunk whose prompt is not done yet
    assert (True, True, False) in kinds, kinds  # prefills beside decodes
    assert (False, True, False) in kinds, kinds  # all decode: logits row i is token i, no gather


def test_a_step_with_as_many_rows_as_tokens_that_are_not_all_decodes_keeps_its_gather(model):
    """Budget 4: request 0's 6-token prompt takes a 4-token chunk, then its last 2 tokens (one
    row) beside request 1's 1-token prompt with n=2 (two rows at its one token): 3 tokens and 3
    rows, logits indices [1, 2, 2], which only the decode count tells from an all-decode step."""
    sched, runner = _setup(model, budget=4)
    tokens = {0: list(range(10, 16)), 1: [5]}
    sched.add_request(0, tokens[0], 3)
    sched.add_request(1, tokens[1], 3, n=2)
    seen = []
    while sched.has_unfinished():
        out = sched.schedule()
        inp = runner.prepare(out)
        _check_inputs(sched, out, inp, {rid: t + [7] * 8 for rid, t in tokens.items()})
        seen.append((out.num_tokens, out.num_rows, out.num_decode_tokens, inp.every_token_samples))
        sched.update(out, np.full(out.num_rows, 7, np.int64))
    assert any(t == r and d < t for t, r, d, _ in seen), seen
    assert any(e for *_, e in seen), seen


def test_block_tables_of_a_decode_step_view_the_batch_matrix_until_the_next_schedule(model):
    """An all-decode step's tables view the scheduler's batch matrix: on the CPU the runner reads
    them in place (no per-step copy growing with the sequences' lengths), valid until update(),
    which moves rows when a sequence has finished (the engine's forward pass ends before it)."""
    sched, runner = _setup(model)
    tokens = {rid: [3 + rid] * 5 for rid in range(3)}
    for rid, max_tokens in ((0, 2), (1, 6), (2, 6)):
        sched.add_request(rid, tokens[rid], max_tokens)
    _sample(sched, sched.schedule(), tokens)  # prefill, first token
    out = sched.schedule()  # all three decode: the batch view
    assert out.block_tables_is_view and out.num_seqs == 3
    inp = runner.prepare(out)
    view = out.block_tables
    assert not view.flags.c_contiguous, "rows of the wider batch matrix"
    assert inp.meta.block_tables.data_ptr() == view.ctypes.data, "no copy"
    assert inp.meta.block_tables.stride() == tuple(s // view.itemsize for s in view.strides)
    kept = inp.meta.block_tables.clone()
    _check_inputs(sched, out, inp, tokens)
    done = _sample(sched, out, tokens)  # update(): request 0 finishes, the last row moves into its own
    assert [f.request_id for f in done] == [0]
    assert not torch.equal(inp.meta.block_tables, kept), "the view saw the move: valid until update()"
    nxt = sched.schedule()
    assert nxt.block_tables_is_view and nxt.num_seqs == 2
    assert torch.equal(torch.from_numpy(nxt.block_tables.copy()), kept[[2, 1]])
    _check_inputs(sched, nxt, runner.prepare(nxt), tokens)
    _sample(sched, nxt, tokens)


def test_execute_matches_transformers(model, llama_path, hf_model):
    """Greedy decoding through scheduler + runner: every sampled row's logits equal transformers'
    logits of the same token prefix, and the greedy tokens follow."""
    hf = hf_model(llama_path)
    sched, runner = _setup(model, budget=8)
    prompts = {0: [17, 99, 250, 3, 8, 77, 140, 200, 31], 1: [5, 6], 2: [64, 12, 390, 5, 58]}
    tokens = {rid: list(p) for rid, p in prompts.items()}
    for rid, p in prompts.items():
        sched.add_request(rid, p, 4)
    rows = 0
    while sched.has_unfinished():
        out = sched.schedule()
        logits = runner.execute(out)
        if logits is None:
            assert out.num_rows == 0
            sched.update(out, np.zeros(0, np.int64))
            continue
        assert logits.shape == (out.num_rows, model.config.vocab_size) and logits.dtype == torch.float32
        assert torch.is_grad_enabled() and logits.grad_fn is None, "no autograd graph is recorded"
        picked = logits.argmax(dim=-1)
        for r, rid in enumerate(out.row_req_ids.tolist()):
            with torch.no_grad():
                ref = hf(torch.tensor([tokens[rid]])).logits[0, -1]
            torch.testing.assert_close(logits[r], ref, atol=1e-4, rtol=0)
            tokens[rid].append(int(picked[r]))
            rows += 1
        sched.update(out, picked.numpy())
    assert rows == 3 * 4
    for rid, p in prompts.items():
        assert len(tokens[rid]) == len(p) + 4


def test_runner_refuses_a_kv_cache_on_another_device(model):
    from ferrokv.checks import DeviceMismatchError

    kv = PagedKVCache(model_kv_spec(model, BLOCK_SIZE), 4, 0, torch.device("meta"))
    with pytest.raises(DeviceMismatchError, match="the KV cache is on meta but the model runner is on cpu"):
        ModelRunner(model, kv, CPU)
    with pytest.raises(DeviceMismatchError, match="the model is on cpu but the model runner is on meta"):
        ModelRunner(model, kv, torch.device("meta"))
