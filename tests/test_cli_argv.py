"""vLLM's command-line conventions (ferrokv.cli_argv), read through the real ``ferrokv`` parser."""

from __future__ import annotations

import pytest

from ferrokv.cli import _parse


def test_underscored_flag_names_and_short_flags_are_vllms():
    args = _parse(["serve", "m", "--max_model_len", "64", "--gpu_memory_utilization=0.5", "-tp", "1",
                   "--served_model_name", "my_model", "--enable_prefix_caching"])
    assert (args.max_model_len, args.gpu_memory_utilization, args.tensor_parallel_size) == (64, 0.5, 1)
    assert args.served_model_name == ["my_model"] and args.enable_prefix_caching is True  # values keep theirs
    args = _parse(["generate", "--max_tokens=3", "--stop", "a_b", "--", "--not_a_flag"])
    assert args.sampling_max_tokens == 3 and args.sampling_stop == ["a_b"] and args.prompts == ["--not_a_flag"]


def test_free_text_that_looks_like_a_flag_keeps_its_underscores():
    """argparse reads a token with a space as a value: a prompt, a stop string or a system prompt
    starting with dashes is text, never renamed."""
    args = _parse(["generate", "-- select user_id from t", "--stop", "-- end_of section"])
    assert args.prompts == ["-- select user_id from t"] and args.sampling_stop == ["-- end_of section"]
    assert _parse(["chat", "--system", "--- you are a_b helper"]).system == "--- you are a_b helper"


def test_a_config_file_gives_flags_that_the_command_line_overrides(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("model: from-config\nmax_model_len: 128\nenable-prefix-caching: false\nserved_model_name: [a, b]\n"
                   "api_key: k\nhf_overrides: {max_position_embeddings: 256}\nenable_auto_tool_choice: false\n"
                   "tool_call_parser: hermes\nport: 9000\n")
    args = _parse(["serve", "--config", str(cfg), "--port", "9001"])
    assert (args.model, args.model_pos, args.max_model_len, args.enable_prefix_caching) == ("from-config", None, 128,
                                                                                           False)
    assert args.served_model_name == ["a", "b"] and args.api_key == ["k"] and args.port == 9001
    assert args.hf_overrides == {"max_position_embeddings": 256} and args.enable_auto_tool_choice is False
    args = _parse(["serve", "m", f"--config={cfg}", "--max-model-len", "64", "--enable-prefix-caching"])
    assert (args.model_pos, args.max_model_len, args.enable_prefix_caching) == ("m", 64, True)
    # vLLM's documented file names the model; a positional one wins (vLLM: "keep CLI version").
    both = tmp_path / "both.yaml"
    both.write_text("model: from-config\nport: 9002\napi_key: -Xk3y_abc\n")
    args = _parse(["serve", "cli-model", "--config", str(both)])
    assert (args.model_pos, args.model, args.port, args.api_key) == ("cli-model", None, 9002, ["-Xk3y_abc"])
    gen = tmp_path / "gen.yml"
    gen.write_text("stop: [x, y]\nmax_tokens: 5\n")
    args = _parse(["generate", "--config", str(gen), "hi", "there"])
    assert (args.sampling_stop, args.sampling_max_tokens, args.prompts) == (["x", "y"], 5, ["hi", "there"])


@pytest.mark.parametrize("content, name, needle", [
    (None, "missing.yaml", "cannot be read"),
    ("max_model_len: 64\n", "cfg.json", "is not a .yaml or .yml file"),
    ("- a\n- b\n", "cfg.yaml", "must hold a mapping"),
    ("a: [\n", "cfg.yaml", "is not valid YAML"),
])
def test_a_bad_config_file_is_a_usage_error_naming_it(tmp_path, capsys, content, name, needle):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as e:
        _parse(["serve", "--config", str(path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--config" in err and needle in err and name in err


def test_an_unknown_flag_is_reported_with_the_commands_usage(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("tool_parser_plugin: parsers.py\n")
    for argv in (["serve", "m", "--tool_parser_plugin", "parsers.py"], ["serve", "--config", str(cfg)]):
        with pytest.raises(SystemExit) as e:
            _parse(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and "ferrokv serve: error: unrecognized arguments: --tool-parser-plugin" in err
        assert "usage: ferrokv serve" in err
    with pytest.raises(SystemExit):
        _parse(["serve", "--config"])
    assert "--config needs a YAML file" in capsys.readouterr().err


def test_an_unknown_flag_whose_value_holds_a_space_is_unrecognized_not_the_model(tmp_path, capsys):
    """argparse reads an unknown ``--name=value with spaces`` as a positional: it was taken as the
    model ("model: '--compilation-config={"level": 3}' is neither..."), as vLLM configs' nested keys
    came in (cli7)."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text('port: 8799\nmystery_config: {"level": 3, "name": "a b"}\n')
    for argv, flag in ((["serve", "--config", str(cfg)], "--mystery-config="),
                       (["serve", "--model", "m", '--chat-template-kwargs={"a": 1}'], "--chat-template-kwargs="),
                       (["generate", '--mystery={"a b": 1}', "hi"], "--mystery=")):
        with pytest.raises(SystemExit) as e:
            _parse(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"unrecognized arguments: {flag}" in err, err
    # After `--`, it is a prompt like any other (review23).
    assert _parse(["generate", "--", "--x=1 2"]).prompts == ["--x=1 2"]


def test_a_null_in_a_config_file_means_the_flags_default(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("quantization: null\nmax_model_len: null\nport: 9003\n")
    args = _parse(["serve", "m", "--config", str(cfg)])
    assert (args.quantization, args.max_model_len, args.port) == (None, None, 9003)


def test_vllm_only_flags_are_read_as_llm_reads_them():
    """vLLM's flags for what ferrokv does not have (VLLM_ONLY_ARGS): a value meaning what ferrokv does
    passes, with vLLM's short forms (cli7: they were all "unrecognized"); a switch takes no value."""
    from ferrokv.engine_args import EngineArgs

    args = _parse(["serve", "m", "-pp", "1", "-dp=1", "-O0", "--max-seq-len-to-capture", "8192",
                   "--disable-custom-all-reduce", "--distributed-executor-backend", "mp",
                   "--limit-mm-per-prompt", '{"image": 0}', "--compilation-config", '{"level": 3}'])
    assert (args.pipeline_parallel_size, args.data_parallel_size, args.compilation_config) == (1, 1, {"level": 3})
    assert args.limit_mm_per_prompt == {"image": 0} and args.distributed_executor_backend == "mp"
    EngineArgs.from_cli_args(args)
    assert _parse(["generate", "--disable-custom-all-reduce", "hi"]).prompts == ["hi"]


def test_each_vllm_only_switch_is_checked_as_llm_checks_it():
    """Every vLLM-only switch reaches the one check (EngineArgs.from_cli_args) with the value LLM()
    would get: on, refused naming it where on is not what ferrokv does; --no- form always fine."""
    from ferrokv.cli import _VLLM_ONLY_SWITCHES
    from ferrokv.engine_args import VLLM_ONLY_ARGS, EngineArgs

    for name in sorted(_VLLM_ONLY_SWITCHES):
        flag = "--" + name.replace("_", "-")
        fits = VLLM_ONLY_ARGS[name][0]
        args = _parse(["serve", "m", flag])
        assert getattr(args, name) is True
        if fits(True):
            EngineArgs.from_cli_args(args)
        else:
            with pytest.raises(ValueError, match=rf"^{name}=True is not supported"):
                EngineArgs.from_cli_args(args)
        assert getattr(_parse(["serve", "m", f"--no-{flag[2:]}"]), name) is False
    assert _parse(["serve", "m", "-O3"]).compilation_config == 3 and _parse(["serve", "m", "--hf-token"]).hf_token is True


def test_vllm_flags_for_what_ferrokv_always_does_are_accepted():
    args = _parse(["serve", "m", "--disable-fastapi-docs", "--enable-prompt-tokens-details",
                   "--disable-frontend-multiprocessing"])
    assert args.model_pos == "m"
