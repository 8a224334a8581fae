"""The Rust detokenizer (``_core.TextModel`` / ``_core.SeqText``, crate ferrokv-text) against its
oracles and against today's Python ``IncrementalDetokenizer`` (the spec).

Two tokenizers, both built offline: the byte-level BPE of tests/helpers/tiny_tokenizer.py (oracle:
``decode(output)``) and the SentencePiece-style BPE with byte fallback of
tests/helpers/sp_tokenizer.py (oracle: ``decode(ctx + output) - decode(ctx)``, ctx the last 5 kept
prompt ids). Random streams are seeded; "text" streams are encodings of valid text with special /
unknown ids between pieces, "arbitrary" streams are any ids (byte tokens, specials, unknown ids),
where the Python path is the reference.
"""

from __future__ import annotations

import random

import pytest

from ferrokv import _core
from ferrokv.detokenizer import IncrementalDetokenizer
from helpers.text_oracle import final_text, output_text_ok, prompt_context
from helpers.sp_tokenizer import sp_tokenizer
from helpers.tiny_tokenizer import tiny_tokenizer

UNKNOWN = 100_000  # past every vocab: a padded embedding row
TEXTS = [
    "Hello world, the cat runs today.",
    "crème brûlée and naïve café owners, señor über",
    "中文 text with 汉字 that were never in the corpus",
    "rockets 🚀🚀 and faces 😀 and 🦀 crabs",
    "mixed: é中😀a\u00a0b\tc\n\nnew paragraph  two  spaces",
    "STOP here. The END? ¿Qué? ✓✓ done",
]
KINDS = ["byte_level", "sp"]


@pytest.fixture(scope="module", params=KINDS)
def pair(request):
    tok = tiny_tokenizer() if request.param == "byte_level" else sp_tokenizer()
    return request.param, tok, _core.TextModel(tok.backend_tokenizer.to_str())


def rust_run(model, prompt, ids, **kw):
    """Streams ``ids``; returns (text, per-append deltas + flush delta, stop index, append results)."""
    seq = _core.SeqText(model, prompt, **kw)
    deltas, hits = [], []
    for t in ids:
        hits.append(seq.append(t))
        deltas.append(seq.take_delta())
        if seq.stop_index is not None:
            break
    if seq.stop_index is None:
        seq.flush()
    deltas.append(seq.take_delta())
    assert "".join(deltas) == seq.text
    assert seq.num_tokens == len(hits)
    return seq.text, deltas, seq.stop_index, hits


def py_run(tok, prompt, ids, **kw):
    d = IncrementalDetokenizer(tok, prompt, **kw)
    deltas = []
    for t in ids:
        deltas.append(d.append(t))
        if d.stopped:
            break
    deltas.append(d.flush() if not d.stopped else "")
    return d.text, deltas, d.stop_reason


def text_stream(rng, tok):
    """Valid text cut into 1-3 pieces at character boundaries, special / unknown ids between."""
    chars = list(rng.choice(TEXTS))
    a = rng.randrange(len(chars))
    b = rng.randrange(a + 1, len(chars) + 1)
    cuts = sorted({a, b, *(rng.randrange(a, b) for _ in range(rng.randrange(3)))})
    ids = []
    for lo, hi in zip(cuts, cuts[1:]):
        if ids or rng.random() < 0.25:
            ids.append(rng.choice([0, 1, 2, UNKNOWN]))
        ids += tok.encode("".join(chars[lo:hi]), add_special_tokens=False)
    return ids[:60]


def arbitrary_stream(rng, tok):
    n = len(tok)
    return [UNKNOWN if rng.random() < 0.03 else rng.randrange(n) for _ in range(rng.randint(1, 60))]




def test_models_load(pair):
    kind, tok, model = pair
    assert model.vocab_size == len(tok)
    ids = tok.encode(TEXTS[3], add_special_tokens=False)
    for skip in (True, False):
        assert model.decode([1, *ids, UNKNOWN], skip) == tok.decode([1, *ids], skip_special_tokens=skip)
    if kind == "sp":  # the byte-fallback path really is exercised
        assert any(t.startswith("<0x") for t in tok.convert_ids_to_tokens(ids))
    else:
        assert len(tok.encode("🦀")) > 1


def test_text_streams_match_oracle(pair):
    kind, tok, model = pair
    rng = random.Random(1)
    for case in range(300):
        ids = text_stream(rng, tok)
        skip = case % 2 == 0
        prompt = tok.encode(rng.choice(TEXTS), add_special_tokens=False) if case % 5 else []
        text, deltas, stop, _ = rust_run(model, prompt, ids, skip_special_tokens=skip)
        if kind == "byte_level":
            assert text == final_text(tok, ids, skip), ids
        else:
            ctx, pending = prompt_context(tok, prompt, skip)
            assert not pending  # the prompts are whole texts
            whole, head = model.decode(ctx + ids, skip), model.decode(ctx, skip)
            assert whole.startswith(head)
            assert text == whole[len(head):], (ids, ctx)
        assert "\ufffd" not in "".join(deltas)
        assert stop is None


def test_arbitrary_streams_match_python(pair):
    kind, tok, model = pair
    rng = random.Random(2)
    for case in range(300):
        ids = arbitrary_stream(rng, tok) if case % 3 else text_stream(rng, tok)
        skip = case % 4 != 0
        prompt = [rng.randrange(len(tok)) for _ in range(rng.randrange(9))]
        text, deltas, _, _ = rust_run(model, prompt, ids, skip_special_tokens=skip)
        py_text, py_deltas, _ = py_run(tok, prompt, ids, skip_special_tokens=skip)
        assert (text, deltas) == (py_text, py_deltas), (ids, prompt)
        if kind == "byte_level":
            assert output_text_ok(tok, text, prompt, ids, skip), (ids, prompt)


def random_stops(rng, text):
    stops = []
    for _ in range(rng.randint(1, 3)):
        if text and rng.random() < 0.8:
            i = rng.randrange(len(text))
            stops.append(text[i : i + rng.randint(1, 5)])
        else:
            stops.append(rng.choice(["zebra", "\ufffd", "🦀", "the", " ", ""]))
    return stops


def test_stop_strings_match_python(pair):
    _, tok, model = pair
    rng = random.Random(3)
    found = 0
    for case in range(400):
        ids = arbitrary_stream(rng, tok) if case % 2 else text_stream(rng, tok)
        prompt = tok.encode(rng.choice(TEXTS), add_special_tokens=False)[-rng.randrange(8):]
        kw = dict(
            stop=random_stops(rng, tok.decode(ids)),
            include_stop_str_in_output=rng.random() < 0.4,
            min_tokens=rng.choice([0, 0, 1, 3, 10]),
            skip_special_tokens=rng.random() < 0.8,
        )
        text, deltas, stop, hits = rust_run(model, prompt, ids, **kw)
        py_text, py_deltas, py_stop = py_run(tok, prompt, ids, **kw)
        assert (text, deltas) == (py_text, py_deltas), (ids, prompt, kw)
        assert (None if stop is None else kw["stop"][stop]) == py_stop
        # Only the completing append reports the stop (it is the last one).
        assert all(h is None for h in hits[:-1]) and hits[-1] == stop
        found += stop is not None
    assert found > 100  # the stop path really is exercised


def stream_text(tok, model, text, **kw):
    ids = tok.encode(text, add_special_tokens=False)
    return ids, rust_run(model, [], ids, **kw)


def test_stop_string_spanning_tokens_is_reported_by_the_completing_append(pair):
    _, tok, model = pair
    text = "Hello world, the cat runs today. More text after."
    ids, (out, deltas, stop, hits) = stream_text(tok, model, text, stop=["nothing", "cat runs"])
    assert (out, stop) == ("Hello world, the ", 1)
    k = len(hits) - 1
    # The stop string spans several tokens and completes exactly at the token that reported it.
    assert "cat runs" in tok.decode(ids[: k + 1]) and "cat runs" not in tok.decode(ids[:k])
    assert len(tok.encode("cat runs", add_special_tokens=False)) > 1
    assert "runs" not in "".join(deltas) and "More" not in out  # nothing past the stop leaks


def test_of_stops_one_token_completes_the_first_to_end_wins(pair):
    """As if the token's text came one character at a time: the stop that ends first wins, so
    the text never holds a stop string; the list's order only breaks ties."""
    _, tok, model = pair
    tid, piece = next((i, tok.decode([i])) for i in range(len(tok)) if len(tok.decode([i])) >= 4
                      and tok.decode([i]).isalpha())
    for stops, include, want in (([piece[-2:], piece[-3:-1]], False, (piece[:-3], 1)),
                                 ([piece[-2:], piece[-3:-1]], True, (piece[:-1], 1)),
                                 ([piece[-2:], piece[-3:]], False, (piece[:-2], 0)),  # same end: the list's first
                                 ([piece[-3:], piece[-2:]], True, (piece, 0))):
        out, _, stop, _ = rust_run(model, [], [tid], stop=stops, include_stop_str_in_output=include)
        assert (out, stop) == want, (piece, stops)
        assert py_run(tok, [], [tid], stop=stops, include_stop_str_in_output=include)[::2] == (out, stops[stop])


def test_include_stop_str_and_min_tokens(pair):
    _, tok, model = pair
    text = "the cat runs the cat sleeps"
    _, (out, *_rest) = stream_text(tok, model, text, stop=["cat"], include_stop_str_in_output=True)
    assert out == "the cat"
    n_first = len(tok.encode("the cat", add_special_tokens=False))
    _, (out, _, stop, _) = stream_text(tok, model, text, stop=["cat"], min_tokens=n_first)
    assert (out, stop) == ("the cat runs the ", 0)


def test_split_character_and_flush(pair):
    _, tok, model = pair
    ids = tok.encode("a🦀", add_special_tokens=False)
    seq = _core.SeqText(model, [])
    deltas = []
    for t in ids:
        assert seq.append(t) is None
        deltas.append(seq.take_delta())
    assert all(d == "" for d in deltas[1:-1]) and deltas[-1].endswith("🦀")
    # Cut before the character is complete: its pending tokens are dropped (vLLM's), not U+FFFD.
    seq2 = _core.SeqText(model, [])
    for t in ids[:-1]:
        seq2.append(t)
    assert seq2.text == "a"
    seq2.flush()
    assert seq2.text == "a" and seq2.take_delta() == "a" and model.decode(ids[:-1]).startswith("a\ufffd")


def _byte_token(tok, b: int) -> int:
    """The id of the token that is the single byte ``b`` (byte fallback's ``<0xNN>``, or the
    byte-level alphabet's character for it)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    alphabet = {c: c for c in printable} | {c: 0x100 + i for i, c in enumerate(c for c in range(256) if c not in printable)}
    for piece in (f"<0x{b:02X}>", chr(alphabet[b])):
        i = tok.convert_tokens_to_ids(piece)
        if i is not None and i != tok.unk_token_id:
            return i
    raise AssertionError(f"no token for byte {b:#x}")


def test_a_character_after_a_run_of_undecodable_bytes_is_kept_whole(pair):
    """Seven lone continuation bytes, then 😍 split over its four byte tokens: the garbage bytes
    pend with the character, and the text is the one-shot decode (vLLM's), not the character
    cut into U+FFFDs because many tokens pended. (Byte fallback's decoder makes every byte of an
    invalid run a U+FFFD, the character's too: there the text only has to equal the decode.)"""
    kind, tok, model = pair
    ids = [_byte_token(tok, 0x80)] * 7 + [_byte_token(tok, b) for b in "😍".encode()] + tok.encode(
        "!", add_special_tokens=False)
    expected = tok.decode(ids)
    assert expected == "\ufffd" * 7 + "😍!" or kind == "sp"
    assert rust_run(model, [], ids)[0] == expected
    assert py_run(tok, [], ids)[0] == expected


def test_append_after_stop_raises(pair):
    _, tok, model = pair
    seq = _core.SeqText(model, [], stop=["a"])
    for t in tok.encode("xa yz", add_special_tokens=False):
        if seq.append(t) is not None:
            break
    assert seq.stop_index == 0 and seq.text == "x"
    with pytest.raises(RuntimeError):
        seq.append(5)


def test_bad_input_names_the_field(pair):
    _, _, model = pair
    with pytest.raises(ValueError, match="tokenizer_json"):
        _core.TextModel("{not json")
    with pytest.raises(ValueError, match="tokenizer_json"):
        _core.TextModel('{"model": {"type": "Nope"}}')
    with pytest.raises(ValueError, match="min_tokens.*-1"):
        _core.SeqText(model, [], min_tokens=-1)
    with pytest.raises(ValueError, match="prompt_tail.*-3"):
        _core.SeqText(model, [1, -3])
    seq = _core.SeqText(model, [])
    for bad in (-1, 2**32, 2**80):
        with pytest.raises(ValueError, match=f"token.*{bad}"):
            seq.append(bad)
    with pytest.raises(ValueError, match="ids"):
        model.decode([2**40])
    assert issubclass(_core.InvalidArgumentError, ValueError)


@pytest.mark.parametrize("tail", ["思考", "🦀🚀", "中😀"])
def test_a_context_starting_inside_a_character_keeps_the_first_outputs_space(pair, tail):
    """The last 5 prompt ids may begin inside a character (byte tokens of the prompt's last
    characters): the context starts where it decodes clean, so the first output word keeps its
    leading space. (Byte fallback's decoder makes a whole invalid byte run U+FFFD: no head of
    the context decoded clean, the context was dropped, and the decoder's Strip ate the space.)"""
    kind, tok, model = pair
    prompt = tok.encode(f"I think {tail}", add_special_tokens=False)
    full = tok.encode(f"I think {tail} hello world", add_special_tokens=False)
    assert full[:len(prompt)] == prompt
    out = full[len(prompt):]
    want = tok.decode(full)[len(tok.decode(prompt)):]
    assert want == " hello world"
    assert py_run(tok, prompt, out)[0] == want
    assert rust_run(model, prompt, out)[0] == want
