"""The engine's text layer (``ferrokv.text``): the Rust one (in ``Scheduler.update``) and the
Python fallback give the same outputs; stop strings end sequences in the core, respect
``min_tokens`` and ``include_stop_str_in_output``, win over a length stop on the same token, and
never let text past them reach an output; no text state outlives its request."""

from __future__ import annotations

import pytest

import ferrokv.engine

from ferrokv.outputs import RequestOutputKind
from ferrokv.sampling_params import SamplingParams
from ferrokv.text import PythonText, RustText
from helpers.engine_faults import assert_idle, rand_prompts, tiny_engine

KINDS = list(RequestOutputKind)


@pytest.fixture(scope="module")
def llama_path(tiny_model_dir):
    return tiny_model_dir("llama", "llama")


def greedy(**kw) -> SamplingParams:
    base = dict(temperature=0.0, max_tokens=24, ignore_eos=True)
    base.update(kw)
    return SamplingParams(**base)


def engines(path):
    """An engine with the Rust text layer, and one built with the Python one (as for a
    tokenizer the Rust crate cannot load: nothing attached to its scheduler)."""
    rust = tiny_engine(path)
    assert isinstance(rust.text, RustText)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ferrokv.engine, "make_text_layer", lambda tokenizer, scheduler: PythonText(tokenizer))
        py = tiny_engine(path)
    assert isinstance(py.text, PythonText)
    return rust, py


def run(engine, requests):
    """Final outputs by request id, plus each request's DELTA pieces (when it streams)."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    final, pieces = {}, {rid: [] for rid, _, _ in requests}
    while engine.has_unfinished_requests():
        for o in engine.step():
            pieces[o.request_id].append(o)
            if o.finished:
                final[o.request_id] = o
    assert_idle(engine)
    assert engine.scheduler.text_state() == (0, 0)
    return final, pieces


def summary(o):
    return [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs]


def plain_texts(path, prompts, max_tokens=24):
    engine = tiny_engine(path)
    final, _ = run(engine, [(f"p{i}", p, greedy(max_tokens=max_tokens)) for i, p in enumerate(prompts)])
    return [final[f"p{i}"].outputs[0] for i in range(len(prompts))]


def test_rust_and_python_text_layers_agree(llama_path):
    prompts = rand_prompts(21, [4, 9, 13, 6, 17])
    plain = plain_texts(llama_path, prompts)
    requests = []
    for i, (p, c) in enumerate(zip(prompts, plain)):
        mid = c.text[len(c.text) // 3: len(c.text) // 3 + 3] or "x"  # a stop string that occurs
        for j, kw in enumerate([
            dict(stop=[mid]),
            dict(stop=[mid], include_stop_str_in_output=True),
            dict(stop=[mid, c.text[-2:] or "y"], min_tokens=6),
            dict(stop=[mid], skip_special_tokens=False, output_kind=RequestOutputKind.DELTA),
            dict(n=2, temperature=1.0, seed=i, stop=["e", "a"], output_kind=RequestOutputKind.CUMULATIVE),
        ]):
            requests.append((f"r{i}.{j}", p, greedy(**kw)))
    rust, py = engines(llama_path)
    got_rust, pieces_rust = run(rust, requests)
    got_py, pieces_py = run(py, requests)
    assert {k: summary(o) for k, o in got_rust.items()} == {k: summary(o) for k, o in got_py.items()}
    for rid in pieces_rust:
        assert [summary(o) for o in pieces_rust[rid]] == [summary(o) for o in pieces_py[rid]], rid
    stopped = [c for o in got_rust.values() for c in o.outputs if isinstance(c.stop_reason, str)]
    assert len(stopped) >= 10  # the stop strings really were hit


@pytest.mark.parametrize("layer", ["rust", "python"])
def test_stop_strings_span_tokens_respect_min_tokens_and_never_leak(llama_path, layer):
    prompt = rand_prompts(5, [7])[0]
    full = plain_texts(llama_path, [prompt], max_tokens=40)[0]
    rust, py = engines(llama_path)
    engine = rust if layer == "rust" else py
    # A stop string made of the end of one token's text and the start of the next one's.
    tok = engine.tokenizer
    pieces = [tok.decode(full.token_ids[:k]) for k in range(len(full.token_ids) + 1)]
    k = next(k for k in range(3, len(pieces) - 1) if len(pieces[k]) > len(pieces[k - 1]) + 1
             and len(pieces[k + 1]) > len(pieces[k]))
    stop = pieces[k][-1] + pieces[k + 1][len(pieces[k]):][:1]
    first = full.text.find(stop)
    assert 0 <= first
    reqs = [(f"{kind.name}", prompt, greedy(max_tokens=40, stop=[stop], output_kind=kind)) for kind in KINDS]
    reqs.append(("incl", prompt, greedy(max_tokens=40, stop=[stop], include_stop_str_in_output=True)))
    k_first = next(k for k, text in enumerate(pieces) if stop in text)  # tokens out when it completes
    reqs.append(("late", prompt, greedy(max_tokens=40, stop=[stop], min_tokens=k_first)))
    final, streamed = run(engine, reqs)
    for kind in KINDS:
        c = final[kind.name].outputs[0]
        assert (c.finish_reason, c.stop_reason) == ("stop", stop)
        # A DELTA output holds only what is new: its pieces add up to the text.
        joined = "".join(o.outputs[0].text for o in streamed[kind.name]) if kind == RequestOutputKind.DELTA \
            else c.text
        assert joined == full.text[:first]  # nothing past the stop string, ever
        assert all(full.text[:first].startswith(o.outputs[0].text) for o in streamed[kind.name]
                   if kind == RequestOutputKind.CUMULATIVE)
    assert final["incl"].outputs[0].text == full.text[:first + len(stop)]
    late = final["late"].outputs[0]
    # min_tokens: stop strings count only once more than min_tokens tokens are out, so the
    # occurrence completed by token k_first is passed over.
    assert len(late.token_ids) > k_first and late.text.startswith(full.text[:first + len(stop)])


@pytest.mark.parametrize("layer", ["rust", "python"])
def test_a_stop_string_completed_by_the_last_allowed_token_stops(llama_path, layer):
    prompts = rand_prompts(8, [5, 11, 6])
    fulls = plain_texts(llama_path, prompts, max_tokens=30)
    rust, py = engines(llama_path)
    engine = rust if layer == "rust" else py
    tok = engine.tokenizer
    reqs, want = [], {}
    for i, (p, full) in enumerate(zip(prompts, fulls)):
        for k in range(4, 30):
            before, upto = tok.decode(full.token_ids[:k - 1]), tok.decode(full.token_ids[:k])
            if len(upto) > len(before) and upto[-1] not in before and not upto.endswith("\ufffd"):
                reqs.append((f"q{i}", p, greedy(max_tokens=k, stop=[upto[-1]])))
                want[f"q{i}"] = (upto[:-1], upto[-1])
                break
    assert len(reqs) >= 2
    final, _ = run(engine, reqs)
    for rid, (text, stop) in want.items():
        c = final[rid].outputs[0]
        assert (c.finish_reason, c.stop_reason, c.text) == ("stop", stop, text), rid


def test_text_state_is_freed_by_every_ending(llama_path):
    rust, _ = engines(llama_path)
    prompts = rand_prompts(30, [6, 8, 10, 12])
    rust.add_request("length", prompts[0], greedy(max_tokens=3))
    rust.add_request("stop", prompts[1], greedy(max_tokens=30, stop=["a", "e", "o", " "]))
    rust.add_request("abort", prompts[2], greedy(max_tokens=30, n=3, temperature=1.0, seed=1))
    rust.add_request("waiting", prompts[3], greedy(max_tokens=30))
    rust.step()
    rust.step()
    assert rust.scheduler.text_state()[0] == 4
    rust.abort_request(["abort", "waiting"])
    while rust.has_unfinished_requests():
        rust.step()
    assert rust.scheduler.text_state() == (0, 0)
    assert_idle(rust)
