"""Thread tests: one engine shared by several threads.

``LLM.generate`` from several threads at once (each gets exactly its sequential outputs), aborts
from another thread (through ``LLMEngine.abort_request`` and ``EngineLoop.abort``, landing in the
middle of a step), getters polled during generation, an ``LLMEngine`` stepped by one thread and
aborted by another, the per-request stream and shutdown. Every test ends with no request and no
block left. Threads meet at events and barriers placed inside steps by
``helpers.engine_faults.RunnerHook``; nothing waits on a clock.
"""
from __future__ import annotations

import gc
import queue
import threading
import time

import pytest

from ferrokv.engine_loop import EngineDeadError
from ferrokv.outputs import RequestOutputKind
from helpers.engine_faults import (RunnerHook, assert_idle, drive, greedy, rand_prompts, tiny_engine, tiny_llm,
                                   token_ids)

N_THREADS = 4


def run_threads(target, n: int) -> list:
    """Runs ``target(i)`` in n threads; returns their results, re-raising the first error."""
    results: list = [None] * n
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = target(i)
        except BaseException as e:  # reported below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def in_another_thread(fn) -> None:
    """Calls fn in a new thread and waits for it: a call from another thread, at this point."""
    run_threads(lambda i: fn(), 1)


# ------------------------------------------------------------------------------------------------
# 1. generate from several threads at once
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_concurrent_generate_gets_each_thread_its_sequential_outputs(llama_path, overlap):
    batches = [rand_prompts(20 + i, [4 + 5 * i, 30 - 3 * i, 11]) for i in range(N_THREADS)]
    params = greedy(12)
    sequential = [token_ids(tiny_llm(llama_path).generate(b, params, use_tqdm=False)) for b in batches]

    llm = tiny_llm(llama_path, overlap=overlap)
    total = sum(len(b) for b in batches)
    # The first forward pass waits until every thread has taken its request ids (and so is about
    # to submit or has submitted), so the threads' requests share steps; or until a thread has
    # left generate (it takes no more ids), so that a failure fails rather than hangs the test.
    next_id, taken, gate = llm._next_id, [], threading.Event()

    def counted_next_id() -> str:
        taken.append(1)
        if len(taken) == total:
            gate.set()
        return next_id()

    llm._next_id = counted_next_id
    RunnerHook(llm.llm_engine, lambda n, out: gate.wait() if n == 1 else None)
    start = threading.Barrier(N_THREADS)

    def generate(i: int):
        start.wait()
        try:
            return llm.generate(batches[i], params, use_tqdm=False)
        finally:
            gate.set()

    outs = run_threads(generate, N_THREADS)
    assert [token_ids(o) for o in outs] == sequential
    assert llm.llm_engine.stats()["max_running_seqs"] > len(batches[0]), "the threads never shared a step"
    assert_idle(llm.llm_engine)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_stepping_the_engine_from_another_thread_during_generate_is_refused(llama_path, overlap):
    """vLLM's ``llm.llm_engine.step()`` while ``generate`` runs in another thread would take the
    loop's outputs (and hang generate): a RuntimeError, and generate goes on unharmed; once the
    loop holds nothing, stepping the engine by hand works again."""
    llm = tiny_llm(llama_path, overlap=overlap)
    prompts, params = rand_prompts(31, [9, 14]), greedy(60)
    expected = token_ids(tiny_llm(llama_path).generate(prompts, params, use_tqdm=False))
    RunnerHook(llm.llm_engine, lambda n, out: time.sleep(0.02))  # generate lasts over a second
    result: list = []
    worker = threading.Thread(target=lambda: result.append(llm.generate(prompts, params, use_tqdm=False)), daemon=True)
    worker.start()
    deadline = time.monotonic() + 60
    while not llm.engine_loop.holding({"0", "1"}) and time.monotonic() < deadline:
        time.sleep(0.001)
    with pytest.raises(RuntimeError, match="another thread while the engine loop drives this engine"):
        llm.llm_engine.step()
    if not overlap:  # in a fork child the loop is dead: the engine is the child's to step
        from helpers.fork import in_fork_child

        code, said = in_fork_child(lambda: repr(llm.llm_engine.before_step()))
        assert (code, said) == (0, "None"), said
    worker.join(120)
    assert not worker.is_alive(), "generate lost its outputs to the other thread's step"
    assert token_ids(result[0]) == expected
    assert_idle(llm.llm_engine)
    llm.llm_engine.add_request("by-hand", prompts[0], params)  # the idle loop leaves the engine to its caller
    finals = [o for _ in range(200) if llm.llm_engine.has_unfinished_requests() for o in llm.llm_engine.step()
              if o.finished]
    assert [o.outputs[0].token_ids for o in finals] == [expected[0][0]]
    assert_idle(llm.llm_engine)


# ------------------------------------------------------------------------------------------------
# 2. aborts from another thread, in the middle of a step
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("via", ["engine.abort_request", "engine_loop.abort"])
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_abort_from_another_thread_ends_the_call_promptly(llama_path, via, overlap):
    """Request 2 of 3 is aborted from another thread during the 4th forward pass: the call returns
    it cut short with finish_reason "abort", the others complete, and its blocks are freed."""
    llm = tiny_llm(llama_path, overlap=overlap)
    prompts, params = rand_prompts(30, [7, 19, 12]), greedy(30)
    expected = token_ids(tiny_llm(llama_path).generate(prompts, params, use_tqdm=False))
    abort = llm.llm_engine.abort_request if via == "engine.abort_request" else llm.engine_loop.abort

    def abort_mid_step(n: int, out) -> None:
        if n == 4:
            in_another_thread(lambda: abort(["1"]))  # ids count from 0 (vLLM's): the second prompt

    RunnerHook(llm.llm_engine, abort_mid_step)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.request_id for o in outs] == ["0", "1", "2"]
    cut = outs[1].outputs[0]
    assert cut.finish_reason == "abort" and len(cut.token_ids) < params.max_tokens
    assert cut.token_ids == expected[1][0][:len(cut.token_ids)]
    assert [token_ids([outs[0]]), token_ids([outs[2]])] == [expected[:1], expected[2:]]
    assert llm.llm_engine.stats()["requests_aborted"] == 1
    assert_idle(llm.llm_engine)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_abort_every_request_of_a_call_from_another_thread(llama_path, overlap):
    llm = tiny_llm(llama_path, overlap=overlap)
    prompts = rand_prompts(31, [9, 25])

    def abort_all(n: int, out) -> None:
        if n == 3:
            in_another_thread(lambda: llm.llm_engine.abort_request(["0", "1"]))

    RunnerHook(llm.llm_engine, abort_all)
    outs = llm.generate(prompts, greedy(60), use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["abort", "abort"]
    assert all(o.finished and len(o.outputs[0].token_ids) == 3 for o in outs)  # applied when step 3 ends
    assert_idle(llm.llm_engine)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_engine_stepped_by_one_thread_and_aborted_by_another(llama_path, overlap):
    """vLLM's API driven by hand: one thread steps, another aborts in the middle of a step. The
    abort is applied when the step ends: the request reports nothing more, the core drops it
    (has_unfinished_requests tells the truth all along) and its blocks are freed."""
    engine = tiny_engine(llama_path, overlap=overlap)
    prompts = rand_prompts(32, [8, 21, 15])
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy(20))
    seen_mid_step: list = []

    def abort_mid_step(n: int, out) -> None:
        if n == 3:
            in_another_thread(lambda: engine.abort_request("1"))
            seen_mid_step.append(engine.get_num_unfinished_requests())

    RunnerHook(engine, abort_mid_step)
    last = drive(engine)
    assert seen_mid_step == [3]  # queued, not yet applied: the core still holds it
    # Step 3 completes; with overlap on, its outputs were to be made during step 4, which the
    # abort (applied as step 3 ends) drops: the last output is step 2's.
    assert last["1"].finished is False and len(last["1"].outputs[0].token_ids) == (2 if overlap else 3)
    assert last["0"].finished and last["2"].finished
    assert engine.stats()["requests_aborted"] == 1
    assert_idle(engine)


@pytest.mark.parametrize("where", ["report", "wake"])
def test_an_interrupt_in_a_thread_that_aborted_a_loops_request_loses_no_report(llama_path, where):
    """The main thread aborts a request of the loop through ``LLMEngine.abort_request`` and is
    interrupted (Ctrl-C) right after the abort was applied: as it would hand the report over, or
    as it wakes the loop. The report is the loop's own to hand out, so the request's caller still
    gets its terminal output, and nothing is left behind."""
    llm = tiny_llm(llama_path)
    engine, guard = llm.llm_engine, llm.llm_engine._guard
    main = threading.get_ident()
    received: queue.SimpleQueue = queue.SimpleQueue()
    delivering, go_on = threading.Event(), threading.Event()

    class Sink:  # holds the loop in its first delivery: out of the engine lock, so this thread applies the abort
        def put(self, item) -> None:
            delivering.set()
            assert go_on.wait(timeout=60)
            received.put(item)

    llm.engine_loop.submit("a", rand_prompts(35, [9])[0], greedy(200), sink=Sink())
    assert delivering.wait(timeout=60)

    def interrupted_on_main(fn):
        def call(*args):
            if threading.get_ident() == main:
                raise KeyboardInterrupt
            return fn(*args)
        return call

    if where == "report":
        guard._report = interrupted_on_main(guard._report)
    else:
        guard._wake = interrupted_on_main(lambda: None)  # the wake is lost: the loop looks again itself
    try:
        engine.abort_request("a", wait=True)
    except KeyboardInterrupt:
        pass
    assert engine.get_num_unfinished_requests() == 0  # applied here
    go_on.set()
    while not (item := received.get(timeout=60)).finished:
        pass
    assert item.output.outputs[0].finish_reason == "abort"
    llm.engine_loop.submit("b", rand_prompts(36, [5])[0], greedy(1), sink=received)  # the loop serves on
    assert received.get(timeout=60).output.finished
    assert_idle(engine)


# ------------------------------------------------------------------------------------------------
# 3. getters polled from another thread never raise
# ------------------------------------------------------------------------------------------------
def test_stats_polled_during_generation_never_raise(llama_path):
    """A poller spins on every getter while 48 long prompts run: the scheduler's own getters
    raise "Already mutably borrowed" thousands of times in such a run (schedule/update hold the
    scheduler with the GIL released); the engine's serve a snapshot instead."""
    llm = tiny_llm(llama_path, num_kv_blocks=2048, max_num_seqs=64)
    engine = llm.llm_engine
    stop, in_step, polled_in_step = threading.Event(), threading.Event(), threading.Event()
    errors: list[BaseException] = []
    polls = []

    def poll() -> None:
        while not stop.is_set():
            try:
                was_in_step = in_step.is_set()
                st = engine.stats()
                sample = (st["num_free_blocks"], engine.num_free_blocks, engine.kv_cache_usage,
                          engine.has_unfinished_requests(), engine.get_num_unfinished_requests())
                polls.append(sample)
                if was_in_step:
                    polled_in_step.set()
            except BaseException as e:
                errors.append(e)
                polled_in_step.set()  # no more polls: let the step go on, the test fails below
                return

    def wait_for_a_poll(n: int, out) -> None:
        if n == 5:  # one step certainly polled while it runs (the snapshot path)
            in_step.set()
            polled_in_step.wait()

    RunnerHook(engine, wait_for_a_poll)
    poller = threading.Thread(target=poll)
    poller.start()
    try:
        prompts = rand_prompts(33, [100] * 48)
        outs = llm.generate(prompts, greedy(6), use_tqdm=False)
    finally:
        stop.set()
        poller.join()
    assert not errors, errors[:3]
    assert len(outs) == len(prompts) and polls
    usable = engine.scheduler.num_blocks - 1
    assert all(0 <= a <= usable and 0 <= b <= usable and 0.0 <= u <= 1.0 for a, b, u, _, _ in polls)
    assert_idle(engine)


def test_stats_asked_for_the_first_time_mid_step_are_those_of_the_last_steps_end(llama_path):
    """A getter never waits for a step; what it reads then is not arbitrarily old: the counters
    are those of the previous step's end, with no earlier call needed."""
    llm = tiny_llm(llama_path)
    engine = llm.llm_engine
    seen = []

    def ask_mid_step(n: int, out) -> None:
        if n == 4:  # steps 1-3 ended; the loop's thread holds the engine in step 4
            in_another_thread(lambda: seen.append(engine.stats()))

    RunnerHook(engine, ask_mid_step)
    llm.generate(rand_prompts(37, [5, 7, 9]), greedy(6), use_tqdm=False)
    (st,) = seen
    assert (st["steps"], st["num_running"], st["generated_tokens"]) == (3, 3, 9), st
    assert "num_used_token_slots" in st  # the O(blocks) counts as of the construction
    assert_idle(engine)


# ------------------------------------------------------------------------------------------------
# 4. the loop's own interface: per-request stream, shutdown
# ------------------------------------------------------------------------------------------------
def test_stream_yields_cumulative_outputs_and_closing_it_aborts(llama_path):
    llm = tiny_llm(llama_path)
    prompt, params = rand_prompts(34, [10])[0], greedy(8)
    outs = list(llm.engine_loop.stream("s", prompt, params))
    # One output per step; a CUMULATIVE output's token list is shared with the request's later
    # outputs (it grows, as in vLLM), so only the last one is checked for content.
    assert [o.finished for o in outs] == [False] * 7 + [True]
    assert token_ids(outs[-1:]) == token_ids(llm.generate([prompt], params, use_tqdm=False))
    deltas = list(llm.engine_loop.stream("d", prompt, greedy(8, output_kind=RequestOutputKind.DELTA)))
    assert [len(o.outputs[0].token_ids) for o in deltas] == [1] * 8
    assert sum((o.outputs[0].token_ids for o in deltas), []) == outs[-1].outputs[0].token_ids
    assert "".join(o.outputs[0].text for o in deltas) == outs[-1].outputs[0].text

    stream = llm.engine_loop.stream("t", prompt, greedy(100))
    assert len(next(stream).outputs[0].token_ids) == 1
    stream.close()  # aborts "t"; the abort output goes nowhere, and nothing is left behind
    probe: queue.SimpleQueue = queue.SimpleQueue()
    llm.engine_loop.submit("u", prompt, greedy(1), sink=probe)  # queued after the abort
    assert probe.get().output.finished
    assert llm.llm_engine.stats()["requests_aborted"] == 1
    assert_idle(llm.llm_engine)


def test_shutdown_ends_requests_in_flight_and_refuses_new_ones(llama_path):
    llm = tiny_llm(llama_path)
    loop = llm.engine_loop

    def shut_down_mid_step(n: int, out) -> None:
        if n == 2:
            in_another_thread(lambda: loop.shutdown(wait=False))

    RunnerHook(llm.llm_engine, shut_down_mid_step)
    with pytest.raises(EngineDeadError, match="shut down"):
        llm.generate(rand_prompts(35, [5, 12]), greedy(30), use_tqdm=False)
    loop.shutdown()  # joins the thread
    assert not loop.is_running
    with pytest.raises(EngineDeadError, match="shut down") as dead:
        llm.generate(rand_prompts(35, [5]), greedy(3), use_tqdm=False)
    assert not dead.value.failed
    assert_idle(llm.llm_engine)


def test_steps_that_keep_failing_end_the_loop_and_a_success_between_resets_the_count(llama_path):
    """One failed step ends its requests and the loop goes on; MAX_FAILED_STEPS in a row (a
    poisoned device) end the loop, as vLLM's engine dies on a failed step, so health checks see it."""
    from ferrokv.engine_loop import MAX_FAILED_STEPS

    llm = tiny_llm(llama_path)
    failing = [True]

    def maybe_fail(n: int, out) -> None:
        if failing[0]:
            raise RuntimeError("device lost")

    RunnerHook(llm.llm_engine, maybe_fail)
    prompt = rand_prompts(36, [6])
    for failures in (MAX_FAILED_STEPS - 1, MAX_FAILED_STEPS):
        failing[0] = True
        for _ in range(failures):
            with pytest.raises(RuntimeError, match="device lost"):
                llm.generate(prompt, greedy(3), use_tqdm=False)
        if failures < MAX_FAILED_STEPS:
            failing[0] = False
            assert llm.generate(prompt, greedy(3), use_tqdm=False)[0].finished  # resets the count
    llm.engine_loop.shutdown()  # joins the thread (its death already began)
    with pytest.raises(EngineDeadError, match=f"failed {MAX_FAILED_STEPS} steps in a row.*device lost") as dead:
        llm.generate(prompt, greedy(3), use_tqdm=False)
    assert dead.value.failed
    assert not llm.engine_loop.is_running
    assert_idle(llm.llm_engine)


def test_an_llm_that_is_collected_ends_its_loop_thread(llama_path):
    llm = tiny_llm(llama_path)
    llm.generate(rand_prompts(36, [4]), greedy(2), use_tqdm=False)
    thread = llm.engine_loop._thread
    assert thread is not None and thread.is_alive()
    del llm
    gc.collect()
    thread.join(timeout=300)  # a hang guard, not a timing check
    assert not thread.is_alive()


def test_an_abandoned_call_does_not_wait_for_a_terminal_item_it_already_took(llama_path):
    """A Ctrl-C that lands right after ``sink.get()`` returned a request's last item loses that
    item: abandoning the call must not wait for it again (the loop no longer holds the id), and
    still waits for the aborts of the requests that were running."""
    from ferrokv.llm import _abandon

    llm = tiny_llm(llama_path)
    loop = llm.engine_loop
    sink: queue.SimpleQueue = queue.SimpleQueue()
    final = greedy(2, output_kind=RequestOutputKind.FINAL_ONLY)
    loop.submit("taken", rand_prompts(1, [4])[0], final, sink=sink)
    assert sink.get(timeout=60).finished  # ... and then lost to the interrupt
    loop.submit("running", rand_prompts(2, [4])[0], greedy(10_000, output_kind=RequestOutputKind.FINAL_ONLY),
                sink=sink)
    done: dict = {}
    t = threading.Thread(target=_abandon, args=(loop, ["taken", "running"], done, sink), daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "_abandon hung on an item it would never get again"
    assert list(done) == ["running"] and done["running"].output.outputs[0].finish_reason == "abort"
    assert_idle(llm.llm_engine)


SIGINT_STRESS = """
import random, signal, sys, threading, time
from ferrokv import LLM, SamplingParams
llm = LLM(sys.argv[1], device="cpu", dtype="float32", max_model_len=128, block_size=4, num_kv_blocks=64,
          max_num_seqs=8)
rng = random.Random(0)
prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(1, 6))] for _ in range(300)]
params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
main = threading.main_thread().ident
for _ in range(int(sys.argv[2])):
    timer = threading.Timer(rng.random() * 0.03, signal.pthread_kill, args=(main, signal.SIGINT))
    try:
        try:
            timer.start()
            llm.generate(prompts, params, use_tqdm=False)
        except KeyboardInterrupt:
            pass
        timer.join()
    except KeyboardInterrupt:  # landed after the call
        timer.join()
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
assert not llm.llm_engine.has_unfinished_requests()
print("ok")
"""


def test_real_sigints_at_random_moments_never_wedge_the_llm(llama_path):
    """Real SIGINTs to the calling thread at random moments of ``generate`` (fixed seed): each
    call raises or returns, the next call works, and the process exits. A lock half-taken by an
    interrupt (threading.Event's, in Python code) used to wedge every later call and the exit."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", SIGINT_STRESS, str(llama_path), "60"], capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


@pytest.mark.parametrize("where", ["after_submit", "inside_queue"])
def test_an_interrupt_while_a_batch_is_submitted_leaves_no_request_behind(llama_path, where):
    """A Ctrl-C right after a submit returned (the call had not recorded the id yet), or inside
    the queuing before the put (the id claimed, never queued): the call's every request is
    aborted or never ran, the engine is idle when the call raises, and the next call works."""
    llm = tiny_llm(llama_path)
    loop = llm.engine_loop
    calls = []
    if where == "after_submit":
        real_submit = loop.submit

        def submit(*a, **kw):
            real_submit(*a, **kw)
            calls.append(1)
            if len(calls) == 3:
                raise KeyboardInterrupt  # what a SIGINT landing right after the return does

        loop.submit = submit
    else:
        class Inbox(queue.SimpleQueue):
            def put(self, item, *a, **kw):
                calls.append(1)
                if len(calls) == 3:
                    raise KeyboardInterrupt  # before the item is queued
                super().put(item, *a, **kw)

        loop._inbox = Inbox()
    prompts = rand_prompts(8, [3] * 8)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, greedy(10_000), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert_idle(llm.llm_engine)
    assert not loop.holding({str(i) for i in range(100)})
    out = llm.generate(prompts[:1], greedy(3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_a_retry_under_a_given_up_id_waits_for_the_old_request_and_gets_only_its_own_outputs(llama_path):
    """The old request's abort cannot be applied at once (another thread holds the engine lock,
    as ``reset_prefix_cache`` does): a retry under its id waits in the loop; a retry that is
    given up in turn while it waits is added and aborted (its terminal item is an abort); the
    last one then runs as if alone. Each sink gets only its own request's items, and every
    claim on the id ends."""
    llm = tiny_llm(llama_path)
    loop, engine = llm.engine_loop, llm.llm_engine
    prompt = rand_prompts(61, [6])[0]
    want = llm.generate([prompt], greedy(5), use_tqdm=False)[0].outputs[0].token_ids
    old, retry, last = queue.SimpleQueue(), queue.SimpleQueue(), queue.SimpleQueue()
    loop.submit("same", prompt, greedy(10_000), sink=old)
    while engine.get_num_unfinished_requests() == 0:
        pass
    engine._guard._lock.acquire()  # the loop's next step, and every abort, wait for it
    try:
        loop.abandon("same", old)
        loop.submit("same", prompt, greedy(5), sink=retry)
        with pytest.raises(ValueError, match="already in use"):  # the retry holds it, not given up
            loop.submit("same", prompt, greedy(5), sink=queue.SimpleQueue())
        loop.abandon("same", retry)
        loop.submit("same", prompt, greedy(5), sink=last)
    finally:
        engine._before_release()  # applies the queued aborts on this thread: their outputs go through the inbox
        engine._guard._lock.release()
        engine._guard._after_release(released=True)

    def items(sink):
        got = [sink.get(timeout=60)]
        while not got[-1].finished:
            got.append(sink.get(timeout=60))
        return got

    finals = [items(s)[-1] for s in (old, retry, last)]
    assert [f.error for f in finals] == [None, None, None]
    assert [f.output.outputs[0].finish_reason for f in finals] == ["abort", "abort", "length"]
    assert finals[2].output.outputs[0].token_ids == want
    assert old.empty() and retry.empty() and last.empty()
    assert not loop.holding({"same"})
    assert_idle(engine)


def test_retries_given_up_in_turn_behind_a_held_engine_lock_each_end_with_their_own_outputs(llama_path):
    """Another thread holds the engine lock while a request is given up, retried, the retry given
    up, and retried again, each with its own prompt: the two waiting retries start one after the
    other (the first is added and aborted), no sink gets another request's output, and the id's
    claims, records and waiting submits all end."""
    from ferrokv.engine_loop import EngineLoop

    engine = tiny_engine(llama_path)
    loop = EngineLoop(engine)
    prompts = {name: rand_prompts(70 + i, [4 + i])[0] for i, name in enumerate("abc")}
    sinks = {name: queue.SimpleQueue() for name in "abc"}
    # Pins the timing: the loop's third step waits (off the engine lock) until the commands are queued.
    real_step, steps, paused, go = engine.step, [0], threading.Event(), threading.Event()

    def step():
        steps[0] += 1
        if steps[0] == 3:
            paused.set()
            go.wait(30)
            return []
        return real_step()

    engine.step = step
    loop.submit("X", prompts["a"], greedy(10_000), sink=sinks["a"])
    assert paused.wait(30)
    engine._guard._lock.acquire()  # as reset_prefix_cache holds it
    try:
        loop.abandon("X", sinks["a"])
        loop.submit("X", prompts["b"], greedy(10_000), sink=sinks["b"])
        loop.abandon("X", sinks["b"])
        loop.submit("X", prompts["c"], greedy(5), sink=sinks["c"])
        go.set()
        time.sleep(0.3)  # the loop takes the commands while the lock is held
    finally:
        engine._before_release()
        engine._guard._lock.release()
        engine._guard._after_release(released=True)
    finals = {}
    for name, sink in sinks.items():
        item = sink.get(timeout=60)
        while True:
            assert item.error is None and item.output.prompt_token_ids == prompts[name]["prompt_token_ids"], name
            if item.finished:
                break
            item = sink.get(timeout=60)
        finals[name] = item.output.outputs[0]
    assert [finals[n].finish_reason for n in "abc"] == ["abort", "abort", "length"]
    assert len(finals["c"].token_ids) == 5
    assert not loop.holding({"X"}) and not loop._records and not loop._deferred
    assert_idle(engine)
    loop.shutdown()


def test_a_fork_child_gets_engine_dead_not_a_hang(llama_path):
    """The loop's thread is not copied by os.fork(): in the child a used LLM raises at once (it
    waited forever on its sink), naming the fork; the parent goes on."""
    import os

    from helpers.fork import in_fork_child

    llm = tiny_llm(llama_path)
    prompt = rand_prompts(43, [5])
    first = llm.generate(prompt, greedy(3), use_tqdm=False)[0].outputs[0].token_ids

    def child(params) -> str:
        try:
            llm.generate(prompt, params, use_tqdm=False)
        except EngineDeadError as e:
            return str(e)
        raise AssertionError("no error")

    code, said = in_fork_child(lambda: child(greedy(3)))
    assert code == 0, (code, said)
    assert "os.fork()" in said and str(os.getpid()) in said, said
    # With a grammar too: refused before its compile (which would start compile threads first).
    code, said = in_fork_child(lambda: child(greedy(3, structured_outputs={"regex": "(ab)+"})), timeout=30)
    assert code == 0 and "os.fork()" in said, (code, said)
    assert llm.generate(prompt, greedy(3), use_tqdm=False)[0].outputs[0].token_ids == first
    assert_idle(llm.llm_engine)


# ------------------------------------------------------------------------------------------------
# Delivery overlapped with the forward pass
# ------------------------------------------------------------------------------------------------
class _CountingSink:
    def __init__(self) -> None:
        self.items: list = []
        self.arrived = threading.Condition()

    def put(self, item) -> None:
        with self.arrived:
            self.items.append(item)
            self.arrived.notify_all()

    def wait_for(self, count: int, timeout: float) -> bool:
        with self.arrived:
            return self.arrived.wait_for(lambda: len(self.items) >= count, timeout)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_with_overlap_a_steps_outputs_reach_their_caller_during_the_next_forward_pass(llama_path, overlap):
    """Forward pass n waits (up to a second) for step n - 1's output to reach the caller. Serial,
    it came before the step began; with overlap, step n makes it while forward pass n runs, and
    the loop routes it right then (LLMEngine.deliver), not once the step is over. The stream is
    the same either way, and ends with the engine idle."""
    llm = tiny_llm(llama_path, overlap=overlap)
    sink, seen = _CountingSink(), []
    RunnerHook(llm.llm_engine, lambda n, out: seen.append(sink.wait_for(n - 1, 1.0)) if 2 <= n <= 5 else None)
    params = greedy(8, output_kind=RequestOutputKind.DELTA)
    (prompt,) = rand_prompts(3, [12])
    llm.engine_loop.submit("r", prompt, params, sink=sink)
    assert sink.wait_for(8, 60) and sink.items[-1].finished
    assert seen == [True] * 4
    streamed = [t for item in sink.items for t in item.output.outputs[0].token_ids]
    assert streamed == token_ids(tiny_llm(llama_path).generate([prompt], greedy(8), use_tqdm=False))[0][0]
    assert_idle(llm.llm_engine)


def test_with_overlap_a_requests_last_output_arrives_after_the_step_that_made_it(llama_path):
    """Outputs that end a request are held until the step is over (its caller finds the engine as
    the step left it); the others arrive during the next forward pass."""
    llm = tiny_llm(llama_path, overlap=True)
    loop, during_step = llm.engine_loop, []

    class Sink(_CountingSink):
        def put(self, item) -> None:
            during_step.append((item.finished, loop._stepping))
            super().put(item)

    sink = Sink()
    prompt = rand_prompts(4, [10])[0]
    llm.engine_loop.submit("delta", prompt, greedy(6, output_kind=RequestOutputKind.DELTA), sink=sink)
    llm.engine_loop.submit("final", prompt, greedy(3), sink=sink)
    with sink.arrived:
        assert sink.arrived.wait_for(lambda: sum(item.finished for item in sink.items) == 2, 60)
    finals = [stepping for finished, stepping in during_step if finished]
    assert finals == [False, False], during_step
    assert any(stepping for finished, stepping in during_step if not finished), during_step
    assert_idle(llm.llm_engine)
