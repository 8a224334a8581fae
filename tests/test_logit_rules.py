"""Per-token logit rules (``ferrokv.logit_rules``): ``logit_bias``, ``allowed_token_ids`` and
``bad_words``.

Unit level: ``bad_words_token_ids`` against the real tiny tokenizer (vLLM's encoding: the word,
and again after one space when that gives a different first token and the same length),
``check_token_rules`` (ids out of the vocabulary name their field, stop_token_ids' too) and
``LogitBiasState`` driven by a real ``ferrokv._core.Scheduler`` whose sequences join, fork (batch
row -1), finish and move rows: a bias row is rebuilt exactly when its batch row holds another
sequence, and always holds the request's additive row.

Engine level (tiny llama, CPU, fp32): every generated token is allowed; a +100 bias forces a
token, -100 removes the greedy one, and the reported logprobs stay the raw model's; a banned word
never appears (a multi-token word's last token is banned only after its other tokens, never
reaching back into the prompt); requests without rules are unaffected by batch-mates with rules,
with overlap on and off and under preemption; bad values at ``add_request`` name the field and
leave the engine idle and serving.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ferrokv import SamplingParams
from ferrokv._core import Scheduler
from ferrokv.logit_rules import LogitBiasState, bad_words_token_ids, check_token_rules, has_logit_bias
from helpers.engine_faults import assert_idle, rand_prompts, tiny_engine
from helpers.tiny_models import TINY_VOCAB
from helpers.tiny_tokenizer import tiny_tokenizer

V = TINY_VOCAB
NUM_SEARCH = 40  # prompts searched for continuations whose tokens make round-trippable words
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def engine(llama_path):
    """A default engine (overlap off), shared: every test leaves it idle."""
    return tiny_engine(llama_path)


def greedy(max_tokens: int = MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def run(engine, requests):
    """Final outputs by request id; the engine is left idle with no text state."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    final, steps = {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        assert steps < 3000
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o
    assert_idle(engine)
    assert engine.scheduler.text_state() == (0, 0)
    return final


def ids_of(o, i: int = 0) -> list[int]:
    return list(o.outputs[i].token_ids)


@pytest.fixture(scope="module")
def plain(engine):
    """(prompt, greedy continuation with logprobs=3) for NUM_SEARCH fixed prompts, all in one batch."""
    prompts = [rand_prompts(s, [8])[0] for s in range(NUM_SEARCH)]
    final = run(engine, [(str(s), p, greedy(logprobs=3)) for s, p in enumerate(prompts)])
    return [(prompts[s], final[str(s)].outputs[0]) for s in range(NUM_SEARCH)]


def word_of(tok, ids) -> str | None:
    """The text of ``ids`` if it is a word ``bad_words`` encodes back to exactly ``ids``."""
    text = tok.decode(list(ids))
    if not text or "\ufffd" in text or text != text.lstrip():
        return None
    return text if bad_words_token_ids(tok, [text], V)[0] == list(ids) else None


# ------------------------------------------------------------------------------------------------
# bad_words_token_ids / check_token_rules


def test_bad_words_token_ids_plain_and_space_prefixed(tok):
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    # "Paris": with a space it starts with another token and has the same length -> both.
    plain, spaced = enc("Paris"), enc(" Paris")
    assert plain[0] != spaced[0] and len(plain) == len(spaced) > 1  # the case is what it claims
    assert bad_words_token_ids(tok, ["Paris"], V) == [plain, spaced]
    # Leading spaces are stripped first: the same two encodings.
    assert bad_words_token_ids(tok, ["  Paris"], V) == [plain, spaced]
    # "cat": " cat" is one token, a different length -> only the plain encoding.
    plain, spaced = enc("cat"), enc(" cat")
    assert len(plain) != len(spaced)
    assert bad_words_token_ids(tok, ["cat"], V) == [plain]
    # Several words keep their order; each word's spaced form is compared with its own plain form.
    assert bad_words_token_ids(tok, ["cat", "Paris", "bread"], V) == [
        enc("cat"), enc("Paris"), enc(" Paris"), enc("bread"), enc(" bread")]
    # Two-word phrases are encoded whole.
    assert bad_words_token_ids(tok, ["the cat"], V)[0] == enc("the cat")


class _FakeTok:
    """A tokenizer with scripted encodings (the tiny BPE never gives the same first token with
    and without a space)."""

    def __init__(self, table: dict[str, list[int]]) -> None:
        self.table = table

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        assert add_special_tokens is False
        return list(self.table[text])


def test_bad_words_token_ids_dedup_rule():
    tok = _FakeTok({
        "a": [5, 6], " a": [5, 6],  # same first token: the spaced form is a duplicate
        "b": [7, 8], " b": [9, 8],  # different first token, same length: kept
        "c": [10], " c": [11, 12],  # different length: dropped
        "d": [13, 14], " d": [13, 15],  # same first token, other tokens differ: dropped (vLLM's rule)
    })
    assert bad_words_token_ids(tok, ["a"], 100) == [[5, 6]]
    assert bad_words_token_ids(tok, ["b"], 100) == [[7, 8], [9, 8]]
    assert bad_words_token_ids(tok, ["c"], 100) == [[10]]
    assert bad_words_token_ids(tok, ["d"], 100) == [[13, 14]]
    assert bad_words_token_ids(tok, ["b", "a", "c", "b"], 100) == [[7, 8], [9, 8], [5, 6], [10], [7, 8], [9, 8]]


def test_bad_words_caps_are_vllms():
    """At most 128 token sequences of 1024 tokens in all (vLLM's caps): each is checked against
    every row's output every step, and encoding holds the engine. Too many words are refused
    before any is encoded (the fake tokenizer knows none of them)."""
    with pytest.raises(ValueError, match=r"bad_words has 129 words; at most 128"):
        bad_words_token_ids(_FakeTok({}), [f"w{i}" for i in range(129)], 100)
    # 65 words of two forms each: 130 sequences.
    two_forms = {}
    for i in range(65):
        two_forms[f"w{i}"], two_forms[f" w{i}"] = [2 * i, 1], [2 * i + 1, 1]
    assert len(bad_words_token_ids(_FakeTok(two_forms), [f"w{i}" for i in range(64)], 200)) == 128
    with pytest.raises(ValueError, match=r"bad_words give 130 token sequences .*at most 128"):
        bad_words_token_ids(_FakeTok(two_forms), [f"w{i}" for i in range(65)], 200)
    # 1024 tokens in all pass, 1025 do not.
    long = {"a": list(range(1000)), " a": [0], "b": list(range(24)), " b": [0], "c": [5], " c": [6, 7]}
    assert sum(map(len, bad_words_token_ids(_FakeTok(long), ["a", "b"], 1000))) == 1024
    with pytest.raises(ValueError, match=r"bad_words give 1025 tokens in all; at most 1024"):
        bad_words_token_ids(_FakeTok(long), ["a", "b", "c"], 1000)


def test_bad_words_token_ids_out_of_vocab_names_bad_words(tok):
    plain, spaced = tok.encode("Paris", add_special_tokens=False), tok.encode(" Paris", add_special_tokens=False)
    with pytest.raises(ValueError, match="bad_words") as info:
        bad_words_token_ids(tok, ["Paris"], min(plain))
    assert "Paris" in str(info.value)
    # Only the space-prefixed form is out of the vocabulary: still refused.
    limit = max(plain) + 1
    assert max(spaced) >= limit, (plain, spaced)
    with pytest.raises(ValueError, match="bad_words"):
        bad_words_token_ids(tok, ["Paris"], limit)
    assert bad_words_token_ids(tok, ["Paris"], max(plain + spaced) + 1) == [plain, spaced]


def test_check_token_rules_names_the_field():
    check_token_rules(SamplingParams(), V)
    check_token_rules(SamplingParams(logit_bias={0: 1.0, V - 1: -2.0}, allowed_token_ids=[0, V - 1]), V)
    with pytest.raises(ValueError, match="logit_bias") as info:
        check_token_rules(SamplingParams(logit_bias={3: 1.0, V: 2.0}), V)
    assert str(V) in str(info.value)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        check_token_rules(SamplingParams(allowed_token_ids=[1, 2, V + 7]), V)
    assert not has_logit_bias(SamplingParams())
    assert not has_logit_bias(SamplingParams(logit_bias={}))
    assert has_logit_bias(SamplingParams(logit_bias={1: 0.5}))
    assert has_logit_bias(SamplingParams(allowed_token_ids=[4]))


# ------------------------------------------------------------------------------------------------
# LogitBiasState, driven by a real scheduler


def expected_row(params: SamplingParams) -> torch.Tensor:
    row = torch.zeros(V)
    if params.allowed_token_ids is not None:
        row.fill_(-math.inf)
        row[params.allowed_token_ids] = 0.0
    for t, b in (params.logit_bias or {}).items():
        row[t] += b
    return row


def test_logit_bias_state_gives_each_biased_row_its_requests_row():
    """Driven by a real scheduler: rows join, fork (n=2, a row at -1), move and end; every biased
    logits row gets its own request's row, and slots are reused once requests end."""
    s = Scheduler(64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, watermark=0.0)
    params = {
        1: (SamplingParams(temperature=0.0, logit_bias={5: 2.0, 7: -1.5}), 3),
        2: (SamplingParams(temperature=0.0), 6),  # no bias: never listed
        3: (SamplingParams(temperature=0.0, allowed_token_ids=[1, 2, 3], logit_bias={2: 0.5, 9: 4.0}), 8),
        4: (SamplingParams(n=2, temperature=1.0, logit_bias={9: 3.0}), 5),  # forks: a row at -1
        5: (SamplingParams(temperature=0.0, allowed_token_ids=[3, 4]), 4),
    }
    state = LogitBiasState(V, torch.device("cpu"))
    for rid, (p, max_tokens) in params.items():
        s.add_request(rid, np.arange(3, 8 + rid), max_tokens, n=p.n, temperature=p.temperature,
                      has_logit_bias=has_logit_bias(p))
        if has_logit_bias(p):
            state.register(rid, p)
    assert len(state) == 4
    forked = 0
    for _ in range(20):
        out = s.schedule()
        if not out.num_rows:
            break
        req_ids = out.row_req_ids.tolist()
        want_rows = [r for r, q in enumerate(req_ids) if has_logit_bias(params[q][0])]
        assert out.any_logit_bias == bool(want_rows)
        assert sorted(out.bias_rows.tolist()) == want_rows
        rows, bias = state.inputs(out)
        assert rows.dtype == torch.int64 and rows.tolist() == out.bias_rows.tolist()
        assert bias.shape == (len(want_rows), V)
        for j, r in enumerate(out.bias_rows.tolist()):
            assert torch.equal(bias[j], expected_row(params[req_ids[r]][0])), (r, req_ids[r])
            forked += int(out.row_batch_rows[r]) < 0
        for f in s.update(out, np.full(out.num_rows, 3)):
            if f.request_finished:
                state.release(f.request_id)
    assert not s.has_unfinished() and len(state) == 0 and forked >= 1
    table = state.table
    p = SamplingParams(logit_bias={1: 1.0})
    state.register(9, p)
    assert int(state._index.lookup(np.array([9]))[0]) == -1, "a waiting request holds no row"
    s.update(out, np.zeros(0, dtype=np.int64))  # the last, empty step
    s.add_request(9, np.arange(3, 9), 2, temperature=1.0, has_logit_bias=True)
    out = s.schedule()
    _, bias = state.inputs(out)
    assert state.table is table, "a freed slot is reused: the table does not grow"
    slot = int(state._index.lookup(np.array([9]))[0])
    assert torch.equal(state.table[slot], expected_row(p)), "the reused slot is rebuilt"
    assert torch.equal(bias[0], expected_row(p))


def test_logit_bias_rows_exist_only_for_requests_that_ran():
    """Many queued biased requests take no V-wide rows (a queue of them filled GPU memory)."""
    state = LogitBiasState(V, torch.device("cpu"))
    for i in range(1000):
        state.register(i, SamplingParams(logit_bias={1: 1.0}))
    assert len(state) == 1000 and state.table.shape[0] == 0
    for i in range(1000):
        state.release(i)
    assert len(state) == 0


def test_logit_bias_state_rows_of_a_released_request_are_neutral():
    """A request that ended while its row was in flight: a zero row, never another's."""
    state = LogitBiasState(V, torch.device("cpu"))
    p, q = SamplingParams(allowed_token_ids=[1]), SamplingParams(logit_bias={4: 2.0})
    state.register(10, p)
    state.register(12, q)

    class Out:
        bias_rows = np.array([0, 2])
        row_req_ids = np.array([10, 11, 12])

    _, bias = state.inputs(Out)
    assert torch.equal(bias[0], expected_row(p)) and torch.equal(bias[1], expected_row(q))
    state.release(10)
    state.register(13, q)  # takes request 10's slot
    _, bias = state.inputs(Out)
    assert torch.equal(bias[0], torch.zeros(V)) and torch.equal(bias[1], expected_row(q))
    state.release(12)
    state.release(13)
    _, bias = state.inputs(Out)
    assert torch.equal(bias, torch.zeros(2, V))


# ------------------------------------------------------------------------------------------------
# Engine: allowed_token_ids, logit_bias


ALLOWED = [7, 42, 99, 123, 250, 301, 377]


def hf_constrained_greedy(model, prompt: list[int], allowed: list[int], n: int) -> list[int]:
    ids = list(prompt)
    mask = torch.full((V,), -math.inf)
    mask[allowed] = 0.0
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(torch.argmax(logits + mask)))
    return ids[len(prompt):]


@pytest.mark.parametrize("overlap", [False, True], ids=["overlap-off", "overlap-on"])
def test_allowed_token_ids_greedy_and_sampled(llama_path, hf_model, plain, overlap):
    prompt = plain[0][0]
    assert not set(plain[0][1].token_ids) <= set(ALLOWED)  # the rule has work to do
    eng = tiny_engine(llama_path, overlap=overlap)
    final = run(eng, [
        ("g", prompt, greedy(allowed_token_ids=ALLOWED)),
        ("s", prompt, SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True,
                                     allowed_token_ids=ALLOWED)),
        ("free", prompt, greedy()),
    ])
    got = ids_of(final["g"])
    assert set(got) <= set(ALLOWED)
    assert got == hf_constrained_greedy(hf_model(llama_path), prompt["prompt_token_ids"], ALLOWED, MAX_TOKENS)
    for i in range(2):
        assert len(ids_of(final["s"], i)) == MAX_TOKENS and set(ids_of(final["s"], i)) <= set(ALLOWED)
    assert ids_of(final["free"]) == list(plain[0][1].token_ids)


def test_logit_bias_forces_and_removes_tokens_logprobs_stay_raw(engine, plain):
    prompt, ref = plain[1]
    first = ref.logprobs[0]  # {sampled: ..., top-3}
    ranked = sorted(first.items(), key=lambda kv: kv[1].rank)
    g0, second = ranked[0][0], ranked[1][0]
    assert g0 == ref.token_ids[0] and ranked[1][1].rank == 2
    forced = 123 if g0 != 123 else 124
    final = run(engine, [
        ("plus", prompt, greedy(logit_bias={forced: 100.0}, logprobs=3)),
        ("minus", prompt, greedy(max_tokens=1, logit_bias={g0: -100.0}, logprobs=3)),
        ("zero", prompt, greedy(logit_bias={g0: 0.0}, logprobs=3)),
    ])
    assert ids_of(final["plus"]) == [forced] * MAX_TOKENS
    assert ids_of(final["minus"]) == [second]
    assert ids_of(final["zero"]) == list(ref.token_ids)  # a zero bias changes nothing
    # Raw logprobs: the first position's numbers are the unbiased request's.
    for rid in ("minus", "zero"):
        entry = final[rid].outputs[0].logprobs[0]
        for t, lp in entry.items():
            assert t in first
            assert lp.rank == first[t].rank and lp.logprob == pytest.approx(first[t].logprob, abs=1e-5)
    entry = final["plus"].outputs[0].logprobs[0]
    for t in (g0, second):
        assert entry[t].rank == first[t].rank and entry[t].logprob == pytest.approx(first[t].logprob, abs=1e-5)
    assert entry[forced].rank > 1 and entry[forced].logprob < first[g0].logprob  # its raw rank


# ------------------------------------------------------------------------------------------------
# Engine: bad_words


def _first(plain, tok, pick):
    for prompt, out in plain:
        got = pick(prompt["prompt_token_ids"], list(out.token_ids))
        if got is not None:
            return prompt, out, got
    pytest.fail("no fixed prompt has a continuation with a round-trippable word (the tiny model changed?)")


def _contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def test_bad_word_of_one_token(engine, plain, tok):
    prompt, ref, word = _first(plain, tok, lambda p, g: word_of(tok, g[:1]))
    g = list(ref.token_ids)
    banned = {ids[0] for ids in bad_words_token_ids(tok, [word], V) if len(ids) == 1}
    assert g[0] in banned
    out = ids_of(run(engine, [("b", prompt, greedy(bad_words=[word]))])["b"])
    assert not banned & set(out), (word, out)
    # The first token is the best raw one left.
    best = min((lp.rank, t) for t, lp in ref.logprobs[0].items() if t not in banned)[1]
    assert out[0] == best


def test_multi_token_bad_word_bans_its_last_token_only_after_the_others(engine, plain, tok):
    prompt, ref, word = _first(plain, tok, lambda p, g: word_of(tok, g[1:3]) if g[1] != g[2] else None)
    g = list(ref.token_ids)
    out = ids_of(run(engine, [("b", prompt, greedy(bad_words=[word]))])["b"])
    assert out[:2] == g[:2], "the word's first token is not banned"
    assert out[2] != g[2], "its last token is banned right after the first"
    for ids in bad_words_token_ids(tok, [word], V):
        assert not _contains(out, ids), (word, ids, out)


def test_bad_word_whose_prefix_is_in_the_prompt_is_not_banned(engine, plain, tok):
    """A word made of the prompt's last token and the first generated one: the prefix never
    reaches back into the prompt, so the greedy token is still generated; nor is a word whose
    first token did not come out."""
    prompt, ref, word = _first(plain, tok, lambda p, g: word_of(tok, [p[-1], g[0]]))
    g = list(ref.token_ids)
    other = next(w for z in range(3, V) if z != prompt["prompt_token_ids"][-1] and z not in g
                 for w in [word_of(tok, [z, g[0]])] if w)
    final = run(engine, [("p", prompt, greedy(bad_words=[word])), ("o", prompt, greedy(bad_words=[other]))])
    assert ids_of(final["p"]) == g
    assert ids_of(final["o"]) == g


# ------------------------------------------------------------------------------------------------
# Engine: mixed batches, overlap, preemption


CONFIGS = {
    "overlap-off": dict(overlap=False),
    "overlap-on": dict(overlap=True),
    "swap-preemption": dict(overlap=True, block_size=8, num_kv_blocks=17, preemption_mode="swap", num_cpu_blocks=64),
    "recompute-chunked": dict(overlap=False, block_size=4, num_kv_blocks=40, max_num_batched_tokens=16),
}


@pytest.fixture(scope="module")
def mixed(engine, tok):
    """Requests with and without rules, and each one's greedy output run alone."""
    prompts = rand_prompts(7, [30, 45, 20, 38, 12, 26, 33])
    alone_plain = [ids_of(run(engine, [("a", p, greedy(14))])["a"]) for p in prompts]
    single = next(w for t in alone_plain[4] for w in [word_of(tok, [t])] if w)
    g = alone_plain[5]
    pair = next(w for k in range(2, len(g) - 1) if g[k] != g[k + 1] for w in [word_of(tok, g[k:k + 2])] if w)
    rules = [
        {}, dict(allowed_token_ids=ALLOWED), {}, dict(logit_bias={alone_plain[3][0]: -100.0, 250: 3.0}),
        dict(bad_words=[single]), dict(bad_words=[pair]), dict(allowed_token_ids=ALLOWED, logit_bias={99: 1.5}),
    ]
    requests = [(str(i), p, greedy(14, **r)) for i, (p, r) in enumerate(zip(prompts, rules))]
    alone = {rid: ids_of(run(engine, [(rid, p, params)])[rid]) for rid, p, params in requests}
    for i in (1, 3, 4, 5, 6):
        assert alone[str(i)] != alone_plain[i], i  # every rule changed its request's output
    return requests, alone, [single, pair]


@pytest.mark.parametrize("config", list(CONFIGS))
def test_mixed_batch_rules_stay_with_their_requests(llama_path, mixed, tok, config):
    requests, alone, words = mixed
    kw = CONFIGS[config]
    eng = tiny_engine(llama_path, **kw)
    sampled = SamplingParams(n=2, temperature=1.0, seed=9, max_tokens=14, ignore_eos=True,
                             allowed_token_ids=ALLOWED[:3], logit_bias={ALLOWED[0]: 1.0})
    final = run(eng, requests + [("s", requests[0][1], sampled)])
    for rid, _, _ in requests:
        assert ids_of(final[rid]) == alone[rid], rid
    assert set(ids_of(final["1"])) <= set(ALLOWED) and set(ids_of(final["6"])) <= set(ALLOWED)
    for rid, word in zip(("4", "5"), words):
        for ids in bad_words_token_ids(tok, [word], V):
            assert not _contains(ids_of(final[rid]), ids), (rid, word)
    for i in range(2):
        assert set(ids_of(final["s"], i)) <= set(ALLOWED[:3])
    if "preemption" in config or "chunked" in config:
        assert eng.stats()["preemptions"] > 0


# ------------------------------------------------------------------------------------------------
# Bad values at add_request: the field named, nothing changed, the engine still serves


BAD_RULES = [
    ("logit_bias", [(1, 2.0)]),
    ("logit_bias", {-1: 1.0}),
    ("logit_bias", {"5": 1.0}),
    ("logit_bias", {True: 1.0}),
    ("logit_bias", {5: math.nan}),
    ("logit_bias", {5: math.inf}),
    ("logit_bias", {5: -math.inf}),
    ("logit_bias", {5: "1"}),
    ("logit_bias", {V: 1.0}),  # out of the vocabulary: checked by the engine
    ("allowed_token_ids", []),
    ("allowed_token_ids", [3, -1]),
    ("allowed_token_ids", [3, 2.0]),
    ("allowed_token_ids", 5),
    ("allowed_token_ids", "12"),
    ("allowed_token_ids", [0, V]),
    ("stop_token_ids", [3, V]),  # vLLM's: refused, never sampled
    ("bad_words", [""]),
    ("bad_words", ["  "]),
    ("bad_words", ["ok", 3]),
    ("bad_words", 7),
]


@pytest.mark.parametrize(("field", "value"), BAD_RULES, ids=[f"{f}={v!r}" for f, v in BAD_RULES])
def test_bad_values_name_the_field_and_leak_nothing(engine, plain, field, value):
    prompt, ref = plain[2]
    free = engine.num_free_blocks
    added = engine.stats()["requests_added"]
    if field in ("logit_bias", "allowed_token_ids", "stop_token_ids") and value in ({V: 1.0}, [0, V], [3, V]):
        params = SamplingParams(**{field: value})  # valid on its own: only the vocabulary refuses it
    else:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: value})
        params = SamplingParams()
        setattr(params, field, value)  # assigned after construction: add_request checks again
    with pytest.raises(ValueError, match=field):
        engine.add_request("bad", prompt, params)
    assert engine.num_free_blocks == free and engine.stats()["requests_added"] == added
    assert_idle(engine)
    assert ids_of(run(engine, [("bad", prompt, greedy(logprobs=3))])["bad"]) == list(ref.token_ids)


def test_bad_word_out_of_the_model_vocabulary(tiny_model_dir, tok):
    """A model with fewer ids than its tokenizer: a word encoding to ids past the model's vocab
    is refused naming bad_words, and the engine goes on."""
    eng = tiny_engine(tiny_model_dir("llama-v300", "llama", vocab_size=300))
    assert eng.vocab_size == 300
    assert max(tok.encode("Paris", add_special_tokens=False)) >= 300
    with pytest.raises(ValueError, match="bad_words"):
        eng.add_request("x", "hello", greedy(4, bad_words=["Paris"]))
    assert_idle(eng)
    out = run(eng, [("y", "hello", greedy(4, bad_words=["cat"]))])["y"]
    assert len(out.outputs[0].token_ids) == 4


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_allowed_stop_ids_under_min_tokens_still_yield_only_allowed_tokens(engine, temperature):
    """allowed_token_ids that are all stop ids, banned under min_tokens: the request gets those
    tokens (stopping at min_tokens), never token 0, which it did not allow; a batch-mate is as alone."""
    prompt = rand_prompts(41, [6])[0]
    alone = run(engine, [("alone", prompt, greedy(6))])["alone"]
    params = SamplingParams(temperature=temperature, seed=1, max_tokens=8, min_tokens=4, allowed_token_ids=[7, 9],
                            stop_token_ids=[7, 9])
    final = run(engine, [("a", prompt, params), ("b", prompt, greedy(6))])
    out = final["a"].outputs[0]
    assert len(out.token_ids) == 4 and set(out.token_ids) <= {7, 9}, out
    assert (out.finish_reason, out.stop_reason in (7, 9)) == ("stop", True)
    assert ids_of(final["b"]) == ids_of(alone)
