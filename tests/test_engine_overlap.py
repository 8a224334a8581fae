"""The engine with overlap on (a step's text and outputs made during the next step's forward
pass, ``EngineArgs.overlap``) against overlap off: the same outputs under every setting (greedy
with EOS, stop strings and logprobs; seeded sampling with n > 1; penalties; streaming kinds; beam
search), stop strings found one step late, aborts and interrupts in the middle of an overlapped
step, and penalty statistics carried across steps while rows move. On the CPU, overlap runs the
forward pass on the step worker's thread, so these tests exercise the real hand-off.
Tiny llama, CPU, fp32.
"""
from __future__ import annotations

import gc
import threading

import pytest

from ferrokv import SamplingParams
from ferrokv.outputs import RequestOutputKind
from helpers.engine_faults import RunnerHook, assert_idle, drive, greedy, rand_prompts, raise_on, tiny_engine

LENGTHS = [5, 23, 11, 40, 3, 17]


class _Close(float):
    """A logprob compared to within float32 rounding: overlap may leave a row that a stop string
    ended a step late in the next step's batch, and the model's matmuls are not batch-invariant
    to the last bit (the tokens, texts and reasons are compared exactly)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, float) and abs(self - other) <= 1e-4 * max(1.0, abs(other))

    __hash__ = float.__hash__


def _record(o):
    return (o.request_id, o.finished, [(c.index, list(c.token_ids), c.text, c.finish_reason, c.stop_reason,
                                        None if c.logprobs is None else [sorted((k, _Close(v.logprob))
                                                                                for k, v in e.items())
                                                                         for e in c.logprobs],
                                        None if c.cumulative_logprob is None else _Close(c.cumulative_logprob))
                                       for c in o.outputs])


def run_all(path, requests, overlap, beams=(), **kw):
    """Every output of every request, in order, per request id; the engine left idle."""
    engine = tiny_engine(path, overlap=overlap, **kw)
    assert engine.overlap is overlap
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    for rid, prompt, width in beams:
        engine.add_beam_request(rid, prompt, beam_width=width, max_tokens=8)
    seen: dict[str, list] = {}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        assert steps < 3000
        for o in engine.step():
            seen.setdefault(o.request_id, []).append(_record(o))
    assert_idle(engine)
    assert engine.scheduler.text_state() == (0, 0)
    return seen


SETTINGS = {
    "greedy-eos-stop-logprobs": [
        SamplingParams(temperature=0.0, max_tokens=12, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=20, stop=["a", "e "], include_stop_str_in_output=True),
        SamplingParams(temperature=0.0, max_tokens=9, min_tokens=4, stop=["o"]),
    ],
    "seeded-n3": [
        SamplingParams(n=3, temperature=1.0, top_p=0.9, seed=11, max_tokens=10),
        SamplingParams(n=2, temperature=0.7, top_k=20, min_p=0.05, seed=5, max_tokens=14, stop=["e"]),
        # A sample that a stop string ends a step late has a row in flight whose logprob is not its.
        SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=16, stop=["e", "a"], logprobs=0),
    ],
    "penalties": [
        SamplingParams(temperature=0.0, max_tokens=16, presence_penalty=0.8, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=24, frequency_penalty=1.1, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
    ],
    "streaming": [
        SamplingParams(temperature=0.0, max_tokens=12, output_kind=RequestOutputKind.DELTA, stop=["e"]),
        SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=10, output_kind=RequestOutputKind.CUMULATIVE),
        SamplingParams(temperature=0.0, max_tokens=7, output_kind=RequestOutputKind.DELTA, logprobs=1),
    ],
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_outputs_identical_with_overlap_on_and_off(llama_path, setting):
    prompts = rand_prompts(len(setting), LENGTHS)
    kinds = SETTINGS[setting]
    requests = [(str(i), p, kinds[i % len(kinds)]) for i, p in enumerate(prompts)]
    beams = [("beam", rand_prompts(99, [9])[0], 3)] if setting == "greedy-eos-stop-logprobs" else ()
    off = run_all(llama_path, requests, False, beams)
    on = run_all(llama_path, requests, True, beams)
    assert on == off
    assert set(on) == {r[0] for r in requests} | {b[0] for b in beams}


def test_overlap_under_preemption_and_small_budget(llama_path):
    """Swap and recompute preemption, chunked prefill: overlap changes nothing."""
    prompts = rand_prompts(7, [30, 45, 20, 38, 12, 26])
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=14, ignore_eos=True, presence_penalty=0.5)
    requests = [(str(i), p, params) for i, p in enumerate(prompts)]
    for kw in (dict(block_size=8, num_kv_blocks=17, preemption_mode="swap", num_cpu_blocks=64),
               dict(block_size=4, num_kv_blocks=40, max_num_batched_tokens=16)):
        assert run_all(llama_path, requests, True, **kw) == run_all(llama_path, requests, False, **kw)


def test_penalty_statistics_follow_rows_that_move(llama_path):
    """A penalised request's tokens do not depend on its batch: alone, and among requests that
    finish at different steps (their rows leave, the last row moves into theirs) or join late."""
    target = rand_prompts(3, [21])[0]
    params = SamplingParams(temperature=0.0, max_tokens=30, frequency_penalty=0.9, presence_penalty=0.4,
                            repetition_penalty=1.2, ignore_eos=True)
    alone = run_all(llama_path, [("t", target, params)], True)["t"][-1]
    crowd = [(f"c{i}", p, SamplingParams(temperature=0.0, max_tokens=2 + 3 * i, ignore_eos=True,
                                         presence_penalty=0.3 * (i % 2)))
             for i, p in enumerate(rand_prompts(4, [7, 13, 5, 19, 9, 11]))]
    mixed = run_all(llama_path, crowd[:3] + [("t", target, params)] + crowd[3:], True)["t"][-1]
    assert mixed == alone


def test_a_stop_string_found_one_step_late_drops_the_in_flight_token(llama_path):
    """With overlap, a sequence that reached a stop string is already in the next step: its
    text, tokens and reason equal the run without overlap, and nothing leaks (run_all checks)."""
    prompts = rand_prompts(12, [8, 15, 6])
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=40, stop=["e", "t"], ignore_eos=True)
    requests = [(str(i), p, params) for i, p in enumerate(prompts)]
    on = run_all(llama_path, requests, True)
    assert on == run_all(llama_path, requests, False)
    reasons = [rec[2][0][3] for outs in on.values() for rec in outs[-1:]]
    assert "stop" in reasons


@pytest.mark.parametrize("error", [RuntimeError("runner failed"), KeyboardInterrupt()], ids=["exception", "interrupt"])
@pytest.mark.parametrize("call", [1, 4], ids=["prefill", "decode"])
def test_a_failed_overlapped_step_is_cancelled_and_loses_nothing(llama_path, error, call):
    """A forward pass that raises on the step worker's thread: the step is cancelled, the
    previous step's outputs (made during it) come with the next step, and the run equals a clean
    one."""
    prompts = rand_prompts(0, LENGTHS[:4])
    requests = [(str(i), p, greedy(10)) for i, p in enumerate(prompts)]
    clean = {rid: outs[-1] for rid, outs in run_all(llama_path, requests, True).items()}
    engine = tiny_engine(llama_path, overlap=True)
    for rid, p, params in requests:
        engine.add_request(rid, p, params)
    hook = RunnerHook(engine, raise_on(call, error))
    last = drive(engine, fails=type(error))
    assert hook.calls > call
    assert {rid: _record(o) for rid, o in last.items()} == clean
    assert engine.stats()["cancelled_steps"] == 1
    assert_idle(engine)


def test_an_interrupt_while_outputs_are_made_aborts_that_steps_requests_only(llama_path):
    """An exception while the previous step's outputs are made (the overlap window): this step
    is cancelled, the previous step's requests are aborted (their Python state is half-applied),
    a request added afterwards runs clean, and nothing leaks."""
    engine = tiny_engine(llama_path, overlap=True)
    for i, p in enumerate(rand_prompts(1, LENGTHS[:3])):
        engine.add_request(str(i), p, greedy(10))
    finish, calls = engine._finish_step, []

    def failing(p):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return finish(p)

    engine._finish_step = failing
    with pytest.raises(KeyboardInterrupt):
        for _ in range(10):
            engine.step()
    assert engine.stats()["requests_aborted"] == 3
    late = rand_prompts(2, [9])[0]
    engine.add_request("late", late, greedy(6))
    last = drive(engine)
    assert last["late"].outputs[0].token_ids == run_all(llama_path, [("late", late, greedy(6))], True)["late"][-1][2][0][1]
    assert_idle(engine)


def test_abort_from_another_thread_mid_overlap(llama_path):
    """Aborts queued from another thread while an overlapped step is in flight (the forward pass
    waiting on the other thread): applied when the step ends, the other requests equal a clean
    run, no block leaks."""
    prompts = rand_prompts(3, LENGTHS[:4])
    requests = [(str(i), p, greedy(12)) for i, p in enumerate(prompts)]
    clean = run_all(llama_path, requests, True)
    engine = tiny_engine(llama_path, overlap=True)
    for rid, p, params in requests:
        engine.add_request(rid, p, params)
    in_forward, go = threading.Event(), threading.Event()

    def pause(n, inputs):
        if n == 5:
            in_forward.set()
            assert go.wait(10)

    RunnerHook(engine, pause)
    aborted = []
    engine.on_abort = aborted.append

    def aborter():
        assert in_forward.wait(10)
        engine.abort_request(["1", "3"])
        go.set()

    t = threading.Thread(target=aborter)
    t.start()
    last = drive(engine)
    t.join()
    # Each ends with its final output (the pending step's outputs of it, if any, come before).
    assert sorted(o.request_id for o in aborted if o.finished) == ["1", "3"]
    assert all(c.finish_reason == "abort" for o in aborted if o.finished for c in o.outputs)
    for rid in ("1", "3"):
        assert [o.finished for o in aborted if o.request_id == rid][-1]
    for rid in ("0", "2"):
        assert _record(last[rid]) == clean[rid][-1]
    assert_idle(engine)


@pytest.mark.parametrize("overlap", [False, True])
def test_an_aborted_request_reports_nothing_more_from_step(llama_path, overlap):
    """As in vLLM: after abort_request, step() returns no output of the request (with overlap, the
    pending step's output of it was made already; it is dropped, not returned a step late), so
    a reused id never gets the old request's output."""
    engine = tiny_engine(llama_path, overlap=overlap)
    engine.add_request("a", rand_prompts(4, [6])[0], greedy(30))
    engine.add_request("b", rand_prompts(5, [5])[0], greedy(30))
    for _ in range(4):
        engine.step()
    engine.abort_request("a")
    engine.add_request("a", rand_prompts(6, [3])[0], greedy(2))  # the id, reused at once
    outs = [o for _ in range(3) for o in engine.step()]
    firsts = [o for o in outs if o.request_id == "a"]
    assert all(len(o.prompt_token_ids) == 3 for o in firsts), [len(o.prompt_token_ids) for o in firsts]
    while engine.has_unfinished_requests():
        engine.step()
    assert_idle(engine)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_aborted_once_finished_still_reports_its_end(llama_path, overlap):
    """A caller that waits for each request's end (``on_abort`` set: AsyncLLM's loop) gets it
    exactly once for a request it aborts after it finished (with overlap, in the pending step,
    whose outputs were not made yet): the request's own final output, as its report."""
    engine = tiny_engine(llama_path, overlap=overlap)
    reports: list = []
    engine.on_abort = reports.append
    engine.add_request("a", rand_prompts(7, [4])[0], greedy(1))
    outs = engine.step()
    engine.abort_request("a")
    while engine.has_unfinished_requests():
        outs += engine.step()
    ends = [(o.request_id, o.finished, o.outputs[0].finish_reason, len(o.outputs[0].token_ids))
            for o in outs + reports if o.finished]
    assert ends == [("a", True, "length", 1)] and engine.stats()["requests_aborted"] == 0
    assert_idle(engine)


def test_overlap_defaults(llama_path):
    """Off on a CPU unless asked for; a bad value names the field."""
    assert tiny_engine(llama_path).overlap is False
    with pytest.raises(ValueError, match="overlap"):
        tiny_engine(llama_path, overlap="yes")


def test_no_step_thread_outlives_its_engine(llama_path):
    """Overlap on a CPU runs the forward pass on a thread of the engine's: a shut-down LLM ends
    it, and so does a dropped engine."""
    from helpers.engine_faults import tiny_llm

    def step_threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == "ferrokv-step"}

    before = step_threads()
    llm = tiny_llm(llama_path, overlap=True)
    assert llm.generate(rand_prompts(41, [5, 9]), greedy(4), use_tqdm=False)[1].finished
    started = step_threads() - before
    assert len(started) == 1
    llm.engine_loop.shutdown()
    for t in started:
        t.join(10)
        assert not t.is_alive()
    engine = tiny_engine(llama_path, overlap=True)
    engine.add_request("a", rand_prompts(42, [6])[0], greedy(3))
    assert drive(engine)["a"].finished
    started = step_threads() - before
    assert len(started) == 1
    del engine
    gc.collect()
    for t in started:
        t.join(10)
        assert not t.is_alive()


def _every_output(engine, fails: type[BaseException], reporter: bool = False) -> tuple[dict[str, list], int]:
    """Steps until idle: (per request, (finished, tokens, finish reason) of each output in order,
    those ``on_abort`` reports too with ``reporter``; how many steps raised ``fails``)."""
    seen: dict[str, list] = {}
    raised = 0

    def record(o):
        c = o.outputs[0] if o.outputs else None
        seen.setdefault(o.request_id, []).append((o.finished, len(c.token_ids) if c else 0,
                                                  c.finish_reason if c else None))

    if reporter:
        engine.on_abort = record
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        try:
            outs = engine.step()
        except fails:
            raised += 1
            continue
        for o in outs:
            record(o)
    assert_idle(engine)
    return seen, raised


def _ends_last_and_once(seen: dict[str, list]) -> None:
    for rid, outs in seen.items():
        assert [f for f, _, _ in outs].count(True) == 1 and outs[-1][0], (rid, outs)
        counts = [n for _, n, _ in outs]
        assert counts == sorted(counts), (rid, outs)  # cumulative: nothing reported out of order
        progress = [n for f, n, _ in outs if not f]
        assert progress == sorted(set(progress)), (rid, outs)  # nor twice


@pytest.mark.parametrize("overlap", [False, True])
def test_a_failure_after_update_reports_the_made_outputs_before_the_aborts(llama_path, overlap, monkeypatch):
    """A step that fails once its update() ran aborts its requests; the previous step's outputs,
    made during its forward pass (overlap), still come before those aborts' final outputs."""
    from ferrokv.structured_outputs import GrammarStep, StructuredOutputsParams
    accept, calls = GrammarStep.accept, []

    def failing(self, *args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("accept failed")
        return accept(self, *args)

    monkeypatch.setattr(GrammarStep, "accept", failing)
    engine = tiny_engine(llama_path, overlap=overlap)
    engine.add_request("a", rand_prompts(8, [4])[0], greedy(8))
    engine.add_request("b", rand_prompts(9, [3])[0], greedy(8, structured_outputs=StructuredOutputsParams(
        regex="[a-z]{5,20}")))
    seen, raised = _every_output(engine, RuntimeError)
    assert raised == 1 and all(outs[-1][2] == "abort" for outs in seen.values())
    _ends_last_and_once(seen)
    assert [n for _, n, _ in seen["a"]][:2] == [1, 2]  # step 2's outputs were not lost


@pytest.mark.parametrize("reporter", [False, True])
def test_an_abort_applied_as_a_step_ends_keeps_the_steps_outputs_when_it_fails(llama_path, reporter):
    """An abort queued from another thread during a step is applied as the step ends, making the
    pending step's text first; an interrupt there raises from step() but loses none of the outputs
    it was returning (another request's final output among them): the next step() returns them,
    and with a reporter (on_abort) the aborted request's come before its final output."""
    engine = tiny_engine(llama_path, overlap=True)
    engine.add_request("a", rand_prompts(10, [4])[0], greedy(2))
    engine.add_request("b", rand_prompts(11, [3])[0], greedy(10))
    armed = []

    def abort_b(n, inputs):
        if n == 3:  # step 2's outputs (a's final one) are made meanwhile
            t = threading.Thread(target=engine.abort_request, args=("b",))
            t.start()
            t.join()
            armed.append(1)

    RunnerHook(engine, abort_b)
    step_results = engine.text.step_results

    def interrupted(*args):
        if armed and engine._pending is None and threading.current_thread() is threading.main_thread():
            armed.clear()  # the abort making the pending step's text, at the step's end
            raise KeyboardInterrupt
        return step_results(*args)

    engine.text.step_results = interrupted
    seen, raised = _every_output(engine, KeyboardInterrupt, reporter)
    assert raised == 1 and seen["a"][-1] == (True, 2, "length")
    _ends_last_and_once(seen if reporter else {"a": seen["a"]})
    if reporter:
        assert seen["b"][-1][2] == "abort" and len(seen["b"]) > 1, seen


def test_a_request_aborted_during_a_forward_pass_reports_its_end_after_the_step_returns_its_last_outputs(
        llama_path):
    """An abort queued during step N's forward pass (overlap: step N-1's outputs are being made,
    the request's among them): with a reporter, that output goes to ``on_abort`` before the final
    one, not out of ``step()`` after it (review22: step() returned it once on_abort had the end)."""
    engine = tiny_engine(llama_path, overlap=True)
    engine.add_request("r", rand_prompts(14, [3])[0], greedy(20))
    engine.add_request("s", rand_prompts(15, [4])[0], greedy(6))
    RunnerHook(engine, lambda n, inputs: n == 4 and engine.abort_request("r"))  # from the step thread
    seen, _ = _every_output(engine, (), reporter=True)
    _ends_last_and_once(seen)
    assert seen["r"][-1][2] == "abort" and seen["s"][-1] == (True, 6, "length")


@pytest.mark.parametrize("late", ["before_the_tail_applies_them", "at_release"])
def test_an_abort_that_lands_as_a_step_ends_reports_after_the_steps_outputs_of_it(llama_path, monkeypatch, late):
    """An abort that another thread queues as step() ends (after it began applying the aborts
    queued during its forward pass, or as it releases the lock): with a reporter, the request's
    outputs this step() was returning go to on_abort before its final output, not out of step()
    after it (review23)."""
    import ferrokv.held_outputs as held_module

    engine = tiny_engine(llama_path, overlap=True)
    engine.add_request("r", rand_prompts(16, [3])[0], greedy(20))
    engine.add_request("q", rand_prompts(17, [3])[0], greedy(20))
    steps = {"n": 0}
    if late == "at_release":
        release = engine._guard._before_release

        def before_release():
            if steps["n"] == 3 and engine._held.returning is not None and not engine._guard.abort_inbox:
                engine._guard.abort_inbox.append("r")  # as another thread would, the step's outputs made
            release()

        engine._guard._before_release = before_release
    else:
        split = held_module.split_outputs

        def split_then_abort(outputs, ids):
            if steps["n"] == 3 and "r" not in engine._guard.abort_inbox:
                engine._guard.abort_inbox.append("r")  # lands while the tail applies q's abort
            return split(outputs, ids)

        monkeypatch.setattr(held_module, "split_outputs", split_then_abort)
    seen: dict[str, list] = {}
    engine.on_abort = lambda o: seen.setdefault(o.request_id, []).append((o.finished, len(o.outputs[0].token_ids)))
    while engine.has_unfinished_requests():
        steps["n"] += 1
        if steps["n"] == 3:
            engine._guard.abort_inbox.append("q")  # queued during the step, so its tail applies aborts
        for o in engine.step():
            seen.setdefault(o.request_id, []).append((o.finished, len(o.outputs[0].token_ids)))
    for rid in ("r", "q"):
        assert [f for f, _ in seen[rid]].count(True) == 1 and seen[rid][-1][0], (rid, seen[rid])
    assert_idle(engine)


def test_a_deliver_that_raises_gets_its_outputs_again(llama_path):
    """``LLMEngine.deliver`` raising once: the step is cancelled, and the outputs it was handed come
    from the next step() (a request that finished among them included)."""
    engine = tiny_engine(llama_path, overlap=True)
    engine.add_request("a", rand_prompts(12, [4])[0], greedy(1))
    engine.add_request("b", rand_prompts(13, [3])[0], greedy(5))
    delivered: list = []

    def deliver(outs):
        if not delivered:
            delivered.append(None)
            raise RuntimeError("sink broke")
        delivered.extend(outs)

    engine.deliver = deliver
    seen, raised = _every_output(engine, RuntimeError)
    for o in delivered[1:]:
        seen.setdefault(o.request_id, []).append((o.finished, len(o.outputs[0].token_ids),
                                                  o.outputs[0].finish_reason))
    assert raised == 1 and seen["a"] == [(True, 1, "length")]
    assert sorted(n for _, n, _ in seen["b"]) == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_failure_building_a_beam_output_loses_no_other_requests_end(llama_path, overlap, monkeypatch):
    """A finished beam search's output failing to build: the requests that finished in the same
    step are not yet released, so they are aborted and reported, never silently dropped."""
    import ferrokv.engine as engine_module
    build, calls = engine_module.beam_output, []

    def failing(*args):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("beam output failed")
        return build(*args)

    monkeypatch.setattr(engine_module, "beam_output", failing)
    engine = tiny_engine(llama_path, overlap=overlap)
    engine.add_request("r", rand_prompts(14, [5])[0], greedy(3))
    engine.add_beam_request("beam", rand_prompts(15, [4])[0], beam_width=2, max_tokens=3, ignore_eos=True)
    seen, raised = _every_output(engine, RuntimeError)
    assert raised == 1 and calls
    assert [f for f, _, _ in seen["r"]].count(True) == 1 and seen["r"][-1][0], seen
    assert seen["beam"] == [(True, 0, None)], seen  # the search ended: reported as aborted (no hypotheses)
