"""Output kinds and request metrics (``ferrokv.output_processor``), driven through ``LLMEngine``.

The same requests run once per ``RequestOutputKind``: ``FINAL_ONLY`` gets exactly one output per
request, when it finishes; ``DELTA`` pieces (tokens, text, logprobs) concatenate to the
``CUMULATIVE`` ones; no output copies the prompt; the timestamps are ordered.
"""

from __future__ import annotations

import time

import pytest

from ferrokv.outputs import RequestOutputKind
from ferrokv.sampling_params import SamplingParams
from helpers.engine_faults import assert_idle, rand_prompts, tiny_engine

KINDS = list(RequestOutputKind)


def params(kind: RequestOutputKind, **kw) -> SamplingParams:
    base = dict(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True, output_kind=kind)
    base.update(kw)
    return SamplingParams(**base)


def run(engine, kind: RequestOutputKind, **kw):
    """Every output of every step, per request id, for a fixed set of requests."""
    prompts = rand_prompts(11, [5, 17, 9])
    plist = [params(kind, **kw), params(kind, n=2, **kw), params(kind, logprobs=2, stop=["a"], **kw)]
    for i, (p, sp) in enumerate(zip(prompts, plist)):
        engine.add_request(f"r{i}", p, sp)
    seen: dict[str, list] = {f"r{i}": [] for i in range(len(prompts))}
    steps = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            seen[o.request_id].append(o)
        steps += 1
    assert_idle(engine)
    return seen, steps


@pytest.fixture(scope="module")
def runs(llama_path):
    engine = tiny_engine(llama_path)
    return {k: run(engine, k) for k in KINDS}, engine


def by_index(o):
    return {c.index: c for c in o.outputs}


def test_final_only_builds_one_output_per_request_when_it_finishes(runs):
    seen, steps = runs[0][RequestOutputKind.FINAL_ONLY]
    assert steps > 5
    for outs in seen.values():
        assert len(outs) == 1 and outs[0].finished
        assert all(c.finish_reason is not None for c in outs[0].outputs)


def test_delta_pieces_concatenate_to_the_cumulative_output(runs):
    results, _ = runs
    cum, _ = results[RequestOutputKind.CUMULATIVE]
    delta, _ = results[RequestOutputKind.DELTA]
    final, _ = results[RequestOutputKind.FINAL_ONLY]
    for rid in cum:
        want = by_index(cum[rid][-1])
        assert by_index(final[rid][-1]).keys() == want.keys()
        for i, c in want.items():
            pieces = [by_index(o)[i] for o in delta[rid] if i in by_index(o)]
            assert sum((p.token_ids for p in pieces), []) == c.token_ids, rid
            assert "".join(p.text for p in pieces) == c.text, rid
            assert pieces[-1].finish_reason == c.finish_reason and pieces[-1].stop_reason == c.stop_reason
            assert all(p.finish_reason is None for p in pieces[:-1])
            if c.logprobs is not None:
                got = sum((p.logprobs for p in pieces), [])
                assert len(got) == len(c.logprobs) == len(c.token_ids)
                for g, w in zip(got, c.logprobs):  # the runs batch differently: float noise only
                    assert list(g) == list(w)
                    assert [x.logprob for x in g.values()] == pytest.approx([x.logprob for x in w.values()], abs=1e-4)
            f = by_index(final[rid][-1])[i]
            assert (f.token_ids, f.text, f.finish_reason) == (c.token_ids, c.text, c.finish_reason)
        # Every step that gave the request a token gave it an output, and only the last is finished.
        assert [o.finished for o in delta[rid]] == [False] * (len(delta[rid]) - 1) + [True]


def test_a_stop_string_cuts_every_kind_alike(runs):
    results, _ = runs
    texts = {k: by_index(results[k][0]["r2"][-1])[0] for k in KINDS}
    c = texts[RequestOutputKind.CUMULATIVE]
    if c.finish_reason == "stop":
        assert c.stop_reason == "a" and "a" not in c.text
    for k in KINDS:
        assert (texts[k].finish_reason, texts[k].stop_reason) == (c.finish_reason, c.stop_reason)


def test_outputs_share_the_prompt_and_cumulative_ones_stay_as_built(llama_path):
    engine = tiny_engine(llama_path)
    prompt = rand_prompts(3, [6])[0]
    engine.add_request("c", prompt, params(RequestOutputKind.CUMULATIVE, max_tokens=5, logprobs=1))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert len(outs) == 5
    assert all(o.prompt_token_ids is outs[0].prompt_token_ids for o in outs)
    # Read after every step ran: each output still holds what it had when it was built (an
    # AsyncLLM consumer reads them while the engine's thread goes on), tokens and logprobs alike.
    full = outs[-1].outputs[0]
    for k, o in enumerate(outs, 1):
        c = o.outputs[0]
        assert c.token_ids == full.token_ids[:k] and c.logprobs == full.logprobs[:k]
        assert c.text == full.text[:len(c.text)]


def test_metrics_are_ordered_and_on_the_monotonic_clock(llama_path):
    engine = tiny_engine(llama_path)
    t0, w0 = time.monotonic(), time.time()
    engine.add_request("m", rand_prompts(4, [8])[0], params(RequestOutputKind.DELTA, max_tokens=4))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    t1 = time.monotonic()
    first, last = outs[0].metrics, outs[-1].metrics
    assert w0 <= first.arrival_time <= time.time()
    assert t0 <= last.queued_ts <= last.scheduled_ts <= last.first_token_ts <= last.last_token_ts \
        <= last.finished_ts <= t1
    assert last.first_token_latency == pytest.approx(last.first_token_ts - last.queued_ts)
    assert first.first_token_ts == last.first_token_ts  # recorded once
    assert [o.metrics.num_generation_tokens for o in outs] == [1, 2, 3, 4]


def test_output_kind_is_validated():
    for bad in (3, -1, "delta", True, 1.0):
        with pytest.raises(ValueError, match="output_kind"):
            SamplingParams(output_kind=bad)
    assert SamplingParams(output_kind=1).output_kind is RequestOutputKind.DELTA
