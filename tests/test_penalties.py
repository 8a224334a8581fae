"""PenaltyState: per-batch-row penalty statistics carried across steps, validated each step
against the scheduler's columns (row_batch_rows, row_seq_ids, row_num_output).

Each test drives a sequence of steps (``types.SimpleNamespace`` steps carrying the columns the
state reads) and compares the returned counts / seen mask with a direct computation from the
sequences' histories, counting the ``history_of`` calls (a row that is up to date is not rebuilt).
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ferrokv.penalties import PenaltyState
from ferrokv.sampler import (
    PenaltyInputs,
    SamplingArrays,
    SamplingMetadata,
    SamplingRow,
    penalty_rows,
    sample,
)
from ferrokv.sampling_params import SamplingParams as SP

V = 50


class World:
    """The core's side: each sequence's prompt and output tokens; counts the history reads."""

    def __init__(self) -> None:
        self.prompt: dict[int, list[int]] = {}
        self.output: dict[int, list[int]] = {}
        self.history_calls: list[int] = []
        self.prompt_calls: list[int] = []
        self.layout: list[tuple[int, int]] = []  # this step's (batch row, seq id) per logits row

    def add(self, seq: int, prompt: list[int], output: list[int] | None = None) -> None:
        self.prompt[seq] = list(prompt)
        self.output[seq] = list(output or [])

    def step(self, layout: list[tuple[int, int]]) -> SimpleNamespace:
        self.layout = layout
        return SimpleNamespace(
            row_batch_rows=np.array([b for b, _ in layout], dtype=np.int32),
            row_seq_ids=np.array([s for _, s in layout], dtype=np.int64),
            row_num_output=np.array([len(self.output[s]) for _, s in layout], dtype=np.int32),
        )

    def prompt_of(self, logits_row: int) -> list[int]:
        self.prompt_calls.append(logits_row)
        return self.prompt[self.layout[logits_row][1]]

    def history_of(self, seq: int) -> list[int]:
        self.history_calls.append(seq)
        return list(self.output[seq])

    def expected(self, seqs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        counts = torch.zeros(len(seqs), V)
        seen = torch.zeros(len(seqs), V, dtype=torch.bool)
        for j, s in enumerate(seqs):
            for t in self.output[s]:
                if 0 <= t < V:
                    counts[j, t] += 1
                    seen[j, t] = True
            for t in self.prompt[s]:
                if 0 <= t < V:
                    seen[j, t] = True
        return counts, seen


def run_step(state: PenaltyState, world: World, layout, pen: list[int], sampled=None, cancel=False):
    """One step: the state's inputs for logits rows ``pen`` are checked against the histories,
    then the step's sampled tokens are recorded and (unless cancelled) appended to the outputs.
    Returns (inputs, history_of calls of this step)."""
    out = world.step(layout)
    world.history_calls.clear()
    rows = np.array(pen, dtype=np.int64)
    got = state.inputs(out, rows, world.prompt_of, world.history_of)
    assert isinstance(got, PenaltyInputs)
    assert got.rows.dtype == torch.int64 and got.rows.tolist() == pen
    counts, seen = world.expected([layout[r][1] for r in pen])
    assert torch.equal(got.output_counts, counts), (layout, pen)
    assert torch.equal(got.seen_mask, seen), (layout, pen)
    calls = list(world.history_calls)
    if sampled is None:
        sampled = [(7 * i + 3 * len(world.output[s])) % V for i, (_, s) in enumerate(layout)]
    snapshot = (got.output_counts.clone(), got.seen_mask.clone())
    state.record(torch.tensor(sampled, dtype=torch.int64))
    # The returned statistics are the step's own: recording the step does not change them.
    assert torch.equal(got.output_counts, snapshot[0]) and torch.equal(got.seen_mask, snapshot[1])
    if not cancel:
        for (_, s), t in zip(layout, sampled):
            world.output[s].append(t)
    return got, calls


def test_scripted_steps():
    state = PenaltyState(V, torch.device("cpu"))
    w = World()
    A, B, C, X = 10, 11, 12, 99  # X: a row without penalties
    w.add(A, [1, 2, 3, 60, -2])  # out-of-range prompt ids are ignored
    w.add(B, [4, 4])
    w.add(C, [5], [6, 6, 70])  # joins later with outputs already (a resumed sequence)
    w.add(X, [0])

    # 1. A and B join: statistics from their prompts; no output yet, so no history read.
    _, calls = run_step(state, w, [(0, A), (1, X), (2, B)], [0, 2], sampled=[7, 8, 9])
    assert calls == []
    assert sorted(w.prompt_calls) == [0, 2]

    # 2. Both stay put: the statistics are carried (record counted the tokens), nothing re-read.
    w.prompt_calls.clear()
    _, calls = run_step(state, w, [(0, A), (1, X), (2, B)], [0, 2], sampled=[7, 8, V + 10])
    assert calls == [] and w.prompt_calls == []

    # 3. Steady again (A has 7 twice now, B's out-of-range token was ignored).
    got, calls = run_step(state, w, [(0, A), (1, X), (2, B)], [0, 2], sampled=[7, 1, 2])
    assert calls == [] and w.prompt_calls == []
    assert got.output_counts[0, 7] == 2

    # 4. B moves from row 2 to row 1 (X left): its statistics are copied over, no history read
    # (a rebuild would cost O(output) each time a row ahead ends); C joins at row 2 (B's old row):
    # rebuilt.
    _, calls = run_step(state, w, [(0, A), (1, B), (2, C)], [0, 1, 2])
    assert calls == [C]

    # 5. Steady.
    _, calls = run_step(state, w, [(0, A), (1, B), (2, C)], [0, 1, 2])
    assert calls == []

    # 6. A cancelled step: recorded, but its tokens never became outputs.
    _, calls = run_step(state, w, [(0, A), (1, B), (2, C)], [0, 1, 2], sampled=[20, 21, 22], cancel=True)
    assert calls == []
    # 7. So the next step's row_num_output did not advance: every row is rebuilt (the values
    # checked in run_step do not include the cancelled tokens).
    _, calls = run_step(state, w, [(0, A), (1, B), (2, C)], [0, 1, 2])
    assert sorted(calls) == [A, B, C]
    _, calls = run_step(state, w, [(0, A), (1, B), (2, C)], [0, 1, 2])
    assert calls == []

    # 8. Fan-out: children of A with no batch row yet get fresh statistics from the prompt, no
    # history read for anyone.
    w.add(20, w.prompt[A])
    w.add(21, w.prompt[A])
    w.prompt_calls.clear()
    got, calls = run_step(state, w, [(0, A), (1, B), (-1, 20), (2, C), (-1, 21)], [0, 1, 2, 3, 4],
                          sampled=[1, 2, 3, 4, 5])
    assert calls == [] and sorted(w.prompt_calls) == [2, 4]
    assert got.output_counts[2].sum() == got.output_counts[4].sum() == 0

    # 9. The children now have batch rows (the scratch rows they used): never reused, rebuilt from
    # their histories. Another fan-out child in the same step.
    w.add(22, w.prompt[B])
    _, calls = run_step(state, w, [(0, A), (1, B), (2, C), (3, 20), (4, 21), (-1, 22)], [0, 1, 2, 3, 4, 5])
    assert sorted(calls) == [20, 21]

    # 10. Growth beyond the initial capacity: a sequence at row 40; the others are carried.
    w.add(30, [8, 9], [8])
    cap = len(state.owner)
    assert cap < 41
    _, calls = run_step(state, w, [(0, A), (1, B), (2, C), (3, 20), (4, 21), (40, 30)], [0, 1, 2, 3, 4, 5])
    assert calls == [30]
    assert state.counts.shape[0] >= 41 and state.seen.shape[0] >= 41
    _, calls = run_step(state, w, [(0, A), (1, B), (2, C), (3, 20), (4, 21), (40, 30)], [0, 1, 2, 3, 4, 5])
    assert calls == []

    # 11. Only some rows have penalties: the others are neither read nor touched; a row skipped
    # for a step (its statistics still in place, its count not advanced) is used as it is.
    _, calls = run_step(state, w, [(0, A), (1, X), (2, C), (3, 20), (4, 21), (40, 30)], [0, 2, 5])
    assert calls == []
    _, calls = run_step(state, w, [(0, A), (1, B), (2, C), (3, 20), (4, 21), (40, 30)], [0, 1, 2, 3, 4, 5])
    # B was not at row 1 last step (X was, without penalties), but row 1 still holds B's
    # statistics at B's count: used as they are. 20 and 21 missed a step: their counts moved on.
    assert sorted(calls) == [20, 21]


def test_record_ignores_out_of_range_tokens():
    state = PenaltyState(V, torch.device("cpu"))
    w = World()
    w.add(1, [V + 5, -1, 3])
    w.add(2, [])
    _, calls = run_step(state, w, [(0, 1), (1, 2)], [0, 1], sampled=[V, V + 100])
    got, calls = run_step(state, w, [(0, 1), (1, 2)], [0, 1], sampled=[-3, 4])
    assert calls == []  # carried, with nothing counted for the out-of-range tokens
    assert got.output_counts.sum() == 0
    got, calls = run_step(state, w, [(0, 1), (1, 2)], [0, 1])
    assert calls == [] and got.output_counts[1, 4] == 1 and got.output_counts.sum() == 1


def test_record_without_inputs_or_twice_does_nothing():
    state = PenaltyState(V, torch.device("cpu"))
    state.record(torch.tensor([1, 2]))  # nothing to record yet
    w = World()
    w.add(1, [2])
    out = w.step([(0, 1)])
    state.inputs(out, np.array([0]), w.prompt_of, w.history_of)
    state.record(torch.tensor([5]))
    state.record(torch.tensor([5]))  # the step's tokens are counted once
    w.output[1].append(5)
    w.history_calls.clear()
    got = state.inputs(w.step([(0, 1)]), np.array([0]), w.prompt_of, w.history_of)
    assert w.history_calls == []
    assert got.output_counts[0, 5] == 1 and got.output_counts.sum() == 1


@pytest.mark.parametrize("seed", range(6))
def test_random_steps_match_the_histories(seed):
    """Sequences join, leave, move rows, fan out and get cancelled steps at random; every step's
    statistics equal the histories', and a row that was at the same batch row last step with one
    more output since is never re-read. Rows move freely, also right after a cancelled step."""
    g = np.random.default_rng(seed)
    state = PenaltyState(V, torch.device("cpu"))
    w = World()
    next_seq = 0
    running: list[int] = []
    prev: dict[int, tuple[int, int]] = {}  # penalty seq -> (batch row, num_output) last step
    last_cancelled = False
    prev_layout: list[tuple[int, int]] = []
    checked = rebuilt = 0
    for _ in range(80):
        if not last_cancelled:  # scheduling: some leave, some join (not in a cancelled step's redo)
            running = [s for s in running if g.random() > 0.1]
            while len(running) < 3 or (len(running) < 12 and g.random() < 0.3):
                w.add(next_seq, g.integers(-3, V + 3, size=int(g.integers(0, 8))).tolist(),
                      g.integers(0, V + 3, size=int(g.integers(0, 4))).tolist())
                running.append(next_seq)
                next_seq += 1
        if g.random() < 0.3:
            slots = [int(b) for b in g.permutation(16)[: len(running)]]
        else:
            keep = {s: b for b, s in prev_layout if s in running}
            free = [b for b in range(16) if b not in keep.values()]
            slots = [keep[s] if s in keep else free.pop(0) for s in running]
        layout = [(int(b), s) for b, s in zip(slots, running)]
        prev_layout = list(layout)
        # Fan-out children (no batch row yet), which join the running set next step.
        children = []
        for _ in range(int(g.integers(1, 3)) if g.random() < 0.3 and len(running) < 12 else 0):
            w.add(next_seq, g.integers(0, V, size=3).tolist())
            children.append(next_seq)
            layout.append((-1, next_seq))
            next_seq += 1
        layout = [layout[i] for i in g.permutation(len(layout))]
        # A sequence's penalty (its request's parameters) never changes; most have one.
        pen = [r for r, (_, s) in enumerate(layout) if s % 5]
        nout = {s: len(w.output[s]) for _, s in layout}
        sampled = g.integers(0, V + 2, size=len(layout)).tolist()
        cancel = g.random() < 0.15
        if pen:
            _, calls = run_step(state, w, layout, pen, sampled=sampled, cancel=cancel)
            rebuilt += len(calls)
            for r in pen:
                b, s = layout[r]
                if not last_cancelled and prev.get(s) == (b, nout[s] - 1):  # up to date
                    assert s not in calls, (s, layout, prev[s])
                    checked += 1
        elif not cancel:
            for (_, s), t in zip(layout, sampled):
                w.output[s].append(t)
        prev = {s: (b, nout[s]) for b, s in (layout[r] for r in pen) if b >= 0}
        last_cancelled = cancel
        if not cancel:  # a cancelled step's children never came to be
            running += children
    assert checked > 100 and rebuilt > 10, (checked, rebuilt)  # both kinds of rows were seen


def test_rows_that_swap_take_each_others_statistics_without_a_rebuild():
    state = PenaltyState(V, torch.device("cpu"))
    w = World()
    w.add(1, [2], [4, 4])
    w.add(2, [3], [5])
    run_step(state, w, [(0, 1), (1, 2)], [0, 1], sampled=[6, 7])
    _, calls = run_step(state, w, [(1, 1), (0, 2)], [0, 1], sampled=[8, 9])  # swapped
    assert calls == []
    _, calls = run_step(state, w, [(0, 1), (1, 2)], [0, 1])  # and back
    assert calls == []


def test_cancelled_step_then_a_move_and_back():
    """The tokens a cancelled step counted into a row stay there when the sequence moves to
    another row; when it comes back with the same count, they must not be used."""
    state = PenaltyState(V, torch.device("cpu"))
    w = World()
    w.add(1, [2])
    w.add(2, [3])
    run_step(state, w, [(0, 1), (1, 2)], [0, 1], sampled=[5, 6])
    run_step(state, w, [(0, 1), (1, 2)], [0, 1], sampled=[7, 8], cancel=True)  # row 0: (1, 2 tokens)
    run_step(state, w, [(2, 1), (1, 2)], [0, 1], sampled=[9, 9])  # 1 moves to row 2, gets 9
    run_step(state, w, [(0, 1), (1, 2)], [0, 1])  # 1 back at row 0: counts 7, not 9


def test_penalty_state_feeds_the_sampler():
    """End to end over steps: from_arrays with the state's inputs samples what build (with the
    histories) samples, greedy rows with penalties in a batch with rows without."""
    R = 6
    g = np.random.default_rng(0)
    params = [SP(temperature=0.0, repetition_penalty=1.8), SP(temperature=0.0),
              SP(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.7), SP(temperature=0.0),
              SP(temperature=0.0, frequency_penalty=2.0), SP(temperature=0.0, repetition_penalty=1.3)]
    w = World()
    for s in range(R):
        w.add(s, g.integers(0, V, size=5).tolist())
    state = PenaltyState(V, torch.device("cpu"))
    for step in range(25):
        layout = [(s, s) for s in range(R)]
        if step == 10:  # rows 1..4 swap places
            layout = [(0, 0), (2, 1), (1, 2), (4, 3), (3, 4), (5, 5)]
        x = torch.randn(R, V, generator=torch.Generator().manual_seed(step)) * 0.5
        rows = [SamplingRow(params[s], w.output[s], w.prompt[s]) for _, s in layout]
        want = sample(x, SamplingMetadata.build(rows, V)).token_ids
        arrays = SamplingArrays.of_rows(rows)
        out = w.step(layout)
        for name in SamplingArrays.__slots__:
            setattr(out, name, getattr(arrays, name))
        pens = state.inputs(out, penalty_rows(out), w.prompt_of, w.history_of)
        got = sample(x, SamplingMetadata.from_arrays(out, V, "cpu", pens)).token_ids
        assert np.array_equal(got, want), step
        state.record(torch.from_numpy(got.astype(np.int64)))
        for (_, s), t in zip(layout, got.tolist()):
            w.output[s].append(t)
    assert Counter(len(o) for o in w.output.values()) == {25: R}


def test_step_sampler_counts_the_tokens_result_returns_after_top_p_samples_rows_again():
    """Flat rows with top-p are sampled again in ``result()`` (their nucleus is wider than the
    candidates): the penalty statistics count the tokens returned, not the ones they replaced."""
    from ferrokv.sampler import _TOP_P_CANDIDATES
    from ferrokv.step_sampling import StepSampler
    Vw, R = 1500, 3
    ss = StepSampler(Vw, torch.device("cpu"), seed=0)
    params = SP(top_p=0.9, frequency_penalty=0.05, presence_penalty=0.05)
    w = World()
    for s in range(R):
        w.add(s, [s])
    layout = [(s, s) for s in range(R)]
    beyond = 0
    for step in range(12):
        x = torch.randn(R, Vw, generator=torch.Generator().manual_seed(step)) * 0.1
        rows = [SamplingRow(params, w.output[s], w.prompt[s]) for s in range(R)]
        out = w.step(layout)
        for name in SamplingArrays.__slots__:
            setattr(out, name, getattr(SamplingArrays.of_rows(rows), name))
        out.any_logit_bias = False
        md = ss.metadata(out, w.prompt_of, w.history_of)
        want = torch.stack([torch.bincount(torch.tensor(w.output[s], dtype=torch.int64), minlength=Vw).float()
                            for s in range(R)])
        assert torch.equal(md.output_counts, want), step
        got = ss.sample(x, md).result().token_ids
        for s, t in enumerate(got.tolist()):
            beyond += t not in set(x[s].topk(_TOP_P_CANDIDATES).indices.tolist())
            w.output[s].append(t)
    assert beyond > 0  # some rows were sampled again past their candidates


class _InterruptingSeen:
    """A seen mask whose write raises KeyboardInterrupt, as a Ctrl-C landing inside ``record``
    after the counts were added."""

    def __init__(self, seen: torch.Tensor) -> None:
        self.seen = seen

    def __getitem__(self, key):
        return self.seen[key]

    def __setitem__(self, key, value):
        raise KeyboardInterrupt


def test_an_interrupt_inside_record_leaves_the_rows_to_rebuild():
    """A step whose ``record`` was interrupted is cancelled: its half-counted rows must not pass
    for up to date (the next step would penalise a token never generated)."""
    state = PenaltyState(V, torch.device("cpu"))
    w = World()
    w.add(1, [3, 4])
    w.add(2, [5])
    run_step(state, w, [(0, 1), (1, 2)], [0, 1], sampled=[7, 8])
    out = w.step([(0, 1), (1, 2)])
    state.inputs(out, np.array([0, 1]), w.prompt_of, w.history_of)
    state.seen = _InterruptingSeen(state.seen)
    with pytest.raises(KeyboardInterrupt):
        state.record(torch.tensor([9, 10]))  # the counts of 9 and 10 are in, the step is cancelled
    state.seen = state.seen.seen
    _, calls = run_step(state, w, [(0, 1), (1, 2)], [0, 1])  # checks the statistics against the histories
    assert sorted(calls) == [1, 2]  # rebuilt
