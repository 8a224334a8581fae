"""AsyncLLM: the engine from asyncio.

Output kinds (DELTA pieces join to the sequential result, CUMULATIVE ends complete, FINAL_ONLY
yields once), many requests from one event loop sharing steps, ``abort``, a closed or cancelled
generator (a client that went away) aborting its request and freeing its blocks, bad input
raised as ``ValueError`` while other requests go on, shutdown, tokenization on the pool, the
batching of wake-ups (one ``call_soon_threadsafe`` per step, not per output), and the ``serve``
command's flag checks. Waits are on the engine's own outputs (a probe request queued after an
abort finishes after it), never on a clock.
"""
from __future__ import annotations

import asyncio
import functools
import subprocess
import threading
import traceback

import pytest

from ferrokv import AsyncLLM, SamplingParams
from ferrokv.engine_loop import EngineDeadError
from ferrokv.outputs import RequestOutputKind as Kind
from helpers.engine_faults import RunnerHook, engine_kwargs, greedy, raise_on, rand_prompts, tiny_llm, token_ids


def make_async_llm(path, **kw) -> AsyncLLM:
    args = engine_kwargs(path, **kw)
    return AsyncLLM(args.pop("model"), **args)


@pytest.fixture(scope="module")
def allm(llama_path):
    llm = make_async_llm(llama_path)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def sequential(llama_path):
    """The synchronous LLM's greedy outputs: what every AsyncLLM run must reproduce."""
    llm = tiny_llm(llama_path)

    def run(prompts, max_tokens):
        return llm.generate(prompts, greedy(max_tokens), use_tqdm=False)

    return run


async def collect(llm: AsyncLLM, prompt, params, rid):
    return [o async for o in llm.generate(prompt, params, rid)]


async def probe(llm: AsyncLLM, rid: str) -> None:
    """A one-token request: submitted after earlier aborts, it finishes after they are applied."""
    outs = await collect(llm, {"prompt_token_ids": [5, 6, 7]}, greedy(1), rid)
    assert outs[-1].finished


def assert_engine_idle(llm: AsyncLLM) -> None:
    st = llm.stats()  # thread-safe; live while the loop is idle
    assert (st["num_running"], st["num_waiting"]) == (0, 0), st
    assert st["num_free_blocks"] == st["num_blocks"] - 1, st
    assert llm.num_in_flight == 0


# ------------------------------------------------------------------------------------------------
# 1. output kinds
# ------------------------------------------------------------------------------------------------
def test_output_kinds_match_the_synchronous_engine(allm, sequential):
    prompt = rand_prompts(40, [9])[0]
    expected = sequential([prompt], 10)[0].outputs[0]

    async def main():
        return await asyncio.gather(*(collect(allm, prompt, greedy(10, output_kind=k), f"kind-{k.name}")
                                      for k in (Kind.DELTA, Kind.CUMULATIVE, Kind.FINAL_ONLY)))

    delta, cumulative, final = asyncio.run(main())
    assert delta[-1].finished and not any(o.finished for o in delta[:-1])
    assert sum((o.outputs[0].token_ids for o in delta), []) == expected.token_ids
    assert "".join(o.outputs[0].text for o in delta) == expected.text
    assert cumulative[-1].finished and not any(o.finished for o in cumulative[:-1])
    assert cumulative[-1].outputs[0].token_ids == expected.token_ids
    assert cumulative[-1].outputs[0].text == expected.text
    assert len(final) == 1 and final[0].finished
    assert final[0].outputs[0].token_ids == expected.token_ids and final[0].outputs[0].text == expected.text
    assert final[0].outputs[0].finish_reason == "length"
    assert_engine_idle(allm)


@pytest.mark.parametrize("kind", [Kind.DELTA, Kind.CUMULATIVE])
def test_a_consumer_that_lags_reads_the_unread_outputs_as_one(allm, sequential, kind):
    """A's outputs after its first are left unread until a request submitted after that first
    output (and so finishing no earlier than A) has ended: they are then read as one output,
    merged (DELTA) or the newest (CUMULATIVE), and still add up to the sequential result."""
    a_prompt, b_prompt = rand_prompts(48, [7, 5])
    # A long enough that its first output is read before it ends, even on a loaded machine.
    (expected_out,) = sequential([a_prompt], 40)
    expected = expected_out.outputs[0].token_ids

    async def main():
        a = allm.generate(a_prompt, greedy(40, output_kind=kind, logprobs=1), f"lag-{kind.name}")
        first = await anext(a)
        await collect(allm, b_prompt, greedy(39, output_kind=Kind.FINAL_ONLY), f"lag-probe-{kind.name}")
        return first, [o async for o in a]

    first, rest = asyncio.run(main())
    assert len(rest) == 1 and rest[0].finished
    (c,) = rest[0].outputs
    if kind == Kind.DELTA:
        assert first.outputs[0].token_ids + c.token_ids == expected
        assert first.outputs[0].text + c.text == expected_out.outputs[0].text
        assert len(first.outputs[0].logprobs) + len(c.logprobs) == 40
        assert c.finish_reason == "length"
    else:
        assert c.token_ids == expected and len(c.logprobs) == 40
    assert_engine_idle(allm)


def test_on_accepted_is_told_once_the_engine_took_the_request_before_its_first_output(allm):
    """ferrokv's ``on_accepted`` (what lets a server answer a refusal before streaming): called
    once, on the event loop, before the first output; never for a request the engine refuses."""
    events: list = []

    async def run(prompt, rid):
        loop = asyncio.get_running_loop()
        accepted = lambda: events.append((rid, "accepted", asyncio.get_running_loop() is loop))  # noqa: E731
        try:
            async for o in allm.generate(prompt, greedy(2), rid, on_accepted=accepted):
                events.append((rid, "output", len(o.outputs[0].token_ids)))
        except ValueError:
            events.append((rid, "refused"))

    async def main():
        await asyncio.gather(run({"prompt_token_ids": [5, 6, 7]}, "ok"),
                             run({"prompt_token_ids": [5] * 1000}, "too-long"))

    asyncio.run(main())
    assert [e for e in events if e[0] == "ok"] == [("ok", "accepted", True), ("ok", "output", 1), ("ok", "output", 2)]
    assert [e for e in events if e[0] == "too-long"] == [("too-long", "refused")]
    assert_engine_idle(allm)


def test_an_on_accepted_that_raises_ends_its_own_call_only(allm):
    """The callback's error is raised by its generate, whose request is then aborted; the event
    loop's other streams go on (review22: it escaped the loop's drain of every stream's items,
    which stayed unread until another output came, maybe never)."""

    def broken():
        raise RuntimeError("callback broke")

    async def main():
        async def failing():
            with pytest.raises(RuntimeError, match="callback broke"):
                async for _ in allm.generate({"prompt_token_ids": [5, 6, 7]}, greedy(50), "cb", on_accepted=broken):
                    pass
        other, _ = await asyncio.wait_for(asyncio.gather(
            collect(allm, {"prompt_token_ids": [8, 9]}, greedy(3), "other"), failing()), 60)
        return other

    assert asyncio.run(main())[-1].outputs[0].finish_reason == "length"
    assert_engine_idle(allm)
    asyncio.run(probe(allm, "cb"))  # the id is free again


def test_text_prompts_are_tokenized_on_the_pool(allm, sequential):
    tok = allm.tokenizer
    threads: list[str] = []
    encode = tok.encode

    def recording_encode(*a, **kw):
        threads.append(threading.current_thread().name)
        return encode(*a, **kw)

    tok.encode = recording_encode
    try:
        outs = asyncio.run(collect(allm, "the quick brown fox", greedy(4, output_kind=Kind.FINAL_ONLY), "text"))
    finally:
        del tok.encode
    assert threads and all(name.startswith("ferrokv-tokenize") for name in threads), threads
    assert outs[0].prompt == "the quick brown fox"
    assert outs[0].prompt_token_ids == encode("the quick brown fox")
    assert token_ids(outs) == token_ids(sequential(["the quick brown fox"], 4))


def record_build_threads(monkeypatch) -> list[str]:
    """The names of the threads grammars are built on, from now on."""
    from ferrokv.structured_outputs import GrammarCompiler

    threads: list[str] = []
    build = GrammarCompiler._build

    def recording_build(self, params):
        threads.append(threading.current_thread().name)
        return build(self, params)

    monkeypatch.setattr(GrammarCompiler, "_build", recording_build)
    return threads


def test_a_grammar_is_compiled_on_a_compile_thread_not_the_event_loop_or_the_tokenize_pool(allm, monkeypatch):
    """A structured-output grammar may take long to compile: on a compile thread (its large
    stack), never on the event loop's thread nor on the pool that tokenizes prompts."""
    threads = record_build_threads(monkeypatch)
    params = SamplingParams(temperature=0.0, max_tokens=30, output_kind=Kind.FINAL_ONLY,
                            structured_outputs={"choice": ["yes", "nope"]})
    outs = asyncio.run(collect(allm, {"prompt_token_ids": [5, 6, 7]}, params, "grammar"))
    assert len(threads) == 1 and threads[0].startswith("ferrokv-grammar"), threads
    assert outs[-1].outputs[0].text in ("yes", "nope") and outs[-1].outputs[0].finish_reason == "stop"


def test_a_burst_of_more_grammars_than_the_cache_holds_builds_each_once(llama_path, monkeypatch):
    """Each request holds its compiled grammar until it is added, so the engine's add finds it
    however many others were compiled meanwhile: no second build (it would be on the engine loop's
    thread, stalling every running request)."""
    from ferrokv import grammar_compiler

    monkeypatch.setattr(grammar_compiler, "GRAMMAR_CACHE_SIZE", 2)
    threads = record_build_threads(monkeypatch)
    llm = make_async_llm(llama_path)
    choices = [[f"w{i}a", f"w{i}bb"] for i in range(24)]  # more than the cache holds, even unpatched

    async def run_all():
        params = [SamplingParams(temperature=0.0, max_tokens=8, output_kind=Kind.FINAL_ONLY,
                                 structured_outputs={"choice": c}) for c in choices]
        return await asyncio.gather(*(collect(llm, {"prompt_token_ids": [5, 6, 7]}, p, f"g{i}")
                                      for i, p in enumerate(params)))

    try:
        outs = asyncio.run(run_all())
    finally:
        llm.shutdown()
    assert len(threads) == len(choices) and all(t.startswith("ferrokv-grammar") for t in threads), threads
    assert [o[-1].outputs[0].text in c for o, c in zip(outs, choices)] == [True] * len(choices)


# ------------------------------------------------------------------------------------------------
# 2. many requests from one event loop
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_concurrent_requests_from_one_event_loop_share_steps(llama_path, sequential, overlap):
    llm = make_async_llm(llama_path, overlap=overlap)
    prompts = rand_prompts(41, [4, 17, 9, 30, 12, 6, 21, 8])
    expected = token_ids(sequential(prompts, 12))
    wakeups = 0

    async def main():
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe

        def counting(*a, **kw):
            nonlocal wakeups
            wakeups += 1
            return real(*a, **kw)

        loop.call_soon_threadsafe = counting
        return await asyncio.gather(*(collect(llm, p, greedy(12, output_kind=Kind.DELTA), f"c{i}")
                                      for i, p in enumerate(prompts)))

    try:
        runs = asyncio.run(main())
        got = [[sum((o.outputs[0].token_ids for o in outs), [])] for outs in runs]
        assert got == expected
        st = llm.stats()
        assert st["max_running_seqs"] > 1, "the requests never shared a step"
        outputs = sum(len(outs) for outs in runs)
        # One wake-up of the event loop per engine step, not one per output (8 outputs a step).
        assert wakeups <= 2 * st["steps"] < outputs, (wakeups, st["steps"], outputs)
        assert_engine_idle(llm)
    finally:
        llm.shutdown()


# ------------------------------------------------------------------------------------------------
# 3. abort, and clients that go away
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("awaited", ["await", "create_task", "run_coroutine_threadsafe"])
def test_abort_ends_the_stream_with_finish_reason_abort(allm, awaited):
    aborted_before = allm.stats()["requests_aborted"]

    async def main():
        outs = []
        async for o in allm.generate(rand_prompts(42, [7])[0], greedy(100, output_kind=Kind.DELTA), "ab"):
            outs.append(o)
            if len(outs) == 1:  # vLLM's abort is a coroutine: each way of running one works
                if awaited == "await":
                    assert await allm.abort("ab") is None
                elif awaited == "create_task":
                    await asyncio.create_task(allm.abort("ab"))
                else:
                    loop = asyncio.get_running_loop()
                    done = await asyncio.to_thread(lambda: asyncio.run_coroutine_threadsafe(allm.abort("ab"), loop))
                    await asyncio.wrap_future(done)
        return outs

    outs = asyncio.run(main())
    last = outs[-1]
    assert last.finished and last.outputs[0].finish_reason == "abort"
    assert sum(len(o.outputs[0].token_ids) for o in outs) < 100
    assert allm.stats()["requests_aborted"] == aborted_before + 1
    assert_engine_idle(allm)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_an_aborted_delta_streams_pieces_add_up_to_what_it_generated(llama_path, sequential, overlap):
    """With overlap, the step whose outputs are pending when the abort comes still reports them,
    before the abort's own output: the pieces add up to the tokens generated (they were one step
    short), a prefix of the request's greedy output."""
    llm = make_async_llm(llama_path, overlap=overlap)
    prompt = rand_prompts(43, [9])[0]
    expected = token_ids(sequential([prompt], 60))[0][0]

    async def main():
        outs = []
        async for o in llm.generate(prompt, greedy(60, output_kind=Kind.DELTA), "cut"):
            outs.append(o)
            if len(outs) == 6:
                await llm.abort("cut")
        return outs

    try:
        for _ in range(3):
            outs = asyncio.run(main())
            streamed = [t for o in outs for t in o.outputs[0].token_ids]
            assert outs[-1].outputs[0].finish_reason == "abort"
            assert len(streamed) == outs[-1].metrics.num_generation_tokens >= 6
            assert streamed == expected[:len(streamed)]
        assert_engine_idle(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("ids", [lambda d: d.keys(), lambda d: (k for k in d), lambda d: map(str, d)],
                         ids=["dict_keys", "generator", "map"])
def test_abort_takes_any_iterable_of_ids(allm, ids):
    """vLLM's ``abort(request_id: str | Iterable[str])``: each id of any iterable is aborted."""
    async def main():
        streams = {rid: allm.generate(p, greedy(100, output_kind=Kind.DELTA), rid)
                   for rid, p in zip(("it-a", "it-b"), rand_prompts(43, [5, 6]))}
        firsts = [await anext(g) for g in streams.values()]
        await allm.abort(ids(streams))
        return [(firsts[i], [o async for o in g]) for i, g in enumerate(streams.values())]

    for first, rest in asyncio.run(main()):
        last = rest[-1] if rest else first
        assert last.finished and last.outputs[0].finish_reason == "abort"
    assert_engine_idle(allm)


@pytest.mark.parametrize("how", ["aclose", "cancel"])
def test_a_client_that_goes_away_aborts_its_request_and_frees_its_blocks(allm, how):
    aborted_before = allm.stats()["requests_aborted"]

    async def main():
        first = asyncio.Event()
        gen = allm.generate(rand_prompts(43, [40])[0], greedy(100, output_kind=Kind.DELTA), f"gone-{how}")

        async def consume():
            async for _ in gen:
                first.set()

        task = asyncio.ensure_future(consume())
        await first.wait()
        assert allm.engine.num_free_blocks < allm.stats()["num_blocks"] - 1  # it holds blocks now
        if how == "cancel":
            task.cancel()  # as Starlette cancels a stream whose client disconnected
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await gen.aclose()
        await probe(allm, f"probe-{how}")

    asyncio.run(main())
    assert allm.stats()["requests_aborted"] == aborted_before + 1
    assert_engine_idle(allm)


def test_an_abandoned_generator_is_aborted_when_closed(allm):
    """A generator closed before it was iterated to the end, by the consumer leaving its loop."""
    aborted_before = allm.stats()["requests_aborted"]

    async def main():
        gen = allm.generate(rand_prompts(44, [5])[0], greedy(100, output_kind=Kind.CUMULATIVE), "left")
        async for o in gen:
            assert not o.finished
            break
        await gen.aclose()
        await probe(allm, "probe-left")

    asyncio.run(main())
    assert allm.stats()["requests_aborted"] == aborted_before + 1
    assert_engine_idle(allm)


def test_a_stream_left_as_its_event_loop_closes_logs_no_error(allm, caplog):
    """The usual end of an early ``break`` (or a Ctrl-C) under ``asyncio.run``: the request's
    final output comes after its event loop closed. It is dropped quietly, not logged as a
    failed sink."""
    import time

    async def main():
        async for _ in allm.generate(rand_prompts(45, [5])[0], greedy(100, output_kind=Kind.DELTA), "gone"):
            return

    with caplog.at_level("ERROR", logger="ferrokv"):
        asyncio.run(main())
        deadline = time.monotonic() + 30
        while allm.num_in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        asyncio.run(probe(allm, "probe-gone"))  # a request after it: its abort was applied before
    assert not [r for r in caplog.records if r.levelname == "ERROR"], [r.getMessage() for r in caplog.records]
    assert_engine_idle(allm)


@pytest.mark.parametrize("closed_with_a_drain_scheduled", [False, True])
def test_streams_of_an_event_loop_closed_with_them_open_are_aborted_and_uncounted(allm, closed_with_a_drain_scheduled):
    """An event loop closed with its generate() tasks still pending (not cancelled: their
    ``finally`` never runs): nobody will read those requests, so they are aborted, and their ends
    give back what num_in_flight counted (the server's admission and drain read it). Also when the
    loop, stopped, was sent a drain of outputs before it closed: the drain never runs (review22:
    the dispatcher then waited for it forever, and the requests ran on, counted)."""
    import gc
    import time

    started: list[str] = []

    async def consume(rid):
        async for _ in allm.generate(rand_prompts(46, [6])[0], greedy(100), rid):
            started.append(rid)

    async def until_each_streams():
        while len(set(started)) < 3:
            await asyncio.sleep(0.001)

    aborted = allm.stats()["requests_aborted"]
    loop = asyncio.new_event_loop()
    for i in range(3):
        loop.create_task(consume(f"left{i}"))
    loop.run_until_complete(until_each_streams())
    if closed_with_a_drain_scheduled:
        deadline = time.monotonic() + 30
        while not any(d._pending for d in list(allm._dispatchers.values())) and time.monotonic() < deadline:
            time.sleep(0.001)
        assert any(d._pending for d in list(allm._dispatchers.values()))
    loop.close()
    del loop
    gc.collect()
    deadline = time.monotonic() + 30
    while (allm.num_in_flight or allm.engine.has_unfinished_requests()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert allm.stats()["requests_aborted"] - aborted == 3
    assert_engine_idle(allm)
    asyncio.run(probe(allm, "left0"))  # the ids are free again


def test_a_generator_dropped_after_its_event_loop_closed_gives_its_count_back(allm):
    """Its request ended while the loop ran (the final output queued, unread); the loop closed and
    the generator was dropped, its ``finally`` never run: num_in_flight still comes back to 0."""
    import gc
    import time

    async def first_then_wait():
        g = allm.generate(rand_prompts(47, [4])[0], greedy(3), "dropped")
        await anext(g)
        while allm.engine.has_unfinished_requests():  # the request ends; its last outputs stay queued
            await asyncio.sleep(0.005)
        return g

    loop = asyncio.new_event_loop()
    g = loop.run_until_complete(first_then_wait())
    loop.close()
    del g, loop
    gc.collect()
    deadline = time.monotonic() + 10
    while allm.num_in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert_engine_idle(allm)
    asyncio.run(probe(allm, "dropped"))  # the id is free again


def test_a_request_that_ended_while_its_stopped_loop_was_sent_its_last_outputs_gives_its_count_back(allm):
    """The loop stopped with the generator open; the request then ended, its last outputs sent to
    the loop in a drain that never runs (the loop closes): no later output will come to hand them
    to anyone, yet num_in_flight comes back to 0 (review22)."""
    import gc
    import time

    started: list = []

    async def consume():  # left awaiting its next output: its waiter holds the loop
        async for out in allm.generate(rand_prompts(48, [4])[0], greedy(4), "stranded"):
            started.append(out)

    async def until_it_streams():
        while not started:
            await asyncio.sleep(0.001)

    loop = asyncio.new_event_loop()
    loop.create_task(consume())
    loop.run_until_complete(until_it_streams())
    deadline = time.monotonic() + 30
    while allm.engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.005)
    loop.close()
    del loop
    gc.collect()
    assert allm.num_in_flight == 0
    assert_engine_idle(allm)
    asyncio.run(probe(allm, "stranded"))  # the id is free again


def test_requests_that_end_normally_leave_nothing_for_the_dropped_streams_collector(allm):
    """The finalizer that catches streams dropped unreleased keeps nothing for the others: a
    program that never reads num_in_flight does not grow by one entry per request."""
    import gc

    async def main():
        for i in range(20):
            await collect(allm, {"prompt_token_ids": [5, 6, 7]}, greedy(2), f"normal{i}")

    asyncio.run(main())
    gc.collect()
    assert allm._dropped.qsize() == 0
    assert_engine_idle(allm)


# ------------------------------------------------------------------------------------------------
# 4. bad input: the request's error, the others go on
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt, params, match", [
    ({"prompt_token_ids": list(range(3, 200))}, greedy(4), "max_model_len"),
    ({"prompt_token_ids": [3, 99999]}, greedy(4), r"prompt_token_ids\[1\]=99999"),
    ({"prompt_token_ids": []}, greedy(4), "empty"),
    ("lone \ud800 surrogate", greedy(4), "surrogate"),
    (42, greedy(4), "prompt must be"),
    ({"prompt_token_ids": [3, 4]}, greedy(4, n=1000), "n=1000"),
    ({"prompt_token_ids": [3, 4]}, "not params", "sampling_params"),
])
def test_bad_input_raises_value_error_and_other_requests_go_on(allm, sequential, prompt, params, match):
    good = rand_prompts(45, [6])[0]

    async def main():
        ok = asyncio.ensure_future(collect(allm, good, greedy(8, output_kind=Kind.FINAL_ONLY), "good"))
        with pytest.raises(ValueError, match=match):
            await collect(allm, prompt, params, "bad")
        return await ok

    outs = asyncio.run(main())
    assert token_ids(outs) == token_ids(sequential([good], 8))
    assert_engine_idle(allm)


def test_a_request_id_in_use_is_refused_without_touching_the_first(allm, sequential):
    prompt = rand_prompts(46, [8])[0]

    async def main():
        first = allm.generate(prompt, greedy(6, output_kind=Kind.DELTA), "dup")
        outs = [await anext(first)]
        with pytest.raises(ValueError, match="already in use"):
            await collect(allm, prompt, greedy(6), "dup")
        outs += [o async for o in first]
        return outs

    outs = asyncio.run(main())
    assert sum((o.outputs[0].token_ids for o in outs), []) == token_ids(sequential([prompt], 6))[0][0]
    assert outs[-1].outputs[0].finish_reason == "length"
    assert_engine_idle(allm)


def test_a_refused_duplicate_that_is_cancelled_does_not_abort_the_first(allm, sequential):
    """The duplicate is refused at submit, so its caller never holds the id: cancelling or
    closing it cannot abort the request that owns the id."""
    prompt = rand_prompts(47, [8])[0]

    async def main():
        first = allm.generate(prompt, greedy(6, output_kind=Kind.DELTA), "dup2")
        outs = [await anext(first)]
        second = allm.generate(prompt, greedy(6), "dup2")
        task = asyncio.ensure_future(anext(second))
        await asyncio.sleep(0)  # the duplicate is submitted (and refused) ...
        task.cancel()  # ... and its caller goes away
        await asyncio.gather(task, return_exceptions=True)
        await second.aclose()
        outs += [o async for o in first]
        return outs

    outs = asyncio.run(main())
    assert outs[-1].outputs[0].finish_reason == "length"
    assert sum((o.outputs[0].token_ids for o in outs), []) == token_ids(sequential([prompt], 6))[0][0]
    assert_engine_idle(allm)


@pytest.mark.parametrize("how", ["wait_for", "cancel", "aclose"])
def test_a_request_retried_under_its_id_right_after_the_caller_gave_up_runs(allm, sequential, how):
    """vLLM's retry pattern: a request whose caller timed out, was cancelled or closed its stream
    is aborted, and its id may be given again at once; the retry waits in the loop for the old
    request's end, then runs as if alone (the old one's abort output never reaches it)."""
    prompt = rand_prompts(48, [8])[0]
    aborted_before = allm.stats()["requests_aborted"]

    async def main():
        gen = allm.generate(prompt, greedy(10_000, output_kind=Kind.DELTA), f"retry-{how}")
        if how == "wait_for":
            # A caller whose wait for the next output times out: the timeout cancels the
            # generator where it waits, which ends it. (A timeout that lands in the caller's own
            # code instead leaves the generator open, and its request running, until it is closed.)
            await anext(gen)
            with pytest.raises(asyncio.TimeoutError):
                while True:
                    await asyncio.wait_for(anext(gen), timeout=1e-4)
        elif how == "cancel":
            task = asyncio.ensure_future(anext(gen))
            await task
            task = asyncio.ensure_future(anext(gen))
            await asyncio.sleep(0)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await gen.aclose()
        else:
            await anext(gen)
            await gen.aclose()
        return await collect(allm, prompt, greedy(6), f"retry-{how}")  # at once: no "already in use"

    outs = asyncio.run(main())
    assert outs[-1].finished and all(not o.finished for o in outs[:-1])
    # No abort output reaches the retry. (How many outputs it gets depends on load: a lagging
    # consumer of CUMULATIVE outputs receives only the latest.)
    assert [o.outputs[0].finish_reason for o in outs] == [None] * (len(outs) - 1) + ["length"]
    assert len(outs[-1].outputs[0].token_ids) == 6
    assert token_ids([outs[-1]]) == token_ids(sequential([prompt], 6))
    # (the timed-out one may have ended in the engine already; its consumer just never read it)
    aborted = allm.stats()["requests_aborted"] - aborted_before
    assert aborted <= 1 if how == "wait_for" else aborted == 1
    assert_engine_idle(allm)


def test_an_aborted_id_may_be_given_again_at_once(allm, sequential):
    """vLLM frees an aborted request's id as its abort returns: a retry under it runs at once (it
    waits in the loop for the aborted request's end), and the aborted stream still ends with
    finish_reason "abort"."""
    prompt = rand_prompts(49, [8])[0]

    async def main():
        first = allm.generate(prompt, greedy(10_000, output_kind=Kind.DELTA), "again")
        await anext(first)
        await allm.abort("again")
        retry = asyncio.ensure_future(collect(allm, prompt, greedy(6), "again"))  # no "already in use"
        rest = [o async for o in first]
        return rest, await retry

    rest, outs = asyncio.run(main())
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    assert [o.outputs[0].finish_reason for o in outs] == [None] * (len(outs) - 1) + ["length"]
    assert token_ids([outs[-1]]) == token_ids(sequential([prompt], 6))
    assert_engine_idle(allm)


def test_retries_given_up_in_turn_each_end_and_the_last_runs(allm, sequential):
    """Give up, retry, give up on the retry while it still waits for the first, retry again: the
    waiting retry is added and aborted at once (nothing runs for it), the last one runs, and every
    claim on the id ends."""
    prompt = rand_prompts(49, [6])[0]

    async def main():
        for _ in range(2):
            gen = allm.generate(prompt, greedy(10_000, output_kind=Kind.DELTA), "turns")
            await anext(gen)
            await gen.aclose()
        gen = allm.generate(prompt, greedy(10_000, output_kind=Kind.DELTA), "turns")
        await gen.aclose()  # never read: given up before it started
        outs = await collect(allm, prompt, greedy(4), "turns")
        return outs

    outs = asyncio.run(main())
    assert token_ids([outs[-1]]) == token_ids(sequential([prompt], 4))
    assert not allm.engine_loop.holding({"turns"})
    assert_engine_idle(allm)


def test_ids_the_engine_makes_never_match_a_callers(allm):
    async def main():
        mine = asyncio.ensure_future(collect(allm, {"prompt_token_ids": [5, 6]}, greedy(4), "1"))
        auto = [o async for o in allm.generate({"prompt_token_ids": [7, 8]}, greedy(4))]
        return await mine, auto

    mine, auto = asyncio.run(main())
    assert mine[-1].request_id == "1" and auto[-1].request_id not in ("1", "2")
    assert auto[-1].outputs[0].finish_reason == "length"
    assert_engine_idle(allm)


@pytest.mark.parametrize("bad", [None, 1.5, b"\x01\x02", True, ("a", 1)])
def test_a_request_id_that_is_not_a_str_or_an_int_is_refused_by_generate_and_abort(allm, bad):
    async def main():
        with pytest.raises(ValueError, match="request_id must be a str"):
            await collect(allm, {"prompt_token_ids": [5, 6]}, greedy(2), bad)

    if bad is not None:  # generate's None means "make one"
        asyncio.run(main())
    if not isinstance(bad, tuple):  # a tuple is several ids to abort, each checked
        with pytest.raises(ValueError, match="request_id must be a str"):
            allm.abort(bad)
    with pytest.raises(ValueError, match="request_id must be a str"):
        allm.abort(["ok", bad] if not isinstance(bad, tuple) else [bad])
    assert_engine_idle(allm)


def test_a_chat_template_that_refuses_the_conversation_is_a_value_error(allm):
    tok = allm.tokenizer
    template = tok.chat_template
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}"
                         "{% endif %}{{ m['content'] }}{% endfor %}")
    try:
        with pytest.raises(ValueError, match=r"messages: .*refused.*no tools here"):
            asyncio.run(allm.encode_chat([{"role": "tool", "content": "x"}]))
        assert asyncio.run(allm.encode_chat([{"role": "user", "content": "the cat"}])) == tok.encode("the cat")
    finally:
        tok.chat_template = template


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt, SystemExit])
def test_a_failed_step_ends_each_request_with_an_engine_generate_error_of_its_own(llama_path, sequential, error):
    """vLLM's ``EngineGenerateError`` from the step's exception; each caller raises its own
    object, so no traceback collects the other callers' frames; the engine goes on. A
    ``KeyboardInterrupt`` or ``SystemExit`` from the model code (on the loop's thread: Ctrl-C never
    lands there) is such a failure too, not one that would end each caller's event loop."""
    from ferrokv.engine_loop import EngineGenerateError

    llm = make_async_llm(llama_path)
    RunnerHook(llm.engine, raise_on(2, error("boom")))
    prompts = rand_prompts(53, [5, 6, 7, 8])

    async def one(i: int) -> BaseException:
        with pytest.raises(EngineGenerateError, match=rf"failed engine step \({error.__name__}: boom\)") as info:
            await collect(llm, prompts[i], greedy(4), f"f{i}")
        return info.value

    async def main():
        return await asyncio.gather(*(one(i) for i in range(len(prompts))))

    try:
        errors = asyncio.run(main())
        assert len({id(e) for e in errors}) == len(prompts)
        assert all(isinstance(e.__cause__, error) and str(e.__cause__) == "boom" for e in errors)
        assert all(sum(f.name == "one" for f in traceback.extract_tb(e.__traceback__)) == 1 for e in errors)
        assert asyncio.run(collect(llm, prompts[0], greedy(4), "after"))[-1].outputs[0].token_ids == \
            sequential(prompts[:1], 4)[0].outputs[0].token_ids
    finally:
        llm.shutdown()


def test_a_keyboard_interrupt_while_the_loop_adds_a_request_is_that_requests_error_only(allm, monkeypatch):
    """Raised by engine code on the loop's thread (Ctrl-C never lands there), it must not reach
    the caller's event loop raw: an EngineGenerateError; the next request runs."""
    from ferrokv.engine_loop import EngineGenerateError

    add, calls = allm.engine.add_request, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt("in the add")
        return add(*args, **kwargs)

    monkeypatch.setattr(allm.engine, "add_request", interrupted)
    with pytest.raises(EngineGenerateError, match="KeyboardInterrupt"):
        asyncio.run(collect(allm, {"prompt_token_ids": [5, 6, 7]}, greedy(2), "kbi-add"))
    asyncio.run(probe(allm, "after-kbi-add"))
    assert_engine_idle(allm)


def test_shutdown_gives_each_waiter_an_engine_dead_error_of_its_own(llama_path):
    llm = make_async_llm(llama_path)
    started = threading.Event()
    RunnerHook(llm.engine, lambda n, out: started.set())

    async def one(i: int) -> BaseException:
        with pytest.raises(EngineDeadError, match="shut down") as info:
            await collect(llm, rand_prompts(60 + i, [5])[0], greedy(200), f"d{i}")
        return info.value

    async def main():
        tasks = [asyncio.create_task(one(i)) for i in range(3)]
        await asyncio.get_running_loop().run_in_executor(None, started.wait)
        await asyncio.get_running_loop().run_in_executor(None, functools.partial(llm.shutdown, timeout=30.0))
        return await asyncio.gather(*tasks)

    errors = asyncio.run(main())
    assert len({id(e) for e in errors}) == 3


def test_unknown_engine_argument_is_a_type_error():
    with pytest.raises(TypeError, match="max_num_sequences"):
        AsyncLLM("unused", max_num_sequences=4)


# ------------------------------------------------------------------------------------------------
# 5. shutdown
# ------------------------------------------------------------------------------------------------
def test_shutdown_ends_requests_in_flight_and_refuses_new_ones(llama_path):
    llm = make_async_llm(llama_path)

    async def main():
        gen = llm.generate(rand_prompts(47, [5])[0], greedy(100, output_kind=Kind.DELTA), "s")
        await anext(gen)
        assert llm.is_running
        await asyncio.get_running_loop().run_in_executor(None, functools.partial(llm.shutdown, timeout=30.0))
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in gen:
                pass
        with pytest.raises(EngineDeadError):
            await collect(llm, "x", greedy(2), "after")

    asyncio.run(main())
    assert not llm.is_running and llm.num_in_flight == 0
    assert llm.errored and llm.is_stopped and "shut down" in str(llm.dead_error)
    with pytest.raises(EngineDeadError, match="shut down"):
        asyncio.run(llm.check_health())
    llm.shutdown()  # idempotent


def test_a_request_still_waiting_for_the_tokenizer_pool_ends_with_engine_dead_at_shutdown(llama_path):
    """Shutdown cancels the pool's queued work: a request whose prompt waited there raises the
    engine's EngineDeadError (as every other request does), not a CancelledError that a server
    would take for a client that went away."""
    llm = AsyncLLM(str(llama_path), tokenizer_threads=1, **{k: v for k, v in engine_kwargs(llama_path).items()
                                                            if k != "model"})
    gate = threading.Event()

    async def main():
        busy = asyncio.get_running_loop().run_in_executor(llm._pool, gate.wait)  # the one worker
        task = asyncio.ensure_future(collect(llm, "a text prompt", greedy(2), "queued"))
        while llm._pool._work_queue.qsize() == 0:  # the prompt waits behind the busy worker
            await asyncio.sleep(0)
        llm.shutdown()
        gate.set()
        await busy
        with pytest.raises(EngineDeadError, match="shut down"):
            await task

    asyncio.run(main())


def test_vllm_engine_client_queries(allm):
    """What code written against vLLM's EngineClient awaits."""

    async def main():
        await allm.check_health()
        assert await allm.get_tokenizer() is allm.tokenizer is allm.engine.tokenizer
        assert await allm.reset_prefix_cache() is True
        await allm.abort("no-such-request")
        assert await allm.tokenize_text("the cat") == allm.tokenizer.encode("the cat")
        # vLLM's encode runs pooling models: refused by name, whichever way it is called.
        for kind in (ValueError, NotImplementedError):  # vLLM's on a generative model; ferrokv's before
            with pytest.raises(kind, match="encode runs pooling models"):
                allm.encode("the cat", None, "pool-1")
        # What ferrokv has none of: the true answer, or a refusal naming it (never AttributeError).
        assert (await allm.is_sleeping(), await allm.is_paused(), await allm.list_loras()) == (False, False, set())
        assert await allm.reset_mm_cache() is None and await allm.remove_lora(1) is False
        assert await allm.reset_encoder_cache() is None and await allm.pin_lora(1) is False
        mc = allm.model_config
        assert (mc.runner_type, mc.served_model_name, mc.get_diff_sampling_param()) == ("generate", mc.model, {})
        with pytest.raises(ValueError, match="LoRA adapters are not supported"):
            await allm.add_lora(object())
        for call, name in [(allm.sleep(), "sleep"), (allm.wake_up(), "wake_up"), (allm.pause_generation(), "pause"),
                           (allm.resume_generation(), "resume"), (allm.start_profile(), "profile"),
                           (allm.stop_profile(), "profile"), (allm.collective_rpc("m"), "collective_rpc"),
                           (allm.get_vllm_config(), "VllmConfig")]:
            with pytest.raises(NotImplementedError, match=name):
                await call
        return allm.get_default_sampling_params()

    assert asyncio.run(main()) == SamplingParams()
    assert not allm.errored and not allm.is_stopped and allm.is_running


def test_an_abort_left_unawaited_is_applied_and_warns_nothing(allm):
    """The abort is queued when abort() is called; its coroutine is already done, so a caller
    that leaves it alone (ferrokv's earlier form) loses nothing and gets no 'never awaited'."""
    import gc
    import warnings

    async def main():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outs = []
            async for o in allm.generate(rand_prompts(44, [7])[0], greedy(100, output_kind=Kind.DELTA), "quiet"):
                outs.append(o)
                if len(outs) == 1:
                    allm.abort("quiet")
            gc.collect()
        return outs, [str(w.message) for w in caught]

    outs, warned = asyncio.run(main())
    assert outs[-1].outputs[0].finish_reason == "abort" and warned == []


def test_more_of_vllms_engine_client_surface(bos_model_dir):
    """model_config (and its coroutine), do_log_stats, tracing and tasks; generate's keywords
    (trace_headers, prompt_text, data_parallel_rank 0, tokenization_kwargs' add_special_tokens,
    here with a tokenizer that prepends a BOS); what ferrokv cannot do is a ValueError naming it."""
    allm = make_async_llm(bos_model_dir)
    prompt = "the cat"

    async def main():
        assert allm.model_config is allm.engine.model_config is await allm.get_model_config()
        assert allm.model_config.max_model_len == allm.max_model_len
        await allm.do_log_stats()
        assert await allm.is_tracing_enabled() is False and await allm.get_supported_tasks() == ("generate",)
        outs = {}
        for add in (True, False):
            async for o in allm.generate(prompt, greedy(2), f"tk-{add}", trace_headers={"traceparent": "x"},
                                         prompt_text=prompt, data_parallel_rank=0,
                                         tokenization_kwargs={"add_special_tokens": add}):
                outs[add] = o.prompt_token_ids
        async for o in allm.generate(prompt, greedy(2), "tk-cut", tokenization_kwargs={"truncate_prompt_tokens": 2}):
            outs["cut"] = o.prompt_token_ids
        for kw in ({"data_parallel_rank": 1}, {"tokenization_kwargs": {"truncation": True}}):
            with pytest.raises(ValueError, match=next(iter(kw)) if "rank" in str(kw) else "truncation"):
                async for _ in allm.generate(prompt, greedy(2), "bad", **kw):
                    pass
        with pytest.raises(ValueError, match="reset_running_requests"):
            await allm.reset_prefix_cache(reset_running_requests=True)
        return outs

    try:
        outs = asyncio.run(main())
        plain = allm.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        # a truncated text keeps its BOS, as the tokenizer truncates (vLLM's)
        assert outs == {True: [1, *plain], False: plain, "cut": [1, plain[-1]]}
        assert_engine_idle(allm)
    finally:
        allm.shutdown()


def test_async_engine_args_and_vllms_from_engine_args_keywords(llama_path):
    from ferrokv import AsyncEngineArgs

    args = AsyncEngineArgs(**engine_kwargs(str(llama_path)), enable_log_requests=True)
    with pytest.raises(ValueError, match="stat_loggers must be None or empty"):  # never silently dropped
        AsyncLLM.from_engine_args(args, stat_loggers=[lambda config, index: None])
    llm = AsyncLLM.from_engine_args(args, start_engine_loop=True, usage_context=None, stat_loggers=None)
    llm.shutdown()
    llm = AsyncLLM.from_engine_args(args, True, None, None)  # positionally too, as vLLM's (asyncllm8)
    try:
        async def main():
            return [o async for o in llm.generate("a dog", greedy(3), "x")][-1]

        assert asyncio.run(main()).finished
    finally:
        llm.shutdown()


# ------------------------------------------------------------------------------------------------
# 6. the serve command's own flags (checked before anything loads)
# ------------------------------------------------------------------------------------------------
def test_serve_flags_default_to_server_config():
    from ferrokv.cli import _parser
    from ferrokv.entrypoints.openai.server_config import ServerConfig

    args = _parser().parse_args(["serve"])
    d = ServerConfig()
    assert (args.host, args.port, args.max_body_bytes, args.max_waiting_requests, args.drain_timeout,
            args.log_prompts, args.api_key) == (d.host, d.port, d.max_body_bytes, d.max_waiting_requests,
                                               d.drain_timeout, d.log_prompts, d.api_key)
    assert d.host == "127.0.0.1"
    assert _parser().parse_args(["serve", "m", "--served-model-name", "a", "b"]).served_model_name == ["a", "b"]
    assert (args.allowed_origins, args.allowed_methods, args.allowed_headers, args.allow_credentials) == (
        d.allowed_origins, d.allowed_methods, d.allowed_headers, d.allow_credentials) == (["*"], ["*"], ["*"], False)
    flags = ("return_tokens_as_token_ids", "enable_force_include_usage", "enable_server_load_tracking")
    assert [getattr(args, f) for f in flags] == [getattr(d, f) for f in flags] == [False] * 3
    on = _parser().parse_args(["serve", *(f"--{f.replace('_', '-')}" for f in flags)])
    assert all(getattr(on, f) for f in flags)


@pytest.mark.parametrize("argv, needle", [
    (["--port", "70000"], "--port"),
    (["--max-body-bytes", "0"], "--max-body-bytes"),
    (["--max-waiting-requests", "-1"], "--max-waiting-requests"),
    (["--drain-timeout", "nan"], "--drain-timeout"),
    (["--api-key", ""], "--api-key"),
    (["--host", "256.1.1.1"], "--host '256.1.1.1'"),
    (["a", "--model", "b"], "given twice"),
    (["--max-num-seqs", "0"], "max_num_seqs"),
    (["--allowed-origins", "*"], "--allowed-origins: not JSON"),
    (["--allowed-headers", '{"a": 1}'], "--allowed-headers: a JSON list of strings is needed"),
    (["--served-model-name", "a", "./my-model"], "write the model first"),
])
def test_serve_bad_flags_exit_2_naming_the_flag(argv, needle, capsys):
    from ferrokv.cli import main

    try:
        rc = main(["serve", *argv])
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    assert rc == 2
    assert needle in capsys.readouterr().err


def test_serve_refuses_unusable_tls_files_and_a_template_that_does_not_parse_before_loading(tmp_path, capsys):
    from ferrokv.cli import main

    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    assert main(["serve", "--ssl-keyfile", str(junk), "--ssl-certfile", str(junk)]) == 2
    assert "--ssl-certfile" in capsys.readouterr().err
    key, cert = tmp_path / "enc.key", tmp_path / "enc.crt"
    made = subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-passout", "pass:secret", "-keyout",
                           str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost"], capture_output=True)
    if made.returncode == 0:  # (openssl is on every CI image we use; skip the case where it is not)
        assert main(["serve", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert)]) == 2
        assert "the key is encrypted" in capsys.readouterr().err
    assert main(["serve", "--chat-template", "{% for m in messages %}{{ m.content }"]) == 2
    assert "--chat-template: not a valid Jinja template (unexpected '}', line 1)" in capsys.readouterr().err
    # transformers' own tags parse (then the next check fails, before the model loads).
    ok = "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    assert main(["serve", "--chat-template", ok, "--max-num-seqs", "0"]) == 2
    assert "max_num_seqs" in capsys.readouterr().err


def test_event_loops_that_used_the_engine_are_freed_when_they_end(allm):
    """One asyncio.run per call (sync wrappers, a loop per thread): each loop, and the engine's
    dispatcher for it, is freed once it ends; the dispatcher must not keep its loop alive."""
    import gc

    async def once(i: int) -> None:
        outs = await collect(allm, {"prompt_token_ids": [5, 6, 7]}, greedy(1), f"loop-{i}")
        assert outs[-1].finished

    import weakref

    loops = []
    for i in range(20):
        loop = asyncio.new_event_loop()
        loop.run_until_complete(once(i))
        loop.close()
        loops.append(weakref.ref(loop))
        del loop
    gc.collect()
    assert len(allm._dispatchers) == 0
    assert [r() for r in loops] == [None] * 20
    assert_engine_idle(allm)


def test_closing_a_stream_whose_request_already_ended_leaves_a_newer_one_of_its_id_alone(allm, sequential):
    """A's request ends while its final output is still unread; B starts under the same id (it
    was free); closing A's stream then must not abort B (it aborted the id before)."""
    b_prompt = rand_prompts(50, [5])[0]

    async def main():
        gen_a = allm.generate(rand_prompts(51, [3])[0], greedy(2, output_kind=Kind.DELTA), "ended")
        await anext(gen_a)
        while allm.engine_loop.holding({"ended"}):  # A ended in the engine; its last output waits unread
            await asyncio.sleep(0.01)
        outs = []
        async for o in allm.generate(b_prompt, greedy(30, output_kind=Kind.DELTA), "ended"):
            outs.append(o)
            if len(outs) == 1:
                await gen_a.aclose()
        return outs

    outs = asyncio.run(main())
    assert outs[-1].outputs[0].finish_reason == "length"
    assert sum((o.outputs[0].token_ids for o in outs), []) == token_ids(sequential([b_prompt], 30))[0][0]
    assert_engine_idle(allm)


def test_a_fork_child_gets_engine_dead_for_text_prompts_too(llama_path):
    """A text prompt is tokenized on a pool whose threads a fork does not copy: the child must
    get EngineDeadError, not wait on the pool forever."""
    from ferrokv.engine_loop import EngineDeadError
    from helpers.fork import in_fork_child

    allm = make_async_llm(llama_path)

    async def one(prompt):
        return [o async for o in allm.generate(prompt, greedy(2), f"r-{len(str(prompt))}")][-1]

    def child() -> str:
        said = []
        for prompt in ("the cat", {"prompt_token_ids": [3, 4, 5]}):
            try:
                asyncio.run(one(prompt))
            except EngineDeadError as e:
                said.append(str(e))
        return "|".join(said)

    try:
        assert asyncio.run(one("a dog")).finished
        code, said = in_fork_child(child)
        assert code == 0 and said.count("os.fork()") == 2, (code, said)
        assert asyncio.run(one("a dog")).finished  # the parent goes on
    finally:
        allm.shutdown()
