"""Incremental detokenization and stop strings, on the tiny byte-level BPE tokenizer."""

from __future__ import annotations

import random

import pytest
from tokenizers.decoders import DecodeStream
from transformers import AutoTokenizer

from ferrokv.detokenizer import IncrementalDetokenizer, decode_token, special_token_ids
from ferrokv.sampling_params import SamplingParams
from helpers.text_oracle import final_text
from helpers.tiny_tokenizer import TINY_VOCAB_SIZE, save_tiny_tokenizer, tiny_tokenizer

TEXTS = [
    "Hello world, the cat runs today.",
    "crème brûlée and naïve café owners",
    "中文 text with 汉字 that were never in the corpus",
    "rockets 🚀🚀 and faces 😀 and 🦀 crabs",
    "mixed: é中😀a\u00a0b\tc\n\nnew paragraph",
    "<|im_start|>user\nhi 🚀<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def stream(tok, ids, **kw):
    d = IncrementalDetokenizer(tok, **kw)
    deltas = []
    for t in ids:
        deltas.append(d.append(t))
        if d.stopped:
            break
    deltas.append(d.flush())
    return d, deltas


def test_tokenizer_helper_roundtrip(tmp_path, tok):
    assert len(tok) == TINY_VOCAB_SIZE
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == 0
    out = save_tiny_tokenizer(tmp_path / "tok")
    reloaded = AutoTokenizer.from_pretrained(out)
    for text in TEXTS:
        assert reloaded.encode(text) == tok.encode(text)
        assert tok.decode(tok.encode(text)) == text
    chat = reloaded.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                        add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # Multi-byte characters really are split across tokens (that is what we want to exercise).
    assert len(tok.encode("🦀")) > 1


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_full_decode(tok, text, skip):
    ids = tok.encode(text)
    d, deltas = stream(tok, ids, skip_special_tokens=skip)
    full = tok.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == d.text == full
    assert not any("\ufffd" in x for x in deltas)  # no garbage from split characters
    # With prompt context the output is the same for a byte-level tokenizer.
    prompt = tok.encode("Some prompt 中")
    d3 = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    assert "".join(d3.append(t) for t in ids) + d3.flush() == full


def test_split_character_emitted_once_complete(tok):
    ids = tok.encode("🦀")
    d = IncrementalDetokenizer(tok)
    deltas = [d.append(t) for t in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "🦀"


def test_random_token_streams(tok):
    # Arbitrary id sequences (invalid UTF-8 included) reproduce the one-shot decode, less a last
    # character still incomplete at the end (vLLM's: dropped), which the oracle finds by decodes.
    rng = random.Random(0)
    cut = 0
    for _ in range(200):
        ids = [rng.randrange(TINY_VOCAB_SIZE) for _ in range(rng.randrange(1, 30))]
        for skip in (True, False):
            d, deltas = stream(tok, ids, skip_special_tokens=skip)
            full = tok.decode(ids, skip_special_tokens=skip)
            assert "".join(deltas) == final_text(tok, ids, skip), ids
            assert full.startswith("".join(deltas))
            cut += "".join(deltas) != full
    assert cut > 0  # some streams did end mid-character


def test_window_stays_small(tok):
    ids = tok.encode(" ".join(TEXTS) * 20)
    d = IncrementalDetokenizer(tok, stop=["never appears"])
    for t in ids:
        d.append(t)
        assert len(d._window) <= 12 and len(d._tail) < len("never appears")
    assert d.text + d.flush() == tok.decode(ids, skip_special_tokens=True)


def test_unknown_ids_decode_to_nothing(tok):
    d = IncrementalDetokenizer(tok)
    assert d.append(TINY_VOCAB_SIZE + 5) == ""  # padded-vocab id from the model
    assert d.append(tok.encode("a")[0]) == "a"


# --- stop strings -------------------------------------------------------------------------------


def spanning_stop(tok, text):
    """A stop string that straddles the boundary between two consecutive tokens of `text`."""
    ids = tok.encode(text)
    pieces = [tok.decode([i]) for i in ids]
    for i in range(len(ids) - 1):
        a, b = pieces[i], pieces[i + 1]
        if len(a) >= 2 and len(b) >= 2 and "\ufffd" not in a + b:
            return ids, i + 1, a[-2:] + b[:2]
    raise AssertionError("no suitable boundary")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(tok, include):
    text = "Hello world, the cat runs today and then the dog reads fresh bread."
    ids, j, stop = spanning_stop(tok, text)
    full = tok.decode(ids)
    d, deltas = stream(tok, ids, stop=[stop], include_stop_str_in_output=include)
    assert d.stop_reason == stop and d.stopped
    assert d.num_tokens == j + 1  # stopped on the very token that completed the stop string
    cut = full.index(stop) + (len(stop) if include else 0)
    assert d.text == full[:cut] == "".join(deltas)
    with pytest.raises(RuntimeError):
        d.append(ids[-1])


def test_the_first_completed_stop_wins_and_the_lists_order_breaks_ties(tok):
    text = "The cat runs today. The dog reads. The end."
    ids = tok.encode(text)
    # Streamed token by token, "dog" completes first, whatever the list order.
    d, _ = stream(tok, ids, stop=["The end", "dog", "reads"])
    assert d.stop_reason == "dog" and d.text == "The cat runs today. The "
    d = IncrementalDetokenizer(tok, stop=["cat runs", "cat"])
    out = d.extend(ids)
    assert d.stop_reason == "cat" and out == d.text == "The "
    # Several stops completed by one delta: the one that ends first wins, as if the delta came
    # one character at a time (the text never holds a stop string); the list breaks ties.
    for stop, include, want in ((["xyz", "bc"], True, ("bc", "abc")), (["xyz", "bc"], False, ("bc", "a")),
                                (["bcd", "cd"], False, ("bcd", "a")), (["cd", "bcd"], True, ("cd", "abcd"))):
        d = IncrementalDetokenizer(tok, stop=stop, include_stop_str_in_output=include)
        d.num_tokens = 1
        d._emit("abcdxyz")
        assert (d.stop_reason, d.text) == want, stop


def test_multibyte_stop_string(tok):
    text = "rockets 🚀🚀 and faces 😀 end"
    ids = tok.encode(text)
    d, deltas = stream(tok, ids, stop=["😀"])
    assert d.stop_reason == "😀" and d.text == "rockets 🚀🚀 and faces " == "".join(deltas)
    d, _ = stream(tok, ids, stop=["🚀 a"], include_stop_str_in_output=True)
    assert d.text == "rockets 🚀🚀 a"


def test_partial_stop_is_held_back_then_released(tok):
    ids = tok.encode("the cat runs ab")
    d = IncrementalDetokenizer(tok, stop=["abc"])
    streamed = "".join(d.append(t) for t in ids)
    assert not d.stopped
    assert not streamed.endswith("ab")  # "ab" may still become "abc": not streamed yet
    assert streamed + d.flush() == "the cat runs ab" == d.text


def test_stop_ignored_within_min_tokens(tok):
    ids = tok.encode("cat cat cat dog")
    params = SamplingParams(stop=["cat"], min_tokens=3)
    d = IncrementalDetokenizer.from_params(tok, params)
    for t in ids:
        d.append(t)
        if d.stopped:
            break
    full = tok.decode(ids)
    # The first "cat"s complete within the first 3 tokens and are ignored (as in vLLM).
    first_checked = tok.decode(ids[: d.num_tokens])
    assert d.stopped and d.num_tokens > 3 and d.text == first_checked[: first_checked.rindex("cat")]
    assert full.startswith(d.text)


def test_stop_across_skipped_special(tok):
    ids = tok.encode("the ca") + [tok.convert_tokens_to_ids("<|im_end|>")] + tok.encode("t runs")
    d, _ = stream(tok, ids, stop=["cat"])
    assert d.stop_reason == "cat" and d.text == "the "
    d, _ = stream(tok, ids, stop=["cat"], skip_special_tokens=False)
    assert not d.stopped and d.text == "the ca<|im_end|>t runs"


def test_helpers(tok):
    assert special_token_ids(tok) == frozenset({0, 1, 2})
    assert special_token_ids(tok) is special_token_ids(tok)  # cached
    assert decode_token(tok, tok.encode(" cat")[0]) == tok.decode(tok.encode(" cat")[:1])
    assert decode_token(tok, TINY_VOCAB_SIZE + 1) == ""


def test_decoded_tokens_of_sentencepiece_pieces_keep_their_leading_space():
    """vLLM's decoded_token of a '▁' piece has its space (decoding it alone strips it); other pieces,
    and byte-level tokenizers' (test_helpers), are as decode gives them (unicode8)."""
    from helpers.sp_tokenizer import sp_tokenizer

    sp = sp_tokenizer()
    ids = sp.encode("Alice likes cats", add_special_tokens=False)
    pieces = sp.convert_ids_to_tokens(ids)
    texts = [decode_token(sp, i) for i in ids]
    marked = [p.startswith("\u2581") for p in pieces]
    assert any(marked) and not all(marked)
    assert [t for m, t in zip(marked, texts) if m] == [" " + p[1:] for m, p in zip(marked, pieces) if m]
    assert [t for m, t in zip(marked, texts) if not m] == [sp.decode([i]) for m, i in zip(marked, ids) if not m]
    assert "".join(texts) == " " + sp.decode(ids)


def test_added_tokens_flagged_special_are_skipped_as_the_tokenizer_skips_them(tmp_path):
    """A token added with ``special=True`` (Llama 3's reserved tokens) is not in ``all_special_ids``,
    yet a fast tokenizer's decode skips it: so must the detokenizer and its stop-string search."""
    from tokenizers import AddedToken

    tok = AutoTokenizer.from_pretrained(save_tiny_tokenizer(tmp_path / "tok"))  # a copy to change
    tok.add_tokens([AddedToken("[RESERVED_0]", special=True, normalized=False),
                    AddedToken("<plain>", special=False, normalized=False)])
    reserved, plain = tok.convert_tokens_to_ids(["[RESERVED_0]", "<plain>"])
    assert reserved not in tok.all_special_ids and reserved in special_token_ids(tok)
    assert plain not in special_token_ids(tok)
    ids = tok.encode("the ca", add_special_tokens=False) + [reserved, plain] + tok.encode("t runs", add_special_tokens=False)
    for skip in (True, False):
        d, deltas = stream(tok, ids, skip_special_tokens=skip)
        assert d.text == "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
    d, _ = stream(tok, ids, stop=["RESERVED"])
    assert not d.stopped and "RESERVED" not in d.text


@pytest.mark.parametrize("text", ["The cat 🦀 runs today.", "naïve 中文 text 😀😀 again!"])
def test_prompt_ending_inside_a_character(tok, text):
    """A prompt may end in the middle of a UTF-8 character (its tokens split one): the output
    token that completes it emits the whole character, so the prompt's clean text and the output
    are the text's decode (vLLM's DecodeStream, primed with the prompt, does the same)."""
    full = tok.encode(text)
    cuts = [c for c in range(1, len(full)) if tok.decode(full[:c]).endswith("\ufffd")]
    assert cuts, "the text must split a character across tokens"
    for cut in cuts:
        prompt, out = full[:cut], full[cut:]
        d = IncrementalDetokenizer(tok, prompt)
        deltas = [d.append(t) for t in out] + [d.flush()]
        stream = DecodeStream(skip_special_tokens=True)
        for t in prompt:
            stream.step(tok._tokenizer, t)
        want = "".join(stream.step(tok._tokenizer, t) or "" for t in out)
        assert "".join(deltas) == d.text == want, (cut, deltas)
        assert tok.decode(full).endswith(want) and tok.decode(prompt).endswith("\ufffd")
