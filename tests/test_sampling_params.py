"""SamplingParams: vLLM defaults, normalisation, and validation messages naming field and value."""

import dataclasses
import math

import pytest

from ferrokv.sampling_params import GREEDY_EPS, SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.seed, p.max_tokens, p.min_tokens) == (None, 16, 0)
    assert p.stop == [] and p.stop_token_ids == []
    assert not p.ignore_eos and not p.include_stop_str_in_output
    assert p.logprobs is None and p.skip_special_tokens
    assert not p.is_greedy and not p.has_penalties and p.max_stop_len == 0


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
    assert SamplingParams(temperature=GREEDY_EPS / 2).is_greedy
    assert not SamplingParams(temperature=GREEDY_EPS * 2).is_greedy


def test_replace_revalidates():
    p = dataclasses.replace(SamplingParams(stop="x"), n=2)
    assert p.n == 2 and p.stop == ["x"]
    with pytest.raises(ValueError, match="temperature"):
        dataclasses.replace(p, temperature=-3.0)


BAD = [
    ("n", 0),
    ("n", -2),
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
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("max_tokens", 3.0),
    ("min_tokens", -1),
    ("logprobs", -1),
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


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match=r"min_tokens must be <= max_tokens \(4\), got 5"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=None, min_tokens=100).min_tokens == 100


def test_example_message():
    with pytest.raises(ValueError, match=r"^temperature must be >= 0 and finite, got -1\.0$"):
        SamplingParams(temperature=-1.0)
