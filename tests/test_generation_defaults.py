"""The model's recommended sampling parameters (``ferrokv.generation_defaults``): read from
``generation_config.json`` as vLLM reads them (six keys, transformers' neutral values ignored,
``override_generation_config`` on top, ``"vllm"`` for none), checked at load, and used by
``LLM.generate``/``chat`` without parameters and by every server field a request leaves out
(its ``max_tokens`` caps the request's)."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from helpers.server import serve

from ferrokv import SamplingParams
from ferrokv.engine_args import EngineArgs
from ferrokv.entrypoints.openai.protocol import parse_chat_request, parse_completion_request
from ferrokv.generation_defaults import check_generation_args, defaults_source, load_generation_defaults

QWEN_LIKE = {"bos_token_id": 1, "eos_token_id": [2, 3], "do_sample": True, "temperature": 0.7, "top_p": 0.8,
             "top_k": 20, "repetition_penalty": 1.05, "transformers_version": "4.37.0"}


def _folder(tmp_path, config, name="gen"):
    d = tmp_path / name
    d.mkdir()
    (d / "generation_config.json").write_text(json.dumps(config))
    return d


def test_reads_the_recommended_keys_only(tmp_path):
    d = _folder(tmp_path, {**QWEN_LIKE, "max_new_tokens": 64, "min_p": 0.05})
    assert load_generation_defaults("auto", None, d) == {
        "repetition_penalty": 1.05, "temperature": 0.7, "top_k": 20, "top_p": 0.8, "min_p": 0.05, "max_tokens": 64}


def test_the_file_is_read_as_the_installed_transformers_diffs_it(tmp_path):
    """vLLM reads GenerationConfig.to_diff_dict(): a value equal to the installed transformers'
    default is no recommendation (transformers 4: top_k 50, temperature 1.0 ...; 5: none is)."""
    from transformers import GenerationConfig

    config = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0, "max_new_tokens": None,
              "eos_token_id": 2}
    d = _folder(tmp_path, config)
    diff = GenerationConfig.from_pretrained(str(d)).to_diff_dict()
    want = {k: diff[k] for k in ("temperature", "top_k", "top_p", "repetition_penalty") if diff.get(k) is not None}
    assert load_generation_defaults("auto", None, d) == want
    assert load_generation_defaults("auto", None, tmp_path) == {}  # no file at all


def test_an_override_is_taken_as_given(tmp_path):
    """override_generation_config is set on top as it is: top_k 50 replaces the file's 20, even
    where 50 is transformers' default (vLLM never diffs the overrides)."""
    d = _folder(tmp_path, {"temperature": 0.6, "top_k": 20})
    assert load_generation_defaults("auto", {"top_k": 50}, d) == {"temperature": 0.6, "top_k": 50}


def test_vllm_source_ignores_the_file_but_not_the_overrides(tmp_path):
    d = _folder(tmp_path, QWEN_LIKE)
    assert load_generation_defaults("vllm", None, d) == {}
    assert load_generation_defaults("vllm", {"temperature": 0.3}, d) == {"temperature": 0.3}


def test_folder_source_and_overrides_on_top(tmp_path):
    model = _folder(tmp_path, {"temperature": 0.9}, "model")
    other = _folder(tmp_path, {"temperature": 0.2, "top_p": 0.5}, "other")
    assert load_generation_defaults(str(other), None, model) == {"temperature": 0.2, "top_p": 0.5}
    got = load_generation_defaults("auto", {"temperature": 0.0, "max_new_tokens": 5}, model)
    assert got == {"temperature": 0.0, "max_tokens": 5}


def test_a_folder_source_expands_the_home_directory(tmp_path, monkeypatch):
    from ferrokv.generation_defaults import check_generation_args

    monkeypatch.setenv("HOME", str(tmp_path))
    _folder(tmp_path, {"top_p": 0.5}, "gen")
    check_generation_args("~/gen", None)
    assert load_generation_defaults("~/gen", None, tmp_path) == {"top_p": 0.5}


def test_the_source_is_named_as_given(tmp_path):
    """What the engine's log line and errors say the defaults come from."""
    model, other = _folder(tmp_path, {"temperature": 0.9}, "model"), _folder(tmp_path, {"top_k": 2}, "other")
    assert defaults_source("auto", None, model) == f"{model}/generation_config.json"
    assert defaults_source("auto", {"top_k": 5}, model) == f"{model}/generation_config.json with override_generation_config"
    assert defaults_source(str(other), None, model) == f"{other}/generation_config.json"
    assert defaults_source("vllm", {"top_k": 5}, model) == "override_generation_config"
    assert defaults_source("auto", {"top_k": 5}, tmp_path / "no-file") == "override_generation_config"
    with pytest.raises(ValueError, match="generation_config: override_generation_config recommends"):
        load_generation_defaults("vllm", {"temperature": -1.0}, model)


@pytest.mark.parametrize("config, needle", [
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 2.0}, "top_p"),
    ({"max_new_tokens": 0}, "max_new_tokens|max_tokens"),
])
def test_an_invalid_recommendation_fails_at_load_naming_it(tmp_path, config, needle):
    d = _folder(tmp_path, config)
    with pytest.raises(ValueError, match=f"generation_config: .*({needle})"):
        load_generation_defaults("auto", None, d)


def test_unreadable_file_is_a_value_error(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config: cannot read"):
        load_generation_defaults("auto", None, d)
    (d / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        load_generation_defaults("auto", None, d)


@pytest.mark.parametrize("source, overrides, needle", [
    ("", None, "generation_config must be"),
    (3, None, "generation_config must be"),
    ("/no/such/folder", None, "no folder with a generation_config.json"),
    ("auto", [("temperature", 0.5)], "override_generation_config must be a dict"),
    ("auto", {1: 0.5}, "override_generation_config must be a dict"),
])
def test_engine_args_check_the_settings(source, overrides, needle):
    with pytest.raises(ValueError, match=needle):
        check_generation_args(source, overrides)
    with pytest.raises(ValueError, match=needle):
        EngineArgs(generation_config=source, override_generation_config=overrides).validate()


def test_server_fields_left_out_take_the_defaults():
    defaults = {"temperature": 0.7, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 8}
    p = parse_completion_request({"prompt": "x"}, defaults=defaults).params
    assert (p.temperature, p.top_k, p.repetition_penalty, p.max_tokens) == (0.7, 20, 1.05, 8)
    body = {"prompt": "x", "temperature": 0.5, "top_k": 5, "max_tokens": 4}
    p = parse_completion_request(body, defaults=defaults).params
    assert (p.temperature, p.top_k, p.repetition_penalty, p.max_tokens) == (0.5, 5, 1.05, 4)
    # vLLM: the recommended max_tokens caps the request's.
    assert parse_completion_request({"prompt": "x", "max_tokens": 100}, defaults=defaults).params.max_tokens == 8
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert parse_chat_request(chat, defaults=defaults).params.max_tokens == 8
    assert parse_chat_request(chat).params.max_tokens is None  # no recommendation: until max_model_len
    assert parse_completion_request({"prompt": "x"}).params == SamplingParams(max_tokens=16, output_kind=p.output_kind)


@pytest.fixture(scope="module")
def recommending_model(tiny_model_dir, tmp_path_factory):
    """The tiny llama with a generation_config.json that recommends greedy decoding of 3 tokens."""
    d = tmp_path_factory.mktemp("gen_defaults") / "model"
    shutil.copytree(tiny_model_dir("llama"), d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "temperature": 0.0, "max_new_tokens": 3}))
    return d


def test_llm_without_params_uses_the_models_recommendation(recommending_model):
    from ferrokv import LLM

    llm = LLM(str(recommending_model), num_kv_blocks=64, max_model_len=128)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=3)
    assert llm.llm_engine.model_config.get_diff_sampling_param() == {"temperature": 0.0, "max_tokens": 3}  # vLLM's
    got = llm.generate(["The cat runs", "A dog"], use_tqdm=False)
    want = llm.generate(["The cat runs", "A dog"], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert all(len(o.outputs[0].token_ids) <= 3 for o in got)
    chat = llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)
    assert len(chat[0].outputs[0].token_ids) <= 3

    neutral = LLM(str(recommending_model), num_kv_blocks=64, max_model_len=128, generation_config="vllm")
    assert neutral.get_default_sampling_params() == SamplingParams()
    over = LLM(str(recommending_model), num_kv_blocks=64, max_model_len=128,
               override_generation_config={"max_new_tokens": 5})
    assert over.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=5)


def test_server_applies_the_recommendation(recommending_model):
    from ferrokv import LLM

    ref = LLM(str(recommending_model), num_kv_blocks=64, max_model_len=128)
    want = ref.generate("The cat runs", SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    with serve(recommending_model, "--max-model-len", "128", "--override-generation-config",
               '{"max_new_tokens": 2}') as s, httpx.Client(base_url=s.url, timeout=120.0) as http:
        # No temperature or max_tokens: greedy (the file) and 2 tokens (the override caps 16).
        body = http.post("/v1/completions", json={"prompt": "The cat runs", "max_tokens": 50}).json()
        assert body["choices"][0]["text"] == want[0].outputs[0].text
        assert body["usage"]["completion_tokens"] == len(want[0].outputs[0].token_ids)


def test_a_default_max_tokens_is_cut_to_the_context_and_only_a_given_one_is_refused(recommending_model):
    """vLLM's get_max_tokens: a max_tokens the request left out (the model's default, here 20) is cut
    to what the context leaves; only one the request gave is checked against it, and the error
    names that one (serveropts8: a chat near the end of the context was refused, naming the default)."""
    with serve(recommending_model, "--max-model-len", "32", "--override-generation-config",
               '{"max_new_tokens": 20}') as s, httpx.Client(base_url=s.url, timeout=120.0) as http:
        for words in range(4, 40):
            messages = [{"role": "user", "content": " ".join(["cat"] * words)}]
            prompt_len = http.post("/tokenize", json={"messages": messages}).json()["count"]
            if prompt_len + 20 > 32:
                break
        assert 12 < prompt_len < 32, prompt_len
        r = http.post("/v1/chat/completions", json={"messages": messages, "temperature": 0.0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 32 - prompt_len
        assert r.json()["choices"][0]["finish_reason"] == "length"
        r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 30})
        assert r.status_code == 400 and "max_tokens=30 is too large" in r.json()["error"]["message"], r.text
