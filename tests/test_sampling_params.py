"""SamplingParams: vLLM defaults, normalisation, and validation messages naming field and value."""

import dataclasses
import math

import pytest

from ferrokv.sampling_params import (GREEDY_EPS, MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MIN_TEMPERATURE,
                                     SamplingParams)


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.seed, p.max_tokens, p.min_tokens) == (None, 16, 0)
    assert p.stop == [] and p.stop_token_ids == []
    assert not p.ignore_eos and not p.include_stop_str_in_output
    assert p.logprobs is None and p.skip_special_tokens
    assert not p.is_greedy and not p.has_penalties and p.max_stop_len == 0
    # vLLM's skip_reading_prefix_cache: by default, whether prompt logprobs are asked.
    assert p.skip_reading_prefix_cache is False and SamplingParams(prompt_logprobs=0).skip_reading_prefix_cache
    with pytest.raises(ValueError, match="skip_reading_prefix_cache must be a bool, got 'yes'"):
        SamplingParams(skip_reading_prefix_cache="yes")


def test_guided_decoding_is_structured_outputs_under_vllms_former_name():
    from ferrokv.sampling_params import GuidedDecodingParams, StructuredOutputsParams

    p = SamplingParams(guided_decoding=GuidedDecodingParams(choice=["yes", "no"]))
    assert p.structured_outputs == StructuredOutputsParams(choice=["yes", "no"]) and p.guided_decoding is None
    with pytest.raises(ValueError, match="structured_outputs or guided_decoding"):
        SamplingParams(structured_outputs={"regex": "a"}, guided_decoding=GuidedDecodingParams(regex="b"))


def test_positional_arguments_mean_what_they_mean_in_vllm():
    """vLLM's SamplingParams takes its fields positionally too, in this order."""
    p = SamplingParams(2, 0.1, 0.2, 1.3, 0.7, 0.9, 5, 0.05, 7, ["x"], [3], True, 9, 1, 2)
    assert (p.n, p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.temperature) == (2, 0.1, 0.2, 1.3, 0.7)
    assert (p.top_p, p.top_k, p.min_p, p.seed, p.stop, p.stop_token_ids) == (0.9, 5, 0.05, 7, ["x"], [3])
    assert (p.ignore_eos, p.max_tokens, p.min_tokens, p.logprobs) == (True, 9, 1, 2)


def test_stops_are_deduplicated_and_bounded():
    """A repeat stops nothing more but costs every step (each token is searched for every stop
    string; under min_tokens every stop id is banned per row): repeats go, as vLLM drops repeated
    stop ids, and what is left is bounded, naming the field."""
    p = SamplingParams(stop=["b", "a", "b"], stop_token_ids=[7, 3, 7, 7] * 100_000)
    assert (p.stop, p.stop_token_ids) == (["b", "a"], [7, 3])
    SamplingParams(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS)], stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)))
    SamplingParams(stop=["x" * MAX_STOP_CHARS])
    for kw, needle in (({"stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}, "stop: at most"),
                       ({"stop": ["x" * MAX_STOP_CHARS, "y"]}, f"of {MAX_STOP_CHARS + 1}"),
                       ({"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}, "stop_token_ids: at most")):
        with pytest.raises(ValueError, match=needle):
            SamplingParams(**kw)


def test_normalisation():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "bcd")).max_stop_len == 3
    assert SamplingParams(stop_token_ids=(5, 7)).stop_token_ids == [5, 7]
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert isinstance(SamplingParams(temperature=1).temperature, float)


def test_greedy_neutralises_truncation():
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert p.is_greedy and (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(temperature=0).is_greedy
    assert not SamplingParams(temperature=GREEDY_EPS * 2).is_greedy


@pytest.mark.parametrize("temperature", [GREEDY_EPS / 2, GREEDY_EPS * 2, 0.005])
def test_tiny_temperature_is_raised_as_vllm(temperature, caplog):
    # vLLM raises 0 < temperature < 0.01 to 0.01 (logits / ~0 overflow), so such a request
    # samples, and is not greedy.
    with caplog.at_level("WARNING", logger="ferrokv"):
        p = SamplingParams(temperature=temperature)
    assert p.temperature == MIN_TEMPERATURE and not p.is_greedy
    assert "raised to 0.01" in caplog.text
    assert SamplingParams(temperature=MIN_TEMPERATURE).temperature == MIN_TEMPERATURE


def test_replace_revalidates():
    p = dataclasses.replace(SamplingParams(stop="x"), n=2)
    assert p.n == 2 and p.stop == ["x"]
    with pytest.raises(ValueError, match="temperature"):
        dataclasses.replace(p, temperature=-3.0)


BAD = [
    ("n", 0),
    ("n", -2),
    ("truncate_prompt_tokens", 0),
    ("truncate_prompt_tokens", -2),
    ("truncate_prompt_tokens", 2.5),
    ("truncate_prompt_tokens", True),
    ("n", 1.5),
    ("n", True),
    ("temperature", -1.0),
    ("temperature", math.inf),
    ("temperature", math.nan),
    ("temperature", "hot"),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", -0.1),
    ("top_p", math.nan),
    ("top_k", -2),
    ("top_k", 2.5),
    ("min_p", -0.1),
    ("min_p", 1.1),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.1),
    ("frequency_penalty", 3.0),
    ("frequency_penalty", -2.5),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", math.inf),
    ("seed", 1.5),
    ("seed", "7"),
    ("seed", 1 << 64),  # beyond torch's seed range: would wrap onto another seed
    ("seed", -(1 << 63) - 1),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("max_tokens", 3.0),
    ("min_tokens", -1),
    ("logprobs", -2),
    ("logprobs", 2.0),
    ("stop_token_ids", [3, -1]),
    ("stop_token_ids", [3, "4"]),
    ("stop", ["ok", ""]),
    ("stop", ["ok", 5]),
    ("ignore_eos", 1),
    ("include_stop_str_in_output", "yes"),
    ("skip_special_tokens", None),
]


@pytest.mark.parametrize(("field", "value"), BAD, ids=[f"{f}={v!r}" for f, v in BAD])
def test_validation_names_field_and_value(field, value):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    msg = str(info.value)
    assert field in msg
    # The offending value itself (an element for list fields) appears in the message.
    shown = value
    if field == "stop_token_ids":
        shown = value[-1]
    elif field == "stop" and value[-1] == 5:
        shown = 5
    assert repr(shown) in msg, msg


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                                   "repetition_penalty", "logit_bias"])
def test_an_int_too_large_for_a_float_is_a_value_error_naming_the_field(field):
    """10**400 is a valid int (and valid JSON) that no float holds: a ValueError, not an OverflowError."""
    value = {5: 10 ** 400} if field == "logit_bias" else -10 ** 400
    with pytest.raises(ValueError, match=rf"^{field}(\[5\])? must be a finite number, got -?1000"):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match=r"min_tokens must be <= max_tokens \(4\), got 5"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=None, min_tokens=100).min_tokens == 100


def test_example_message():
    with pytest.raises(ValueError, match=r"^temperature must be >= 0 and finite, got -1\.0$"):
        SamplingParams(temperature=-1.0)


# --- prompt_logprobs, detokenize, logit_bias, allowed_token_ids, bad_words --------------------


def test_new_fields_defaults():
    p = SamplingParams()
    assert p.prompt_logprobs is None and p.detokenize is True
    assert p.logit_bias is None and p.allowed_token_ids is None and p.bad_words is None


def test_new_fields_normalisation():
    import numpy as np

    p = SamplingParams(logit_bias={np.int64(3): 1, 5: np.float32(-0.5), 7: 2.5})
    assert p.logit_bias == {3: 1.0, 5: -0.5, 7: 2.5}
    assert all(type(k) is int and type(v) is float for k, v in p.logit_bias.items())
    assert SamplingParams(logit_bias={}).logit_bias == {}
    for ids in ((3, 4), [3, 4], range(3, 5), np.array([3, 4])):
        got = SamplingParams(allowed_token_ids=ids).allowed_token_ids
        assert got == [3, 4] and type(got) is list and all(type(t) is int for t in got), ids
    assert SamplingParams(bad_words="word").bad_words == ["word"]
    assert SamplingParams(bad_words=("a b", " c")).bad_words == ["a b", " c"]
    assert SamplingParams(bad_words=[]).bad_words == []
    assert SamplingParams(prompt_logprobs=0).prompt_logprobs == 0
    assert SamplingParams(prompt_logprobs=20).prompt_logprobs == 20
    # detokenize=False is fine without stop strings (stop ids are token ids, not text).
    p = SamplingParams(detokenize=False, stop=None, stop_token_ids=[5])
    assert p.stop == [] and p.stop_token_ids == [5] and p.detokenize is False


def test_new_fields_are_copied_on_replace():
    """The engine keeps ``dataclasses.replace(params)``: the caller's later edits of its dict /
    lists must not reach the copy."""
    p = SamplingParams(logit_bias={1: 1.0}, allowed_token_ids=[1, 2], bad_words=["x"])
    q = dataclasses.replace(p)
    p.logit_bias[2] = 5.0
    p.allowed_token_ids.append(3)
    p.bad_words.append("y")
    assert q.logit_bias == {1: 1.0} and q.allowed_token_ids == [1, 2] and q.bad_words == ["x"]


def test_stop_strings_need_detokenize():
    for stop in ("x", ["a", "bc"]):
        with pytest.raises(ValueError) as info:
            SamplingParams(stop=stop, detokenize=False)
        msg = str(info.value)
        assert "stop" in msg and "detokenize" in msg, msg
    p = SamplingParams(detokenize=False)
    with pytest.raises(ValueError, match="detokenize"):
        dataclasses.replace(p, stop=["z"])
    p.stop = ["z"]  # assigned later: the next validate() (the engine's copy) refuses it
    with pytest.raises(ValueError, match="detokenize"):
        p.validate()


BAD_NEW = [
    # (field, value, what the message shows)
    ("prompt_logprobs", -2, -2),
    ("prompt_logprobs", 1.5, 1.5),
    ("prompt_logprobs", "2", "2"),
    ("prompt_logprobs", False, False),  # True is vLLM's 1; False is refused, not read as 0
    ("detokenize", 1, 1),
    ("detokenize", "no", "no"),
    ("detokenize", None, None),
    ("logit_bias", [(1, 2.0)], [(1, 2.0)]),
    ("logit_bias", {-1: 1.0}, -1),
    ("logit_bias", {"5": 1.0}, "5"),
    ("logit_bias", {1.0: 1.0}, 1.0),
    ("logit_bias", {True: 1.0}, True),
    ("logit_bias", {5: math.nan}, math.nan),
    ("logit_bias", {5: math.inf}, math.inf),
    ("logit_bias", {5: "1"}, "1"),
    ("logit_bias", {5: None}, None),
    ("allowed_token_ids", [], []),
    ("allowed_token_ids", [3, -1], [3, -1]),
    ("allowed_token_ids", [3, "4"], [3, "4"]),
    ("allowed_token_ids", [True], [True]),
    ("allowed_token_ids", 5, 5),
    ("allowed_token_ids", "12", "12"),
    ("bad_words", [""], ""),
    ("bad_words", ["ok", "  "], "  "),
    ("bad_words", ["ok", 3], 3),
    ("bad_words", [b"x"], b"x"),
    ("bad_words", 7, 7),
    ("bad_words", ["a\ud800"], "a\ud800"),
]


@pytest.mark.parametrize(("field", "value", "shown"), BAD_NEW, ids=[f"{f}={v!r}" for f, v, _ in BAD_NEW])
def test_new_fields_validation_names_field_and_value(field, value, shown):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    msg = str(info.value)
    assert field in msg, msg
    assert repr(shown) in msg, msg
    # The same value assigned after construction is refused by validate() (add_request runs it).
    p = SamplingParams()
    setattr(p, field, value)
    with pytest.raises(ValueError, match=field):
        p.validate()


def test_clone_is_a_deep_copy():
    p = SamplingParams(temperature=0.5, stop=["a"], logit_bias={3: 1.0}, bad_words=["x"], seed=4)
    c = p.clone()
    assert c == p and c is not p
    c.stop.append("b")
    c.logit_bias[4] = 2.0
    assert p.stop == ["a"] and p.logit_bias == {3: 1.0}


def test_seed_minus_one_means_no_seed_as_in_vllm():
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(seed=-2).seed == -2


def test_spaces_between_special_tokens_is_vllms_field():
    assert SamplingParams().spaces_between_special_tokens is True
    SamplingParams(spaces_between_special_tokens=False)  # no effect while special tokens are skipped
    SamplingParams(spaces_between_special_tokens=False, skip_special_tokens=False)  # as vLLM: test_text_layer
    with pytest.raises(ValueError, match="spaces_between_special_tokens must be a bool"):
        SamplingParams(spaces_between_special_tokens="no")


def test_vllm_spellings_logprobs_true_extra_args_and_from_optional():
    p = SamplingParams(logprobs=True, prompt_logprobs=True, extra_args={"k": [1]})
    assert (p.logprobs, p.prompt_logprobs, p.extra_args) == (1, 1, {"k": [1]})
    with pytest.raises(ValueError, match="logprobs must be None.*got False"):
        SamplingParams(logprobs=False)
    with pytest.raises(ValueError, match="extra_args must be None or a dict"):
        SamplingParams(extra_args=[1])
    # from_optional: None means the default, unless None is a value of the field's own.
    q = SamplingParams.from_optional(n=None, temperature=None, top_p=0.5, max_tokens=None, seed=None, stop=None)
    assert (q.n, q.temperature, q.top_p, q.max_tokens, q.seed, q.stop) == (1, 1.0, 0.5, None, None, [])
    with pytest.raises(TypeError):
        SamplingParams.from_optional(not_a_field=None)
    # vLLM's from_optional reads logit_bias as OpenAI's: string keys, biases clamped to [-100, 100].
    assert SamplingParams.from_optional(logit_bias={"5": 1000.0, 6: -1e9, "7": 0.5}).logit_bias == {
        5: 100.0, 6: -100.0, 7: 0.5}
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams.from_optional(logit_bias={"x": 1.0})


def test_sampling_type_and_logits_processors_as_vllm():
    from ferrokv.sampling_params import SamplingType

    assert SamplingParams(temperature=0).sampling_type is SamplingType.GREEDY
    assert SamplingParams(temperature=0, seed=3).sampling_type is SamplingType.GREEDY
    assert SamplingParams(temperature=0.7).sampling_type is SamplingType.RANDOM
    assert SamplingParams(temperature=0.7, seed=3).sampling_type is SamplingType.RANDOM_SEED
    assert SamplingParams(logits_processors=[]).logits_processors == []  # vLLM V1 takes an empty list too
    with pytest.raises(ValueError, match="logits_processors: per-request logits processors are not supported"):
        SamplingParams(logits_processors=[lambda ids, logits: logits])
    p = SamplingParams()
    p.logits_processors = [print]  # assigned after construction: refused when the engine takes it
    with pytest.raises(ValueError, match="logits_processors"):
        p.validate()
