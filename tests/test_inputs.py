"""Prompt forms (``ferrokv.inputs``): each accepted form gives the same ids, and each bad one a
``ValueError`` naming the field and value."""

from __future__ import annotations

import numpy as np
import pytest

from ferrokv.inputs import batch_prompts, prompt_cache_salt, prompt_ids, validate_prompt_ids


class _Tok:
    """Encodes a character as its code mod 50, after a BOS (0) unless told not to."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [0] * add_special_tokens + [ord(c) % 50 for c in text]


def test_every_prompt_form_gives_its_ids():
    tok = _Tok()
    assert prompt_ids(tok, "abc") == ("abc", [0, 47, 48, 49])
    assert prompt_ids(tok, "abc", add_special_tokens=False) == ("abc", [47, 48, 49])
    assert prompt_ids(tok, {"prompt": "abc"}, add_special_tokens=False) == ("abc", [47, 48, 49])
    assert prompt_ids(tok, {"prompt_token_ids": [1, 2]}) == (None, [1, 2])
    assert prompt_ids(tok, {"prompt_token_ids": np.array([3, 4]), "prompt": "x"}) == ("x", [3, 4])
    # Every form of int, plain Python ints out (the list the core and the outputs hold).
    for ids in ([3, np.int64(4)], np.array([3, 4], dtype=np.uint16), (3, 4), [3, 4]):
        got = prompt_ids(tok, {"prompt_token_ids": ids})[1]
        assert got == [3, 4] and all(type(t) is int for t in got), ids


@pytest.mark.parametrize("prompt, field", [
    (12, "prompt"), ({"text": "x"}, "prompt"), ({"prompt_token_ids": "12"}, "prompt_token_ids"),
    ({"prompt_token_ids": [1, True]}, "prompt_token_ids[1]"), ({"prompt_token_ids": [1.5]}, "prompt_token_ids[0]"),
    ({"prompt_token_ids": np.array([True, False])}, "prompt_token_ids[0]"),
    ({"prompt_token_ids": np.array([1.0, 2.0])}, "prompt_token_ids[0]"),
    ({"prompt_token_ids": np.array([[1, 2]])}, "prompt_token_ids[0]"),
    ("bad \udcff surrogate", "prompt"),
])
def test_bad_prompts_name_the_field(prompt, field):
    with pytest.raises(ValueError, match=field.replace("[", r"\[")):
        prompt_ids(_Tok(), prompt)


@pytest.mark.parametrize("ids, match", [([], "empty"), ([1, 60], r"prompt_token_ids\[1\]=60"),
                                        ([1] * 9, "max_model_len=8"), ([3, -1, 70], r"prompt_token_ids\[1\]=-1")])
def test_ids_are_checked_against_the_vocabulary_and_length(ids, match):
    with pytest.raises(ValueError, match=match):
        validate_prompt_ids(ids, 50, 8)
    validate_prompt_ids([0, 49], 50, 8)


# ------------------------------------------------------------------------------------------------
# vLLM's forms: batching, dict keys and cache_salt (parser), then end to end through LLM / AsyncLLM
# ------------------------------------------------------------------------------------------------
def test_a_list_of_ints_is_one_prompt_and_a_list_of_lists_a_batch():
    assert batch_prompts([1, 2, 3]) == [{"prompt_token_ids": [1, 2, 3]}]
    assert batch_prompts(np.array([1, 2])) == [{"prompt_token_ids": [1, 2]}]
    assert batch_prompts([[1, 2], [3]]) == [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]}]
    assert batch_prompts("a") == ["a"]
    assert batch_prompts({"prompt": "a"}) == [{"prompt": "a"}]
    assert batch_prompts(["a", {"prompt_token_ids": [1]}, [2]]) == ["a", {"prompt_token_ids": [1]},
                                                                     {"prompt_token_ids": [2]}]


@pytest.mark.parametrize("prompts, match", [
    (12, "prompts must be"), ([], "empty"), (["a", 1.5], r"prompts\[1\]"), ([[1, 2], [1, "x"]], r"prompts\[1\]"),
])
def test_bad_batches_name_the_item(prompts, match):
    with pytest.raises(ValueError, match=match):
        batch_prompts(prompts)


@pytest.mark.parametrize("prompt, match", [
    ({"prompt": "x", "cach_salt": "a"}, "unknown key 'cach_salt'"),
    ({"prompt": "x", "multi_modal_data": {"image": 1}}, "multi_modal_data.*not supported"),
    ({"prompt": "x", "mm_processor_kwargs": {"size": 2}}, "mm_processor_kwargs.*not supported"),
    ({"prompt": "x", "token_type_ids": [0]}, "token_type_ids.*not supported"),
    ({"prompt": 3}, r"prompt\['prompt'\] must be a str"),
    ({}, "needs 'prompt_token_ids' or 'prompt'"),
])
def test_bad_prompt_dicts_name_the_key(prompt, match):
    with pytest.raises(ValueError, match=match):
        prompt_ids(_Tok(), prompt)


@pytest.mark.parametrize("key", ["multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids", "token_type_ids"])
@pytest.mark.parametrize("empty", [None, {}, []])
def test_empty_multimodal_keys_are_a_text_prompt(key, empty):
    """vLLM takes its text path when these are empty: scripts that always set them run."""
    assert prompt_ids(_Tok(), {"prompt": "ab", key: empty}) == prompt_ids(_Tok(), {"prompt": "ab"})


def test_cache_salt_of_the_dict_and_of_the_keyword():
    assert prompt_cache_salt({"prompt": "x", "cache_salt": "a"}, None) == "a"
    assert prompt_cache_salt({"prompt": "x"}, "b") == "b"
    assert prompt_cache_salt({"prompt": "x", "cache_salt": "a"}, "a") == "a"
    assert prompt_cache_salt("x", None) is None
    # An empty salt is none (vLLM salts the first block only with a non-empty one): it hits.
    assert prompt_cache_salt("x", "") is None and prompt_cache_salt({"prompt": "x", "cache_salt": ""}, None) is None
    with pytest.raises(ValueError, match=r"prompt\['cache_salt'\]='a' differs from cache_salt='b'"):
        prompt_cache_salt({"prompt": "x", "cache_salt": "a"}, "b")
    with pytest.raises(ValueError, match=r"prompt\['cache_salt'\] must be a str"):
        prompt_cache_salt({"prompt": "x", "cache_salt": 7}, None)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    from ferrokv import LLM

    return LLM(str(tiny_model_dir("llama", "llama")), device="cpu", dtype="float32", max_model_len=64,
               block_size=4, num_kv_blocks=64, enable_prefix_caching=True)


PROMPT = list(range(3, 23))  # 20 tokens: 4 full blocks can be cached


def _cached(llm, prompt) -> int:
    from ferrokv import SamplingParams

    (out,) = llm.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)
    return out.num_cached_tokens


def test_cache_salt_in_the_prompt_dict_isolates_the_prefix_cache(llm):
    assert llm.reset_prefix_cache() is True
    assert _cached(llm, {"prompt_token_ids": PROMPT, "cache_salt": "tenant-a"}) == 0
    assert _cached(llm, {"prompt_token_ids": PROMPT, "cache_salt": "tenant-a"}) > 0  # same tenant: a hit
    assert _cached(llm, {"prompt_token_ids": PROMPT, "cache_salt": "tenant-b"}) == 0  # another: none
    assert _cached(llm, PROMPT) == 0  # unsalted is its own tenant too
    assert _cached(llm, PROMPT) > 0


def test_reset_prefix_cache_forgets_cached_prompts(llm):
    _cached(llm, PROMPT)
    assert _cached(llm, PROMPT) > 0
    assert llm.reset_prefix_cache() is True
    assert _cached(llm, PROMPT) == 0


def test_reset_prefix_cache_refuses_while_requests_run(llm):
    from ferrokv import SamplingParams

    engine = llm.llm_engine
    engine.add_request("busy", {"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=2))
    try:
        assert engine.reset_prefix_cache() is False
    finally:
        engine.abort_request("busy")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.reset_prefix_cache() is True


def test_generate_takes_every_form_and_the_salts_must_agree(llm):
    from ferrokv import SamplingParams

    sp = SamplingParams(max_tokens=2, temperature=0.0)
    outs = llm.generate([PROMPT[:5], {"prompt_token_ids": PROMPT[:5]}], sp, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [PROMPT[:5]] * 2
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    (one,) = llm.generate(PROMPT[:5], sp, use_tqdm=False)  # a bare list of ints: one prompt
    assert one.prompt_token_ids == PROMPT[:5]
    assert len(llm.generate([PROMPT[:5], PROMPT[:3]], sp, use_tqdm=False)) == 2
    with pytest.raises(ValueError, match="differs from cache_salt"):
        llm.llm_engine.add_request("x", {"prompt_token_ids": PROMPT, "cache_salt": "a"}, sp, cache_salt="b")
    with pytest.raises(ValueError, match="unknown key 'salt'"):
        llm.generate({"prompt_token_ids": PROMPT, "salt": "a"}, sp, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_async_generate_keeps_the_cache_salt_of_a_text_prompt(tiny_model_dir):
    import asyncio

    from ferrokv import SamplingParams
    from ferrokv.async_llm import AsyncLLM

    allm = AsyncLLM(str(tiny_model_dir("llama", "llama")), device="cpu", dtype="float32", max_model_len=64,
                    block_size=4, num_kv_blocks=64, enable_prefix_caching=True)
    text = "hello there, this is a prompt long enough to fill a few blocks"

    async def cached(prompt, **kw) -> int:
        last = None
        async for out in allm.generate(prompt, SamplingParams(max_tokens=1), **kw):
            last = out
        return last.num_cached_tokens

    async def run() -> list[int]:
        return [await cached({"prompt": text, "cache_salt": "a"}), await cached({"prompt": text, "cache_salt": "a"}),
                await cached({"prompt": text, "cache_salt": "b"}), await cached(text, cache_salt="b")]

    try:
        first, same, other, keyword = asyncio.run(run())
        assert first == 0 and same > 0 and other == 0 and keyword > 0
    finally:
        allm.shutdown()


def test_logprobs_cap_counts_minus_one_as_the_vocabulary():
    from ferrokv.inputs import check_logprobs_cap

    check_logprobs_cap(20, 20, 20, 1000)
    check_logprobs_cap(None, None, 0, 1000)
    check_logprobs_cap(-1, -1, -1, 1000)  # no cap
    check_logprobs_cap(-1, None, 1000, 1000)
    with pytest.raises(ValueError, match="logprobs=-1 asks for 1000 logprobs, more than max_logprobs=999"):
        check_logprobs_cap(-1, None, 999, 1000)
    with pytest.raises(ValueError, match="prompt_logprobs=6 asks for 6"):
        check_logprobs_cap(5, 6, 5, 1000)


def test_a_prompt_too_long_is_named_as_the_caller_gave_it(llm):
    """A text prompt that tokenizes past max_model_len is the ``prompt``'s fault (the caller gave
    no ids); ids given are ``prompt_token_ids``; both say how many tokens against the limit."""
    from ferrokv import SamplingParams

    params = SamplingParams(max_tokens=1)
    with pytest.raises(ValueError, match=r"^prompt: the prompt has \d+ tokens, more than max_model_len=64"):
        llm.generate("the cat " * 80, params, use_tqdm=False)
    with pytest.raises(ValueError, match=r"^prompt: the prompt has \d+ tokens"):
        llm.generate({"prompt": "the cat " * 80}, params, use_tqdm=False)
    with pytest.raises(ValueError, match=r"^prompt_token_ids: the prompt has 70 tokens, more than max_model_len=64, "
                                         r"which leaves no room for an output token$"):
        llm.generate({"prompt_token_ids": [5] * 70}, params, use_tqdm=False)
    with pytest.raises(ValueError, match=r"^prompt: its token 1 is 999, which is outside the vocabulary \[0, 50\)"):
        validate_prompt_ids([1, 999], 50, 8, tokenized=True)
