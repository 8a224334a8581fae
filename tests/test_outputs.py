"""Output classes: vLLM field names, logprob entries, readable reprs."""

import copy
import pickle

from ferrokv.outputs import CompletionOutput, ListPrefix, Logprob, RequestOutput, make_logprobs_entry


def test_logprobs_entry_sampled_first_then_top_by_rank():
    entry = make_logprobs_entry(7, -1.5, 3, [4, 9, 7], [-0.2, -0.9, -1.5], decode=lambda t: f"<{t}>")
    assert list(entry) == [7, 4, 9]  # the sampled token once, first
    assert entry[7] == Logprob(-1.5, 3, "<7>")
    assert entry[4] == Logprob(-0.2, 1, "<4>") and entry[9].rank == 2
    assert make_logprobs_entry(1, -0.1, 1) == {1: Logprob(-0.1, 1, None)}


def test_completion_and_request_output():
    c = CompletionOutput(index=0, text="Paris", token_ids=list(range(100)))
    assert not c.finished() and c.finish_reason is None and c.stop_reason is None
    c.finish_reason, c.stop_reason = "stop", "\n"
    assert c.finished()
    r = RequestOutput("req-1", "Capital?", [1, 2, 3], None, [c], finished=True, num_cached_tokens=2)
    text = repr(r)
    assert text.startswith("RequestOutput(request_id='req-1', prompt='Capital?'")
    assert "text='Paris'" in text and "(100 total)" in text and "finish_reason='stop'" in text
    assert len(text) < 400  # long token lists are elided
    assert r.prompt_logprobs is None


def test_request_output_takes_vllms_positional_order_and_fields():
    """vLLM's ``RequestOutput(request_id, prompt, prompt_token_ids, prompt_logprobs, outputs,
    finished, metrics, lora_request, encoder_prompt, encoder_prompt_token_ids, num_cached_tokens)``:
    code that builds one positionally means the same here; the fields ferrokv does not use are None."""
    c = CompletionOutput(0, "x", [1])
    r = RequestOutput("1", None, [1], [None, {1: Logprob(-0.5)}], [c], True, None, None, None, None, 3)
    assert (r.prompt_logprobs[1][1].logprob, r.outputs, r.finished, r.num_cached_tokens) == (-0.5, [c], True, 3)
    assert (r.lora_request, r.encoder_prompt, r.encoder_prompt_token_ids, r.kv_transfer_params, r.metrics) == \
        (None,) * 5
    assert c.lora_request is None


def test_text_so_far_snapshots_stay_valid_as_it_grows_and_compacts():
    from ferrokv.outputs import TextSoFar

    t, snaps, want = TextSoFar(), [], []
    for i in range(300):  # past many merges
        t.append(f"{i},")
        t.append("")  # empty pieces are no-ops
        snaps.append(CompletionOutput(0, t.snapshot(), []))
        want.append("".join(f"{j}," for j in range(i + 1)))
    assert [s.text for s in snaps] == want
    # 9 batches of 32 joined into a binary counter's chunks (8 + 1), then the last 12 pieces.
    assert len(t._pieces) == bin(300 // 32).count("1") + 300 % 32
    assert snaps[5] == CompletionOutput(0, want[5], []) and snaps[5] != snaps[6]
    assert "text='0,1,2,3,4,5,'" in repr(snaps[5])


def test_a_list_prefix_snapshot_reads_copies_and_pickles_as_its_prefix_alone():
    items = list(range(10_000))
    c = CompletionOutput(0, "", ListPrefix(items, 2))
    items.append(-1)  # the engine appends on: the snapshot stays
    again = pickle.loads(pickle.dumps(c))
    assert again.token_ids == copy.deepcopy(c).token_ids == [0, 1] and len(pickle.dumps(c)) < 1000
    assert c.token_ids == [0, 1] and c.token_ids is c.token_ids  # copied once, when first read


def test_completion_output_works_with_dataclasses_as_vllms():
    """vLLM's CompletionOutput is a dataclass: fields, asdict (also through a RequestOutput),
    replace and copy work here too, the lazily joined text included."""
    import copy
    import dataclasses
    import pickle

    from ferrokv.outputs import TextSoFar

    so_far = TextSoFar()
    so_far.append("he")
    so_far.append("llo")
    c = CompletionOutput(0, so_far.snapshot(), [1, 2], -1.5, None, "length", None)
    assert dataclasses.is_dataclass(c)
    assert [f.name for f in dataclasses.fields(c)] == ["index", "text", "token_ids", "cumulative_logprob",
                                                       "logprobs", "finish_reason", "stop_reason", "lora_request"]
    assert dataclasses.asdict(c) == {"index": 0, "text": "hello", "token_ids": [1, 2], "cumulative_logprob": -1.5,
                                     "logprobs": None, "finish_reason": "length", "stop_reason": None,
                                     "lora_request": None}
    d = dataclasses.replace(c, text="yo", finish_reason="stop")
    assert isinstance(d, CompletionOutput) and (d.text, d.token_ids, d.finish_reason) == ("yo", [1, 2], "stop")
    assert copy.deepcopy(c) == c == pickle.loads(pickle.dumps(c))
    r = RequestOutput("r", "p", [5], None, [c], finished=True)
    assert dataclasses.asdict(r)["outputs"] == [dataclasses.asdict(c)]


def test_request_output_add_merges_as_vllms():
    """aggregate (DELTA): per index, text, tokens and logprobs concatenate and the later state
    wins; otherwise the later completion replaces; a new index is appended in order."""
    lp = [{1: Logprob(-0.5)}]

    def out(finished, *comps):
        return RequestOutput("r", "p", [9], None, list(comps), finished)

    a = out(False, CompletionOutput(0, "a", [1], -0.5, list(lp)), CompletionOutput(1, "x", [4], -1.0, list(lp)))
    a.add(out(True, CompletionOutput(1, "y", [5], -2.0, list(lp), "stop", "y"),
              CompletionOutput(2, "z", [6], -0.1, None, "length")), aggregate=True)
    assert a.finished and [c.index for c in a.outputs] == [0, 1, 2]
    c1 = a.outputs[1]
    assert (c1.text, c1.token_ids, len(c1.logprobs), c1.cumulative_logprob, c1.finish_reason, c1.stop_reason) == \
        ("xy", [4, 5], 2, -2.0, "stop", "y")
    assert (a.outputs[0].text, a.outputs[0].token_ids) == ("a", [1])
    b = out(False, CompletionOutput(0, "a", [1]))
    newer = CompletionOutput(0, "ab", [1, 2], finish_reason="length")
    b.add(out(True, newer), aggregate=False)
    assert b.outputs == [newer] and b.finished
