"""Fault tests: a step that fails or is interrupted mid-step (an exception or a KeyboardInterrupt
in the runner, the sampler or a beam step; a real SIGINT to a process in ``generate``), and the KV
cache exhausted at each edge.

What must hold after every fault: the failed step is cancelled, not closed with made-up tokens,
so a caller that keeps stepping gets exactly a clean run's output (greedy; seeded sampling too,
since these faults hit before the sampler draws); an interrupted ``generate`` ends its requests;
no block leaks; the next ``generate`` equals a clean run. Faults are placed with
``helpers.engine_faults.RunnerHook`` (the k-th forward pass, or the first one with a given block
op), never with timing. Tiny llama, CPU, fp32.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import ferrokv
from ferrokv import SamplingParams
from helpers.engine_faults import (RunnerHook, assert_idle, drive, engine_kwargs, greedy, raise_on,
                                   rand_prompts, tiny_engine, tiny_llm, token_ids)

LENGTHS = [5, 23, 11, 40]
MAX_NEW = 10


@pytest.fixture(scope="module")
def clean(llama_path):
    """``clean(prompts, params, **engine_kwargs)``: token ids of a fault-free run in a fresh LLM."""
    memo: dict[str, list] = {}

    def run(prompts, params, **kw):
        key = repr((prompts, params, sorted(kw.items())))
        if key not in memo:
            memo[key] = token_ids(tiny_llm(llama_path, **kw).generate(prompts, params, use_tqdm=False))
        return memo[key]

    return run


def outputs_of(last: dict, n: int) -> list:
    return token_ids([last[str(i)] for i in range(n)])


# ------------------------------------------------------------------------------------------------
# 1. A step that raises is cancelled; a caller that keeps stepping loses nothing (LLMEngine)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("error", [RuntimeError("runner failed"), KeyboardInterrupt()], ids=["exception", "interrupt"])
@pytest.mark.parametrize("call", [1, 3], ids=["prefill", "decode"])
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_a_failed_step_is_cancelled_and_its_requests_go_on(llama_path, clean, error, call, overlap):
    engine = tiny_engine(llama_path, overlap=overlap)
    prompts = rand_prompts(0, LENGTHS)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy(MAX_NEW))
    hook = RunnerHook(engine, raise_on(call, error))
    last = drive(engine, fails=type(error))
    assert hook.calls > call
    assert outputs_of(last, len(prompts)) == clean(prompts, greedy(MAX_NEW))
    assert engine.stats()["cancelled_steps"] == 1
    assert_idle(engine)


SWAP_N2 = dict(block_size=8, num_kv_blocks=17, preemption_mode="swap", num_cpu_blocks=64)


@pytest.mark.parametrize("op", ["copy_ops", "swap_out", "swap_in"])
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_a_failed_step_whose_block_ops_may_not_have_run(llama_path, clean, op, overlap):
    """The step fails before its copy-on-write copies or swaps are known to have run: the requests
    they touched are recomputed, and every sample still equals the clean run's."""
    prompts = rand_prompts(4, [10, 30, 45, 20, 7, 26])
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=14, ignore_eos=True)
    engine = tiny_engine(llama_path, overlap=overlap, **SWAP_N2)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    fired = []

    def fail_on_first_op(n, out):
        if not fired and getattr(out, op).size:
            fired.append(n)
            raise RuntimeError(f"failed with {op} pending")

    RunnerHook(engine, fail_on_first_op)
    last = drive(engine, fails=RuntimeError)
    assert fired, f"no step had {op}: the configuration no longer exercises it"
    assert outputs_of(last, len(prompts)) == clean(prompts, params, **SWAP_N2)
    assert_idle(engine)


class _FailingSampler:
    """The engine's sampler, failing on its first call."""

    def __init__(self, sampler):
        self.sampler, self.calls = sampler, 0

    def sample_async(self, logits, metadata):
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("sampler failed")
        return self.sampler.sample_async(logits, metadata)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_a_failure_in_the_sampler_undoes_the_step(llama_path, clean, overlap):
    """The prefill step of an n=3 request fails in the sampler, where its samples fan out: the
    step is cancelled, and the samples are those of a clean run."""
    engine = tiny_engine(llama_path, overlap=overlap)
    prompt = rand_prompts(5, [13])
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    engine.add_request("0", prompt[0], params)
    engine.step_sampler.sampler = _FailingSampler(engine.step_sampler.sampler)
    last = drive(engine, fails=RuntimeError)
    assert outputs_of(last, 1) == clean(prompt, params)
    assert_idle(engine)


def test_a_failure_after_a_beam_step_aborts_that_beam_search(llama_path, clean, monkeypatch):
    """A beam search moves in Python during the step (forks, drops): it cannot be put back, so a
    failure after it aborts that search; the other request goes on unharmed."""
    import ferrokv.beam_engine

    engine = tiny_engine(llama_path)
    beam_prompt, prompt = rand_prompts(6, [9, 17])
    engine.add_beam_request("beam", beam_prompt, beam_width=3, max_tokens=8)
    engine.add_request("0", prompt, greedy(8))
    beam_step, calls = ferrokv.beam_engine.advance, []

    def failing_beam_step(*args):
        done = beam_step(*args)
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("failed after a beam step")
        return done

    monkeypatch.setattr(ferrokv.beam_engine, "advance", failing_beam_step)
    last = drive(engine, fails=RuntimeError)
    # Aborted: its final output says so (an abort the caller did not ask for is reported).
    assert last["beam"].finished and last["beam"].outputs == []
    assert outputs_of(last, 1) == clean([prompt], greedy(8))
    assert engine.stats()["requests_aborted"] == 1
    assert_idle(engine)


def test_a_beam_search_done_in_a_step_that_then_fails_keeps_its_output(llama_path, monkeypatch):
    """Two searches in one step: the first ends, then the second's step fails. The first was ended
    in the scheduler already: its output stands (the failure aborts only the one that moved)."""
    import ferrokv.beam_engine

    engine = tiny_engine(llama_path)
    short_prompt, long_prompt = rand_prompts(6, [9, 17])
    engine.add_beam_request("short", short_prompt, beam_width=2, max_tokens=3)
    engine.add_beam_request("long", long_prompt, beam_width=2, max_tokens=8)
    beam_step, state = ferrokv.beam_engine.advance, {}

    def failing_after_short(scheduler, req, *args):
        done = beam_step(scheduler, req, *args)
        if req.request_id == "short" and done:
            state["short_done"] = True
        elif req.request_id == "long" and state.get("short_done") and not state.get("raised"):
            state["raised"] = True
            raise RuntimeError("failed after the other search finished")
        return done

    monkeypatch.setattr(ferrokv.beam_engine, "advance", failing_after_short)
    last = drive(engine, fails=RuntimeError)
    assert state == {"short_done": True, "raised": True}
    short = last["short"]
    assert short.finished and len(short.outputs) == 2 and all(len(c.token_ids) == 3 for c in short.outputs)
    assert last["long"].finished and last["long"].outputs == []  # aborted
    assert_idle(engine)


class _InterruptAfter:
    """Delegates to ``target``; the ``call``-th call of ``method`` runs, then raises
    KeyboardInterrupt, as a SIGINT landing right after it returns (before its caller holds the
    result) would."""

    def __init__(self, target, method: str, call: int) -> None:
        self._target, self._method, self._call, self.calls = target, method, call, 0

    def __getattr__(self, name):
        attr = getattr(self._target, name)
        if name != self._method:
            return attr

        def wrapped(*args, **kwargs):
            result = attr(*args, **kwargs)
            self.calls += 1
            if self.calls == self._call:
                raise KeyboardInterrupt
            return result

        return wrapped


@pytest.mark.parametrize("call", [1, 3], ids=["prefill", "decode"])
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_an_interrupt_as_schedule_returns_cancels_the_step_it_planned(llama_path, clean, call, overlap):
    """``schedule()`` releases the GIL while it plans, so a Ctrl-C most often lands as it returns:
    the step it planned is cancelled all the same (the engine is not left with a step in flight,
    refusing every later ``step()``), and a caller that keeps stepping gets a clean run's output."""
    engine = tiny_engine(llama_path, overlap=overlap)
    prompts = rand_prompts(3, LENGTHS)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy(MAX_NEW))
    engine.scheduler = _InterruptAfter(engine.scheduler, "schedule", call)
    last = drive(engine, fails=KeyboardInterrupt)
    assert outputs_of(last, len(prompts)) == clean(prompts, greedy(MAX_NEW))
    assert engine.stats()["cancelled_steps"] == 1
    engine.scheduler = engine.scheduler._target
    assert_idle(engine)


@pytest.mark.parametrize("method", ["add_request", "stats", "abort_request"])
def test_an_interrupt_as_the_engine_lock_is_taken_leaves_it_free(llama_path, clean, method):
    """A Ctrl-C landing right after the engine lock is taken (in an engine call, a getter or an
    abort) cannot leave the lock held: another thread's call that needs it still returns, and
    the engine serves on."""
    import threading

    engine = tiny_engine(llama_path)
    prompts = rand_prompts(4, LENGTHS)
    engine.add_request("0", prompts[0], greedy(MAX_NEW))
    engine._guard._lock = _InterruptAfter(engine._guard._lock, "acquire", 1)
    with pytest.raises(KeyboardInterrupt):
        {"add_request": lambda: engine.add_request("1", prompts[1], greedy(MAX_NEW)),
         "stats": engine.stats, "abort_request": lambda: engine.abort_request("x", wait=True)}[method]()
    other = threading.Thread(target=engine.abort_request, args=("nobody",), kwargs={"wait": True})
    other.start()
    other.join(timeout=60)
    assert not other.is_alive(), "the engine lock was left held"
    for i, p in enumerate(prompts):
        if str(i) not in engine._by_name:
            engine.add_request(str(i), p, greedy(MAX_NEW))
    assert outputs_of(drive(engine), len(prompts)) == clean(prompts, greedy(MAX_NEW))
    assert_idle(engine)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_requests_a_failed_step_aborts_are_reported_by_the_next_step(llama_path, overlap):
    """An interrupt while a step's text is made (after its ``update()``) loses the step's results,
    so its requests are aborted: a caller that keeps stepping gets each one's final output, with
    finish_reason "abort", rather than silence (it never asked for the abort)."""
    engine = tiny_engine(llama_path, overlap=overlap)
    prompts = rand_prompts(7, LENGTHS)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy(MAX_NEW))
    engine.text = _InterruptAfter(engine.text, "step_results", 2)
    last = drive(engine, fails=KeyboardInterrupt)
    assert sorted(last) == [str(i) for i in range(len(prompts))]
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in last.values())
    assert engine.stats()["requests_aborted"] == len(prompts)
    assert_idle(engine)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_a_request_that_finished_in_a_failed_step_is_still_reported(llama_path, overlap, monkeypatch):
    """An interrupt while the outputs of the step in which one request ends are built: that
    request, already ended in the scheduler, still gets its final output at the next ``step()``
    (its real one: it had ended in the scheduler), and the one that goes on is aborted, and reported."""
    import ferrokv.engine

    engine = tiny_engine(llama_path, overlap=overlap)
    short, long = rand_prompts(8, [5, 9])
    engine.add_request("short", short, greedy(3))
    engine.add_request("long", long, greedy(MAX_NEW))
    build, armed = ferrokv.engine.build_outputs, [True]

    def failing_build(reqs, ended_now, *args):
        if armed[0] and ended_now:  # the step in which "short" ends
            armed[0] = False
            raise KeyboardInterrupt
        return build(reqs, ended_now, *args)

    monkeypatch.setattr(ferrokv.engine, "build_outputs", failing_build)
    last = drive(engine, fails=KeyboardInterrupt)
    assert last["short"].finished and last["short"].outputs[0].finish_reason == "length"
    assert len(last["short"].outputs[0].token_ids) == 3
    assert last["long"].finished and last["long"].outputs[0].finish_reason == "abort"
    assert_idle(engine)


def test_aborted_requests_are_all_reported_though_one_report_is_interrupted(llama_path):
    """An interrupt in ``on_abort`` (the loop's routing) leaves the other aborted requests'
    reports queued: the next release of the engine lock hands them over, each once."""
    engine = tiny_engine(llama_path)
    for i, p in enumerate(rand_prompts(5, [6, 7, 8])):
        engine.add_request(str(i), p, greedy(MAX_NEW))
    engine.step()
    got = []

    def on_abort(o):
        got.append(o.request_id)
        if len(got) == 1:
            raise KeyboardInterrupt

    engine.on_abort = on_abort
    with pytest.raises(KeyboardInterrupt):
        engine.abort_request(["0", "1", "2"], wait=True)
    assert got == ["0"]
    engine.stats()  # any release reports the rest
    assert got == ["0", "1", "2"]
    assert_idle(engine)


def test_an_abort_drops_the_kept_outputs_of_a_request_that_had_finished(llama_path):
    """Outputs made before a step failed are handed out by the next ``step()``; an abort of their
    request in between drops them, also when it had finished (as vLLM: an aborted request reports
    nothing more), so a new request under the same id never gets the old one's output."""
    engine = tiny_engine(llama_path, overlap=True)
    a, b = rand_prompts(6, [6, 9])
    engine.add_request("A", a, greedy(2))
    engine.add_request("B", b, greedy(MAX_NEW))
    RunnerHook(engine, raise_on(3, RuntimeError("forward failed")))
    for _ in range(2):
        assert all(o.request_id != "A" or not o.finished for o in engine.step())
    with pytest.raises(RuntimeError, match="forward failed"):
        engine.step()  # A's final output was made (overlapped) before the forward pass failed
    assert "A" in [o.request_id for o in engine._held.kept if o.finished]
    engine.abort_request("A")
    engine.add_request("A", a, greedy(5))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == "A"]
    assert [len(o.outputs[0].token_ids) for o in outs if o.finished] == [5]
    assert_idle(engine)


# ------------------------------------------------------------------------------------------------
# 2. LLM.generate: a failed or interrupted call ends its requests; the LLM goes on
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_generate_that_fails_mid_step_ends_its_requests_and_the_llm_goes_on(llama_path, clean, error, overlap):
    llm = tiny_llm(llama_path, overlap=overlap)
    prompts, params = rand_prompts(1, LENGTHS), greedy(MAX_NEW)
    RunnerHook(llm.llm_engine, raise_on(3, error("injected")))
    with pytest.raises(error, match="injected"):
        llm.generate(prompts, params, use_tqdm=False)
    assert_idle(llm.llm_engine)
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == clean(prompts, params)
    assert_idle(llm.llm_engine)


SIGINT_CHILD = """
import json, signal, sys, threading
from ferrokv import LLM, SamplingParams

kwargs, prompts, max_tokens = json.loads(sys.argv[1])
llm = LLM(kwargs.pop("model"), **kwargs)
params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
landed = threading.Event()

def on_sigint(signum, frame):  # Python's own handler, which also says the signal has landed
    landed.set()
    signal.default_int_handler(signum, frame)

signal.signal(signal.SIGINT, on_sigint)
forward, calls = llm.llm_engine.runner.forward, []

def paused_forward(inputs):
    calls.append(1)
    if len(calls) == 3:
        print("MID-STEP", flush=True)  # the parent sends SIGINT now
        landed.wait()  # this step stays in progress until the signal has landed
    return forward(inputs)

llm.llm_engine.runner.forward = paused_forward
try:
    llm.generate(prompts, params, use_tqdm=False)
    print("NOT INTERRUPTED", flush=True)
    sys.exit(1)
except KeyboardInterrupt:
    pass
engine = llm.llm_engine
idle = {"free": engine.num_free_blocks, "unfinished": engine.has_unfinished_requests(),
        "aborted": engine.stats()["requests_aborted"]}
again = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
print(json.dumps({"idle": idle, "again": again}), flush=True)
"""


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_sigint_during_generate_aborts_the_call_and_the_llm_goes_on(llama_path, clean, tmp_path, overlap):
    """A real SIGINT to a process in ``LLM.generate``: KeyboardInterrupt, the call's requests are
    aborted and their blocks freed, the next generate equals a clean run, and the process exits."""
    prompts, max_new = rand_prompts(2, LENGTHS), 40
    kwargs = engine_kwargs(llama_path, overlap=overlap)
    script = tmp_path / "child.py"
    script.write_text(SIGINT_CHILD)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(ferrokv.__file__).parent.parent), env.get("PYTHONPATH", "")])
    child = subprocess.Popen([sys.executable, str(script), json.dumps([kwargs, prompts, max_new])],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        first = child.stdout.readline()
        assert first == "MID-STEP\n", first + child.stderr.read()
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=600)  # a hang guard, not a timing check
    finally:
        child.kill()
    assert child.returncode == 0, out + err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["idle"] == {"free": kwargs["num_kv_blocks"] - 1, "unfinished": False, "aborted": len(prompts)}
    assert [[t] for t in result["again"]] == clean(prompts, greedy(max_new))


# ------------------------------------------------------------------------------------------------
# 3. KV exhaustion at each edge
# ------------------------------------------------------------------------------------------------
# 14 prompt + 10 new tokens = 24 tokens = 6 blocks of 4: the worst case admission counts.
EDGE_LEN, EDGE_NEW, EDGE_BLOCKS = 14, 10, 6


def test_a_cache_that_holds_exactly_one_sequence(llama_path, clean):
    prompts, params = rand_prompts(7, [EDGE_LEN] * 3), greedy(EDGE_NEW)
    llm = tiny_llm(llama_path, num_kv_blocks=EDGE_BLOCKS + 1)  # + the null block
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == clean(prompts, params)
    assert llm.llm_engine.stats()["capacity_aborts"] == 0
    assert_idle(llm.llm_engine)


def test_a_request_one_block_larger_than_the_cache_is_refused(llama_path, clean):
    """One block short: a clear error when the request is added, never a hang; the call's other
    request is ended with it, and a request that fits still runs."""
    llm = tiny_llm(llama_path, num_kv_blocks=EDGE_BLOCKS)
    small, big = rand_prompts(8, [4, EDGE_LEN])
    with pytest.raises(ValueError, match=f"needs up to {EDGE_BLOCKS} KV blocks .* only ever give it {EDGE_BLOCKS - 1}"):
        llm.generate([small, big], [greedy(4), greedy(EDGE_NEW)], use_tqdm=False)
    assert_idle(llm.llm_engine)
    assert token_ids(llm.generate([small], greedy(4), use_tqdm=False)) == clean([small], greedy(4))
    assert_idle(llm.llm_engine)


def test_one_huge_request_among_many_small(llama_path, clean):
    """The huge request needs the whole cache: the small ones wait or are preempted around it,
    and every output equals a run with an ample cache."""
    smalls = rand_prompts(9, [3, 5, 2, 4, 6, 3, 5, 2])
    prompts = smalls[:4] + rand_prompts(10, [EDGE_LEN]) + smalls[4:]
    params = [greedy(5)] * 4 + [greedy(EDGE_NEW)] + [greedy(5)] * 4
    llm = tiny_llm(llama_path, num_kv_blocks=EDGE_BLOCKS + 1)
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == clean(prompts, params)
    assert llm.llm_engine.stats()["capacity_aborts"] == 0
    assert_idle(llm.llm_engine)


def test_swap_preemption_with_a_full_cpu_pool_falls_back_to_recompute(llama_path, clean):
    """3 CPU blocks: the first victim that fits is swapped out and fills the pool; the others
    are recomputed instead, and every output equals a run with an ample cache."""
    prompts, params = rand_prompts(3, [3, 60, 9, 29, 17, 44, 33, 1]), greedy(30)
    llm = tiny_llm(llama_path, num_kv_blocks=30, preemption_mode="swap", num_cpu_blocks=3)
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == clean(prompts, params)
    st = llm.llm_engine.stats()
    assert st["swap_preemptions"] > 0 and st["recompute_preemptions"] > 0 and st["capacity_aborts"] == 0, st
    assert_idle(llm.llm_engine)
