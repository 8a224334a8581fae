"""The engine's text layer (``ferrokv.text``): the Rust one (in ``Scheduler.update``) and the
Python fallback give the same outputs; stop strings end sequences in the core, respect
``min_tokens`` and ``include_stop_str_in_output``, win over a length stop on the same token, and
never let text past them reach an output; no text state outlives its request. At the scheduler
level, a step's text may be deferred (``update(defer_text=True)`` / ``take_step_results``) and
run while the next step is in flight."""

from __future__ import annotations

import numpy as np
import pytest

import ferrokv.engine

from ferrokv._core import Scheduler, SchedulerStateError, TextModel, UnknownRequestError
from ferrokv.outputs import RequestOutputKind
from ferrokv.sampling_params import SamplingParams
from ferrokv.text import PythonText, RustText
from helpers.engine_faults import assert_idle, rand_prompts, tiny_engine
from helpers.text_oracle import final_text
from helpers.tiny_tokenizer import tiny_tokenizer

KINDS = list(RequestOutputKind)


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


@pytest.mark.parametrize("layer", ["rust", "python"])
def test_the_stop_token_is_in_the_text_only_with_include_stop_str_in_output(llama_path, layer):
    """vLLM's detokenizer leaves out the EOS or stop token id that ended a sequence unless
    include_stop_str_in_output; a special token then still obeys skip_special_tokens."""
    prompt = rand_prompts(9, [6])[0]
    full = plain_texts(llama_path, [prompt], max_tokens=12)[0]
    rust, py = engines(llama_path)
    engine = rust if layer == "rust" else py
    tok = engine.tokenizer
    k = next(k for k in range(2, 12) if tok.decode(full.token_ids[:k + 1]) != tok.decode(full.token_ids[:k])
             and full.token_ids[k] not in full.token_ids[:k])
    stop_id = full.token_ids[k]  # a token that adds text, first generated at position k
    eos = tok.convert_tokens_to_ids(tok.eos_token)
    reqs = []
    for incl in (False, True):
        reqs.append((f"id-{incl}", prompt, greedy(max_tokens=12, stop_token_ids=[stop_id],
                                                  include_stop_str_in_output=incl,
                                                  output_kind=RequestOutputKind.DELTA)))
        for skip in (True, False):  # the tiny model's greedy text never reaches EOS: allowed_token_ids forces it
            reqs.append((f"eos-{incl}-{skip}", prompt, greedy(max_tokens=3, ignore_eos=False, allowed_token_ids=[eos],
                                                              include_stop_str_in_output=incl,
                                                              skip_special_tokens=skip)))
    final, streamed = run(engine, reqs)
    for incl in (False, True):
        c, pieces = final[f"id-{incl}"].outputs[0], [o.outputs[0] for o in streamed[f"id-{incl}"]]
        assert (c.finish_reason, c.stop_reason) == ("stop", stop_id)
        assert sum((p.token_ids for p in pieces), []) == full.token_ids[:k + 1]  # DELTA: the pieces add up
        want = final_text(tok, full.token_ids[:k + 1] if incl else full.token_ids[:k])
        assert "".join(p.text for p in pieces) == want, incl
        for skip in (True, False):
            e = final[f"eos-{incl}-{skip}"].outputs[0]
            assert (e.finish_reason, e.token_ids) == ("stop", [eos])
            assert e.text == (tok.eos_token if incl and not skip else ""), (incl, skip, e.text)


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


def byte_level_char(b: int) -> str:
    """The character a byte-level BPE (GPT-2's table) writes byte ``b`` as."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    return chr(b) if b in printable else chr(256 + sorted(set(range(256)) - set(printable)).index(b))


def decode_stream_text(tok, prompt: list[int], out: list[int]) -> str:
    """vLLM V1's output text: tokenizers' DecodeStream primed with the prompt (none of the
    prompt's suffixes decodes clean when it ends mid-character, so vLLM primes with all of it)."""
    from tokenizers.decoders import DecodeStream

    stream = DecodeStream(skip_special_tokens=True)
    for t in prompt:
        stream.step(tok._tokenizer, t)
    return "".join(stream.step(tok._tokenizer, t) or "" for t in out)


@pytest.mark.parametrize("given", [1, 2, 3])
def test_a_character_the_prompt_ends_in_is_completed_by_the_output(llama_path, given):
    """A token-id prompt that stops inside a UTF-8 character (a continuation of a cut output):
    the output token that completes it emits the whole character, as vLLM's DecodeStream does."""
    tok = tiny_tokenizer()
    emoji = [tok.convert_tokens_to_ids(byte_level_char(b)) for b in "😀".encode()]
    prompt = tok.encode("Say hi ", add_special_tokens=False) + emoji[:given]
    reqs = [(f"r{i}", {"prompt_token_ids": prompt}, greedy(max_tokens=m, allowed_token_ids=[emoji[given]]))
            for i, m in enumerate([1, 3])]
    for engine in engines(llama_path):
        final, _ = run(engine, reqs)
        for rid, _, params in reqs:
            c = final[rid].outputs[0]
            assert c.token_ids == [emoji[given]] * params.max_tokens
            want = decode_stream_text(tok, prompt, c.token_ids)
            assert c.text == want, (type(engine.text).__name__, given, c.text, want)
            if given == 3:
                assert c.text.startswith("😀")


@pytest.mark.parametrize("shape", ["alone", "after-split-char", "after-stray-byte", "before-specials"])
def test_a_cut_character_is_completed_whatever_precedes_it_in_the_prompt(llama_path, shape):
    """The character is completed also when no prompt context decodes clean: the prompt is that
    character's bytes alone, or they follow another character's byte tokens, or six special
    tokens follow them; a stray byte before them is not output text (vLLM would show it)."""
    tok = tiny_tokenizer()

    def byte_ids(text: str, raw: bytes = b"") -> list[int]:
        return [tok.convert_tokens_to_ids(byte_level_char(b)) for b in raw or text.encode()]

    say, cut = tok.encode("Say hi ", add_special_tokens=False), byte_ids("𝄞")
    prompt, last, want = {
        "alone": (cut[:3], cut[3], "𝄞"),
        "after-split-char": (say + byte_ids("😀") + cut[:3], cut[3], "𝄞"),
        "after-stray-byte": (say + byte_ids("", b"\xff") + cut[:3], cut[3], "𝄞"),
        "before-specials": (say + byte_ids("é")[:1] + [tok.all_special_ids[1]] * 6, byte_ids("é")[1], "é"),
    }[shape]
    reqs = [("r", {"prompt_token_ids": prompt}, greedy(max_tokens=1, allowed_token_ids=[last]))]
    for engine in engines(llama_path):
        c = run(engine, reqs)[0]["r"].outputs[0]
        assert (c.token_ids, c.text) == ([last], want), (type(engine.text).__name__, c.text)


@pytest.mark.parametrize("spaces", [True, False])
def test_special_tokens_kept_in_the_text_as_vllms_fast_detokenizer(llama_path, spaces):
    """skip_special_tokens=False: each special token's content is in the text, with nothing
    between them, whatever spaces_between_special_tokens says (vLLM V1's DecodeStream, and its
    rule for False: an added token after another one is its content)."""
    from tokenizers.decoders import DecodeStream

    tok = tiny_tokenizer()
    added = {tid: t.content for tid, t in tok._tokenizer.get_added_tokens_decoder().items()}
    prompt = {"prompt_token_ids": tok.encode("Say hi", add_special_tokens=False)}
    allowed = [*tok.all_special_ids[:2], *tok.encode(" there", add_special_tokens=False)]
    params = greedy(max_tokens=12, temperature=1.0, seed=3, allowed_token_ids=allowed, skip_special_tokens=False,
                    spaces_between_special_tokens=spaces)
    for engine in engines(llama_path):
        final, _ = run(engine, [("s", prompt, params)])
        c = final["s"].outputs[0]
        stream, last_added, want = DecodeStream(skip_special_tokens=False), False, ""
        for t in prompt["prompt_token_ids"]:
            stream.step(tok._tokenizer, t)
        for t in c.token_ids:
            piece = stream.step(tok._tokenizer, t) or ""
            if not spaces and t in added and last_added:
                piece = added[t]
            last_added = t in added
            want += piece
        assert sum(a in added and b in added for a, b in zip(c.token_ids, c.token_ids[1:])) >= 1, c.token_ids
        assert c.text == want == tok.decode(c.token_ids, skip_special_tokens=False), (type(engine.text).__name__, c)


# ---------------------------------------------------------------------------------------------
# Deferred text at the scheduler level: update(defer_text=True), then take_step_results() while
# the next step is in flight (as the overlapped engine runs it).


def text_scheduler(num_blocks=64, **kw):
    """A scheduler with the Rust text layer of the tiny byte-level tokenizer."""
    tok = tiny_tokenizer()
    s = Scheduler(num_blocks, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
                  watermark=0.0, **kw)
    s.attach_text(TextModel(tok.backend_tokenizer.to_str()))
    return tok, s


def sample(out, outputs: dict[int, list[int]]) -> np.ndarray:
    """Each row samples the next token of its request's scripted output (by tokens out so far)."""
    return np.array([outputs[r][n] for r, n in zip(out.row_req_ids.tolist(), out.row_num_output.tolist())],
                    np.int64)


def assert_text_idle(s: Scheduler) -> None:
    s.check_invariants()
    assert not s.has_unfinished()
    assert s.num_free_blocks == s.num_blocks - 1
    assert s.text_state() == (0, 0)


def test_update_without_defer_text_gives_the_deferred_paths_records_and_refuses_untaken_results():
    """One path: ``update`` alone runs the step's text work before it returns, ending sequences on
    their stop strings with the same records as ``defer_text`` + ``take_step_results``."""
    def run(defer: bool) -> list[tuple]:
        tok, s = text_scheduler()
        ids = tok.encode(" the cat sees the red ball today.", add_special_tokens=False)
        prompt = tok.encode("Hello", add_special_tokens=False)
        s.add_request(1, prompt, 20, stop=["cat"])
        s.add_request(2, prompt, len(ids))
        outputs = {1: ids + ids, 2: ids}
        records = []
        while s.has_unfinished():
            out = s.schedule()
            if defer:
                assert s.update(out, sample(out, outputs), defer_text=True) == []
                records += s.take_step_results()[0]
            else:
                records += s.update(out, sample(out, outputs))
        assert_text_idle(s)
        return sorted((r.request_id, r.reason, r.stop_reason, r.output_token_ids, r.text) for r in records)

    inline = run(False)
    assert inline == run(True)
    assert [(r[0], r[1], r[2]) for r in inline] == [(1, "stop", "cat"), (2, "length", None)]
    assert inline[0][4] == " the " and inline[1][4] == " the cat sees the red ball today."

    tok, s = text_scheduler()
    s.add_request(1, tok.encode("Hello", add_special_tokens=False), 4)
    out = s.schedule()
    s.update(out, sample(out, {1: [5] * 4}), defer_text=True)
    nxt = s.schedule()
    with pytest.raises(SchedulerStateError, match="take_step_results"):
        s.update(nxt, sample(nxt, {1: [5] * 4}))
    assert len(s.take_step_results()[0]) == 0
    assert s.update(nxt, sample(nxt, {1: [5] * 4})) == []


def test_a_stop_string_in_deferred_text_ends_its_sequence_while_the_next_step_is_in_flight():
    tok, s = text_scheduler()
    ids = tok.encode(" the cat sees the red ball today.", add_special_tokens=False)
    k = next(k for k in range(1, len(ids) + 1) if "cat" in tok.decode(ids[:k]))  # tokens out at the stop
    prompt = tok.encode("Hello", add_special_tokens=False)
    s.add_request(1, prompt, 20, stop=["dog", "cat"])
    s.add_request(2, prompt, len(ids), stream_text=True)  # the same text, no stop strings
    outputs = {1: ids + [tok.encode(" x", add_special_tokens=False)[0]] * 20, 2: ids}
    records, streamed, stop_in_flight = [], [], False
    out = s.schedule()
    while True:
        assert s.update(out, sample(out, outputs), defer_text=True) == []
        nxt = s.schedule() if s.has_unfinished() else None  # the next step, in flight
        recs, rows, deltas = s.take_step_results()
        assert len(rows) == len(deltas) and all(out.row_req_ids[r] == 2 for r in rows.tolist())
        streamed += deltas
        for rec in recs:
            if rec.request_id == 1:
                stop_in_flight = nxt is not None and 1 in nxt.row_req_ids.tolist()
        records += recs
        if nxt is None:
            break
        out = nxt
    assert stop_in_flight, "the stop string was found while request 1's next step was in flight"
    by_req = {r.request_id: r for r in records}
    assert len(records) == 2 == len(by_req), records
    r1, r2 = by_req[1], by_req[2]
    assert (r1.reason, r1.stop_str_index, r1.stop_reason, r1.request_finished) == ("stop", 1, "cat", True)
    assert r1.output_token_ids == ids[:k], "the step in flight at the stop added nothing"
    assert r1.text == tok.decode(ids[:k]).split("cat")[0]
    assert (r2.reason, r2.output_token_ids, r2.text) == ("length", ids, tok.decode(ids))
    assert "".join(streamed) + r2.text_delta == r2.text
    with pytest.raises(UnknownRequestError):
        s.request_seq_ids(1)
    assert_text_idle(s)


def test_abort_between_a_deferred_update_and_take_step_results_processes_the_deferred_text_first():
    tok, s = text_scheduler()
    ids = tok.encode(" a dog reads a long story again!", add_special_tokens=False)
    prompt = tok.encode("Hi", add_special_tokens=False)
    s.add_request(1, prompt, 20)
    s.add_request(2, prompt, 3)
    outputs = {1: ids, 2: ids}
    for i in range(3):
        out = s.schedule()
        s.update(out, sample(out, outputs), defer_text=True)
        if i < 2:
            assert s.take_step_results()[0] == []
    # Step 3's text is deferred: request 2 ended in it, request 1 got its third token.
    (aborted,) = s.abort(1)
    assert (aborted.request_id, aborted.reason, aborted.output_token_ids) == (1, "abort", ids[:3])
    assert aborted.text == tok.decode(ids[:3]), "the deferred token is in the aborted text"
    records, rows, deltas = s.take_step_results()
    assert [(r.request_id, r.reason, r.output_token_ids, r.text) for r in records] == [
        (2, "length", ids[:3], tok.decode(ids[:3]))
    ]
    assert rows.size == 0 and deltas == []
    assert s.take_step_results()[0] == []
    assert_text_idle(s)


def test_a_stop_string_in_deferred_text_of_one_of_n_samples_then_a_cancelled_step_goes_on():
    tok, s = text_scheduler()
    ids = tok.encode(" the cat sees the red ball today.", add_special_tokens=False)
    other = tok.encode(" a dog reads a long story again!", add_special_tokens=False)
    s.add_request(1, tok.encode("Hello", add_special_tokens=False), 10, n=2, temperature=1.0, stop=["cat"])
    scripts = {0: ids, 1: other}  # by sample index: only sample 0 writes "cat"
    records = []
    out = s.schedule()
    while not records:
        rows = zip(out.row_sample_index.tolist(), out.row_num_output.tolist())
        s.update(out, np.array([scripts[i][n] for i, n in rows], np.int64), defer_text=True)
        nxt = s.schedule()
        records = s.take_step_results()[0]
        out = nxt
    (stopped,) = records
    assert (stopped.reason, stopped.sample_index, stopped.request_finished, stopped.text) == ("stop", 0, False, " the ")
    # The step in flight planned both samples; cancelled, the other sample goes on alone, as
    # when the stop came before the step was planned.
    s.cancel_step(nxt)
    s.check_invariants()
    ended = []
    while not ended:
        out = s.schedule()
        assert out.row_sample_index.tolist() == [1]
        s.update(out, np.array([other[n] for n in out.row_num_output.tolist()], np.int64), defer_text=True)
        ended = s.take_step_results()[0]
    (last,) = ended
    assert (last.reason, last.sample_index, last.request_finished) == ("length", 1, True)
    assert last.output_token_ids == other[:10] and s.stats()["requests_aborted"] == 0
    assert_text_idle(s)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_stop_string_in_deferred_text_ends_a_sequence_the_next_schedule_preempted(mode):
    # 4 usable blocks of 4 tokens, two 4-token prompts: the step that computes position 8 runs
    # out of blocks and preempts request 2 (the back of the running order), whose text (deferred
    # from the step before) completes its stop string.
    tok, s = text_scheduler(5, admission_headroom=0.0, preemption_mode=mode, num_cpu_blocks=8)
    ids = tok.encode(" the cat sees the red ball today.", add_special_tokens=False)
    k = next(k for k in range(1, len(ids) + 1) if "sees" in tok.decode(ids[:k]))
    assert k == 5
    prompt = tok.encode("Hello", add_special_tokens=False)
    assert len(prompt) == 4
    s.add_request(1, prompt, 12)
    s.add_request(2, prompt, 12, stop=["sees"])
    records, stopped_while_preempted = [], False
    out = s.schedule()
    while True:
        s.update(out, sample(out, {1: ids, 2: ids}), defer_text=True)
        nxt = s.schedule() if s.has_unfinished() else None
        recs = s.take_step_results()[0]
        if any(r.request_id == 2 for r in recs):
            stopped_while_preempted = nxt is not None and nxt.preempted_req_ids.tolist() == [2]
            assert mode == "recompute" or len(nxt.swap_out)
        records += recs
        if nxt is None:
            break
        out = nxt
    assert stopped_while_preempted
    by_req = {r.request_id: r for r in records}
    assert (by_req[2].reason, by_req[2].stop_str_index, by_req[2].output_token_ids) == ("stop", 0, ids[:k])
    assert by_req[2].text == " the cat "
    assert (by_req[1].reason, by_req[1].output_token_ids) == ("length", ids[:12])
    assert s.stats()["preemptions"] == 1
    assert_text_idle(s)
