"""``SamplingParams.detokenize=False``: token ids only. Every output's text is ``""`` while its
token ids, finish reasons and logprob values equal the ``detokenize=True`` run's; streaming
kinds (CUMULATIVE, DELTA) still deliver tokens every step; logprobs' and prompt logprobs'
``decoded_token`` is None; with both text layers (Rust ``RustText`` and the Python fallback),
overlap on and off, aborts, and no text state left behind. Tiny llama, CPU, fp32.
"""
from __future__ import annotations

import pytest

import ferrokv.engine
from ferrokv import SamplingParams
from ferrokv.outputs import RequestOutputKind
from ferrokv.text import PythonText, RustText
from helpers.engine_faults import assert_idle, rand_prompts, run_requests, tiny_engine, tiny_llm

KINDS = list(RequestOutputKind)


def make_engine(path, layer: str, **kw):
    if layer == "rust":
        engine = tiny_engine(path, **kw)
        assert isinstance(engine.text, RustText)
        return engine
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ferrokv.engine, "make_text_layer", lambda tokenizer, scheduler: PythonText(tokenizer))
        engine = tiny_engine(path, **kw)
    assert isinstance(engine.text, PythonText)
    return engine


def run(engine, requests):
    """(final output by id, every output by id as ``tokens_view`` when it came, with its texts);
    the engine left idle, no text state. (A CUMULATIVE output's lists may grow after it came.)"""
    final, every = run_requests(engine, requests, lambda o: (tokens_view(o), [c.text for c in o.outputs], decoded(o)))
    assert_idle(engine)
    assert engine.scheduler.text_state() == (0, 0)
    if isinstance(engine.text, PythonText):
        assert not engine.text._requests and not engine.text._seqs and not engine.text._ended
    return final, every


def decoded(o) -> set:
    """The decoded_token values of an output's logprobs (None means not detokenized)."""
    return {lp.decoded_token is None for c in o.outputs for e in c.logprobs or () for lp in e.values()}


def tokens_view(o):
    """What must not depend on detokenize: per completion its token ids, reason and logprobs."""
    return [(c.index, list(c.token_ids), c.finish_reason, c.stop_reason,
             None if c.logprobs is None else [sorted((t, round(lp.logprob, 4), lp.rank) for t, lp in e.items())
                                              for e in c.logprobs],
             None if c.cumulative_logprob is None else round(c.cumulative_logprob, 4))
            for c in o.outputs]


def requests_for(detokenize: bool, stop_id: int):
    prompts = rand_prompts(40, [9, 17, 5])
    reqs = []
    for kind in KINDS:
        common = dict(detokenize=detokenize, output_kind=kind)
        reqs += [
            (f"g-{kind.name}", prompts[0], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                                          logprobs=2, **common)),
            (f"s-{kind.name}", prompts[1], SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=8,
                                                          ignore_eos=True, logprobs=0, **common)),
            (f"stop-{kind.name}", prompts[2], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                             stop_token_ids=[stop_id], **common)),
        ]
    return reqs


@pytest.mark.parametrize("overlap", [False, True], ids=["overlap-off", "overlap-on"])
@pytest.mark.parametrize("layer", ["rust", "python"])
def test_token_ids_without_text(llama_path, layer, overlap):
    probe = make_engine(llama_path, layer, overlap=overlap)
    plain, _ = run(probe, [("p", rand_prompts(40, [9, 17, 5])[2],
                            SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))])
    stop_id = plain["p"].outputs[0].token_ids[4]
    with_text, every_t = run(make_engine(llama_path, layer, overlap=overlap), requests_for(True, stop_id))
    no_text, every_n = run(make_engine(llama_path, layer, overlap=overlap), requests_for(False, stop_id))
    assert set(no_text) == set(with_text)
    for rid in with_text:
        assert tokens_view(no_text[rid]) == tokens_view(with_text[rid]), rid
        assert all(text == "" for _, texts, _ in every_n[rid] for text in texts), rid
        # Streaming: the same outputs at the same steps, carrying the same token ids.
        assert [v for v, _, _ in every_n[rid]] == [v for v, _, _ in every_t[rid]], rid
        assert all(d <= {True} for _, _, d in every_n[rid]), "no decoded_token without detokenize"
        assert all(d <= {False} for _, _, d in every_t[rid]), rid
    assert any(c.text for o in with_text.values() for c in o.outputs)  # the texts were not empty
    for kind, count in ((RequestOutputKind.CUMULATIVE, 10), (RequestOutputKind.DELTA, 10),
                        (RequestOutputKind.FINAL_ONLY, 1)):
        outs = [v for v, _, _ in every_n[f"g-{kind.name}"]]
        assert len(outs) == count, (kind, len(outs))
        if kind == RequestOutputKind.DELTA:
            assert all(len(v[0][1]) == 1 for v in outs), "one new token per step"
        if kind == RequestOutputKind.CUMULATIVE:
            assert [len(v[0][1]) for v in outs] == list(range(1, 11))
    stopped = no_text["stop-FINAL_ONLY"].outputs[0]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", stop_id)
    # Logprobs: no decoded tokens without detokenize; decoded ones with it.
    for rid, o in no_text.items():
        for c in o.outputs:
            for e in c.logprobs or ():
                assert all(lp.decoded_token is None for lp in e.values()), rid
    assert all(lp.decoded_token is not None for e in with_text["g-FINAL_ONLY"].outputs[0].logprobs
               for lp in e.values())


@pytest.mark.parametrize("layer", ["rust", "python"])
def test_mixed_with_text_requests(llama_path, layer):
    """detokenize=False next to text requests with stop strings: neither disturbs the other."""
    engine = make_engine(llama_path, layer)
    prompts = rand_prompts(41, [7, 12])
    alone, _ = run(engine, [("t", prompts[0], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))])
    text = alone["t"].outputs[0].text
    stop = next(ch for ch in text[3:] if ch.strip() and ch != "\ufffd")
    reqs = [
        ("t", prompts[0], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[stop],
                                         output_kind=RequestOutputKind.DELTA)),
        ("n", prompts[0], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, detokenize=False,
                                         output_kind=RequestOutputKind.DELTA)),
        ("m", prompts[1], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=15, detokenize=False,
                                         output_kind=RequestOutputKind.CUMULATIVE)),
    ]
    final, every = run(engine, reqs)
    t = final["t"].outputs[0]
    assert (t.finish_reason, t.stop_reason) == ("stop", stop)
    assert "".join(texts[0] for _, texts, _ in every["t"]) == text[:text.index(stop)]
    n = final["n"].outputs[0]
    assert n.text == "" and n.finish_reason == "length"
    assert [tok for v, _, _ in every["n"] for tok in v[0][1]] == list(alone["t"].outputs[0].token_ids)
    assert all(texts == [""] for _, texts, _ in every["n"])
    assert all(texts == [""] * 3 for _, texts, _ in every["m"]) and len(every["m"]) == 15
    assert len(final["m"].outputs) == 3 and all(c.text == "" and len(c.token_ids) == 15 for c in final["m"].outputs)


def test_prompt_logprobs_have_no_decoded_tokens(llama_path):
    engine = tiny_engine(llama_path)
    prompt = rand_prompts(42, [11])[0]
    params = dict(temperature=0.0, max_tokens=3, prompt_logprobs=2, logprobs=1)
    final, _ = run(engine, [("n", prompt, SamplingParams(detokenize=False, **params)),
                            ("t", prompt, SamplingParams(**params))])
    n, t = final["n"].prompt_logprobs, final["t"].prompt_logprobs
    assert len(n) == len(t) == 11 and n[0] is None
    for en, et in zip(n[1:], t[1:]):
        assert list(en) == list(et)
        assert all(lp.decoded_token is None for lp in en.values())
        assert all(lp.decoded_token is not None for lp in et.values())
        assert [(lp.logprob, lp.rank) for lp in en.values()] == [(lp.logprob, lp.rank) for lp in et.values()]


@pytest.mark.parametrize("layer", ["rust", "python"])
def test_abort_of_a_request_without_text(llama_path, layer):
    engine = make_engine(llama_path, layer)
    aborted = []
    engine.on_abort = aborted.append
    prompt = rand_prompts(43, [8])[0]
    engine.add_request("a", prompt, SamplingParams(n=2, temperature=1.0, seed=2, max_tokens=30, detokenize=False,
                                                   output_kind=RequestOutputKind.DELTA))
    engine.add_request("b", prompt, SamplingParams(temperature=0.0, max_tokens=6, detokenize=False))
    got = [o for _ in range(3) for o in engine.step()]
    assert got and all(c.text == "" for o in got for c in o.outputs)
    engine.abort_request("a")
    run(engine, [])
    assert len(aborted) == 1 and all(c.finish_reason == "abort" and c.text == "" for c in aborted[0].outputs)
    assert engine.scheduler.text_state() == (0, 0)


def test_llm_generate(llama_path):
    llm = tiny_llm(llama_path)
    prompt = rand_prompts(44, [6])[0]
    off, on = llm.generate([prompt, prompt], [SamplingParams(temperature=0.0, max_tokens=8, detokenize=False),
                                               SamplingParams(temperature=0.0, max_tokens=8)], use_tqdm=False)
    assert off.outputs[0].text == "" and on.outputs[0].text != ""
    assert off.outputs[0].token_ids == on.outputs[0].token_ids
    with pytest.raises(ValueError, match="detokenize"):
        llm.generate([prompt], SamplingParams(stop=["x"], detokenize=False), use_tqdm=False)
