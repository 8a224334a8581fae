"""The ``ferrokv`` command line: generate and chat on a tiny model (in-process)."""

from __future__ import annotations

import io
import sys

import pytest

from ferrokv.cli import main


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return str(tiny_model_dir("cli"))


def test_generate_prints_answers_and_stats(model, capsys):
    rc = main(["generate", "--model", model, "--raw", "--quiet", "--max-tokens", "5", "--num-kv-blocks", "64",
               "--block-size", "4", "--max-model-len", "128", "--no-enable-prefix-caching", "hello", "the cat"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "### hello" in out and "### the cat" in out
    assert "2 requests, 10 tokens generated" in out
    assert "KV cache: peak" in out and "prefix cache: 0 of" in out


def test_generate_refuses_a_model_given_as_a_prompt(model, capsys, tmp_path):
    """``ferrokv generate MODEL``, written as ``serve MODEL`` is: its arguments are prompts, so the
    default model completed the path (cli7); a model folder or .gguf file is refused, before loading."""
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    for prompt in (model, str(gguf)):
        assert main(["generate", prompt, "--max-tokens", "2"]) == 2
        err = capsys.readouterr().err
        assert f"prompts: {prompt!r} is a model, not a prompt: give it as --model {prompt}" in err, err
    # Prompts no path could be are prompts (review23: OSError for a long one, RuntimeError for ~word).
    long, tilde = "a" * 260, "~friend, hello"  # a 260-character path component
    assert main(["generate", "--model", model, "--raw", "--quiet", "--max-tokens", "1", "--num-kv-blocks", "64",
                 "--max-model-len", "512", long, tilde]) == 0
    out = capsys.readouterr().out
    assert f"### {long}" in out and f"### {tilde}" in out


def test_generate_prints_each_text_as_generated(model, capsys):
    """Leading newlines and indentation are part of a completion (it printed them stripped)."""
    from ferrokv import LLM, SamplingParams

    llm = LLM(model, num_gpu_blocks_override=64, max_model_len=128)
    prompts = ["hello", "the cat", "a dog", "one two", "we see", "x", "the", "runs", "blue sky", "bread", "my friend",
               "Paris", "a long story"]
    texts = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6,
                                                                               ignore_eos=True), use_tqdm=False)]
    prompt, text = next((p, t) for p, t in zip(prompts, texts) if t != t.strip())  # one the strip would change
    assert main(["generate", "--model", model, "--raw", "--quiet", "--max-tokens", "6", "--temperature", "0",
                 "--ignore-eos", "--num-kv-blocks", "64", "--max-model-len", "128", prompt]) == 0
    assert f"### {prompt}\n{text}\n" in capsys.readouterr().out


def test_unset_sampling_flags_take_the_models_generation_config(model, capsys, tmp_path):
    """vLLM applies the model's recommendations to every field the caller leaves unset: here a
    max_new_tokens of 3; a flag given wins; --generation-config vllm ignores the model's (the CLI's
    128 tokens, here cut at max_model_len by the 3-token prompt)."""
    import json
    import shutil

    recommending = tmp_path / "recommending"
    shutil.copytree(model, recommending)
    (recommending / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3, "eos_token_id": None}))
    common = ["generate", "--model", str(recommending), "--raw", "--quiet", "--num-kv-blocks", "64",
              "--max-model-len", "128", "--ignore-eos", "hello"]
    raised = ["--override-generation-config", '{"max_new_tokens": 300}', "--min-tokens", "200"]  # > the CLI's 128
    for extra, tokens in (([], 3), (["--max-tokens", "5"], 5), (["--generation-config", "vllm"], 128 - 3),
                          (raised, 128 - 3)):
        assert main(common + extra) == 0
        out = capsys.readouterr().out
        assert f"1 request, {tokens} tokens generated" in out, (extra, out)


def test_generate_reports_bad_flags_as_errors(model, capsys):
    rc = main(["generate", "--model", model, "--raw", "--quiet", "--temperature", "-1", "hi"])
    assert rc == 2
    assert "temperature" in capsys.readouterr().err
    rc = main(["generate", "--model", "/nonexistent/model", "--quiet", "hi"])
    assert rc == 2
    assert "/nonexistent/model" in capsys.readouterr().err


def test_chat_reads_turns_from_stdin(model, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello there\n\nhow are you\n/exit\n"))
    rc = main(["chat", "--model", model, "--max-tokens", "4", "--num-kv-blocks", "64", "--max-model-len", "256"])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.count("assistant> ") == 2


def test_chat_goes_on_when_the_conversation_outgrows_max_model_len(model):
    """A real `ferrokv chat` process fed turns on stdin: the history outgrows max_model_len=64, so
    the oldest turns go (stderr says so) and every message still gets an answer; one message that
    cannot fit even alone is refused on stderr, and the chat goes on after it."""
    import subprocess

    turns = ["the cat reads a long story today again", "my friend likes fresh bread in Paris tonight",
             "the engine builds the paged cache very fast", "what does the scheduler do with many tokens",
             "word " * 80, "a dog sees the blue sky", "last one please"]
    proc = subprocess.run(
        [sys.executable, "-m", "ferrokv", "chat", "--model", model, "--max-model-len", "64", "--max-tokens", "6",
         "--ignore-eos", "--num-kv-blocks", "64", "--block-size", "4", "--system", "Be brief."],
        input="\n".join(turns) + "\n", capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("assistant> ") == len(turns) - 1  # all but the one too long
    assert "dropped its 2 oldest messages (the system prompt stays)" in proc.stderr
    assert proc.stderr.count("does not fit in max_model_len=64 tokens with the system prompt; it was not sent") == 1
    assert "Traceback" not in proc.stderr


def test_fit_conversation_drops_the_oldest_turns_and_keeps_the_system_prompt():
    from ferrokv.cli import fit_conversation
    from ferrokv.llm import chat_token_ids
    from helpers.tiny_tokenizer import tiny_tokenizer

    tok = tiny_tokenizer()
    system = [{"role": "system", "content": "Be brief."}]
    turns = []
    for i in range(6):
        turns += [{"role": "user", "content": f"question {i} about the cat"}, {"role": "assistant", "content": f"a{i}"}]
    turns.append({"role": "user", "content": "the last question"})
    history = list(turns)
    need = len(chat_token_ids(tok, system + turns[-5:]))  # what the last 2 turns + the question take
    ids, dropped = fit_conversation(tok, system, turns, need + 4, 4)
    assert turns == history[-5:] and dropped == len(history) - 5
    assert ids == chat_token_ids(tok, system + turns)
    # Nothing to drop: a conversation that fits is left alone.
    assert fit_conversation(tok, system, turns, need + 4, 4) == (ids, 0)
    # Even the question alone leaves no room: None, and the question is still there to drop.
    ids, dropped = fit_conversation(tok, system, turns, 10, 4)
    assert ids is None and turns == history[-1:] and dropped == 4


# --- every flag: help with its default, and a bad value that names it --------------------------------
# flag -> (arguments with a bad value, text the error must contain). Every flag of `generate` must
# be here (test_the_bad_value_table_covers_every_flag), so a new flag cannot go untested.
BAD_VALUES: dict[str, tuple[list[str], str]] = {
    "--raw": (["--raw=1"], "--raw: ignored explicit argument"),
    "--pipeline-parallel-size": (["-pp", "2"], "pipeline_parallel_size=2 is not supported: ferrokv runs on one device"),
    "--enable-lora": (["--enable-lora"], "enable_lora=True is not supported: ferrokv has no LoRA"),
    "--quiet": (["--quiet=1"], "--quiet: ignored explicit argument"),
    "--model": (["--model", "/nonexistent/model"], "model: '/nonexistent/model' is neither"),
    "--tokenizer": (["--tokenizer", "/nonexistent/tok"], "tokenizer: '/nonexistent/tok' is neither"),
    "--tokenizer-revision": (["--tokenizer-revision", ""], "tokenizer_revision must be a non-empty string"),
    "--hf-overrides": (["--hf-overrides", "{nope"], "--hf-overrides: not JSON"),
    "--revision": (["--model", "org/tiny", "--revision", "nope"], "'org/tiny' at revision 'nope' is not"),
    "--download-dir": (["--model", "org/tiny", "--download-dir", "/nonexistent/cache"],
                       "Hugging Face cache (/nonexistent/cache)"),
    "--dtype": (["--dtype", "int8"], "--dtype: invalid choice: 'int8'"),
    "--device": (["--device", "tpu"], "device must be 'auto', 'cpu' or 'cuda[:N]', got 'tpu'"),
    "--attention-backend": (["--attention-backend", "flash"], "--attention-backend: invalid choice: 'flash'"),
    "--block-size": (["--block-size", "24"], "invalid block_size=24: must be a power of two"),
    "--max-num-seqs": (["--max-num-seqs", "0"], "max_num_seqs must be a positive integer, got 0"),
    "--max-num-batched-tokens": (["--max-num-batched-tokens", "x"], "--max-num-batched-tokens: invalid int value"),
    "--max-model-len": (["--max-model-len", "-5"], "max_model_len must be a positive integer or -1 / 'auto'"),
    "--num-gpu-blocks-override": (["--num-gpu-blocks-override", "1"],
                                  "invalid num_gpu_blocks_override=1: must be >= 2"),
    # The former name is an alias; with the base's --num-gpu-blocks-override both are given.
    "--num-kv-blocks": (["--num-kv-blocks", "1"], "num_kv_blocks=1 and num_gpu_blocks_override=64 were both given"),
    "--kv-cache-memory-bytes": (["--kv-cache-memory-bytes", "0"],
                                "kv_cache_memory_bytes must be a positive integer, got 0"),
    "--kv-cache-memory": (["--kv-cache-memory", "0"], "kv_cache_memory must be a positive integer, got 0"),
    "--gpu-memory-utilization": (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization must be in (0, 1]"),
    "--enable-prefix-caching": (["--enable-prefix-caching=yes"],
                                "--no-enable-prefix-caching: ignored explicit argument 'yes'"),
    "--preemption-mode": (["--preemption-mode", "discard"], "--preemption-mode: invalid choice: 'discard'"),
    "--num-cpu-blocks": (["--num-cpu-blocks", "-1"], "num_cpu_blocks must be an integer >= 0, got -1"),
    "--scheduling-policy": (["--scheduling-policy", "lifo"], "--scheduling-policy: invalid choice: 'lifo'"),
    "--seed": (["--seed", "x"], "--seed: invalid int value: 'x'"),
    "--overlap": (["--overlap=1"], "--no-overlap: ignored explicit argument '1'"),
    "--enforce-eager": (["--enforce-eager=1"], "--no-enforce-eager: ignored explicit argument '1'"),
    "--tensor-parallel-size": (["--tensor-parallel-size", "2"], "tensor_parallel_size=2 is not supported yet"),
    "--trust-remote-code": (["--trust-remote-code=1"], "--no-trust-remote-code: ignored explicit argument '1'"),
    "--quantization": (["--quantization", "awq"], "quantization='awq' is not supported yet"),
    "--swap-space": (["--swap-space", "-1"], "swap_space must be a number of GiB >= 0, got -1.0"),
    "--disable-log-stats": (["--disable-log-stats=1"], "--no-disable-log-stats: ignored explicit argument '1'"),
    "--enable-chunked-prefill": (["--no-enable-chunked-prefill"], "enable_chunked_prefill=False is not supported"),
    "--kv-cache-dtype": (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype: invalid choice: 'fp8'"),
    "--load-format": (["--load-format", "npcache"], "--load-format: invalid choice: 'npcache'"),
    "--logprobs-mode": (["--logprobs-mode", "raw_logits"], "--logprobs-mode: invalid choice: 'raw_logits'"),
    "--tokenizer-mode": (["--tokenizer-mode", "slow"], "--tokenizer-mode: invalid choice: 'slow'"),
    "--reasoning-parser": (["--reasoning-parser", "granite"], "--reasoning-parser: invalid choice: 'granite'"),
    "--max-logprobs": (["--max-logprobs", "-2"], "max_logprobs must be"),
    "--generation-config": (["--generation-config", "/nonexistent/gen"], "no folder with a generation_config.json"),
    "--override-generation-config": (["--override-generation-config", "[1]"],
                                     "--override-generation-config: a JSON object is needed, got '[1]'"),
    "--max-tokens": (["--max-tokens", "0"], "max_tokens must be None or an int >= 1, got 0"),
    "--min-tokens": (["--min-tokens", "-1"], "min_tokens must be an int >= 0, got -1"),
    "--temperature": (["--temperature", "-1"], "temperature must be >= 0 and finite, got -1.0"),
    "--top-p": (["--top-p", "0"], "top_p must be in (0, 1], got 0.0"),
    "--top-k": (["--top-k", "-2"], "top_k must be an int >= -1"),
    "--min-p": (["--min-p", "2"], "min_p must be in [0, 1], got 2.0"),
    "--presence-penalty": (["--presence-penalty", "3"], "presence_penalty must be in [-2, 2], got 3.0"),
    "--frequency-penalty": (["--frequency-penalty", "-3"], "frequency_penalty must be in [-2, 2], got -3.0"),
    "--repetition-penalty": (["--repetition-penalty", "0"], "repetition_penalty must be > 0 and finite, got 0.0"),
    "--n": (["--n", "0"], "n must be an int >= 1, got 0"),
    "--stop": (["--stop", ""], "stop must not contain an empty string"),
    "--ignore-eos": (["--ignore-eos=1"], "--no-ignore-eos: ignored explicit argument '1'"),
    "--sampling-seed": (["--sampling-seed", "1.5"], "--sampling-seed: invalid int value: '1.5'"),
}


def _subparsers():
    from ferrokv.cli import _parser

    parser = _parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return parser, sub.choices


def _flags(parser) -> dict[str, object]:
    return {a.option_strings[0]: a for a in parser._actions if a.option_strings and a.option_strings[0] != "-h"}


def test_the_bad_value_table_covers_every_flag():
    """(vLLM's flags for what ferrokv does not have share one check: a few stand for all.)"""
    from ferrokv.engine_args import VLLM_ONLY_ARGS

    vllm_only = {"--" + name.replace("_", "-") for name in VLLM_ONLY_ARGS}
    _, subs = _subparsers()
    assert set(_flags(subs["generate"])) - vllm_only == set(BAD_VALUES) - vllm_only
    assert set(_flags(subs["chat"])) - vllm_only == set(BAD_VALUES) - vllm_only - {"--raw", "--quiet"} | {"--system"}


def test_every_flag_has_help_ending_with_its_default():
    from dataclasses import fields

    from ferrokv.engine_args import EngineArgs

    parser, subs = _subparsers()
    for p in (parser, subs["generate"], subs["chat"]):
        for flag, action in _flags(p).items():
            if flag == "--version":
                continue
            assert action.help and "(default: " in action.help, flag
    generate = subs["generate"]
    help_text = generate.format_help()
    for f in fields(EngineArgs):  # the engine flags are EngineArgs', with its defaults
        flag = "--" + f.name.replace("_", "-")
        assert _flags(generate)[flag].default == f.default
        assert f.metadata["doc"].split()[0] in help_text, flag
    assert "(default: 16)" in _flags(generate)["--block-size"].help
    assert _flags(generate)["--enable-prefix-caching"].help.count("(default: on)") == 1
    assert "half" in _flags(generate)["--dtype"].choices and "float" in _flags(generate)["--dtype"].choices
    # Only the fields a generation_config.json can recommend say that it may set them.
    from ferrokv.generation_defaults import RECOMMENDED_FIELDS

    for flag in ("--temperature", "--top-p", "--top-k", "--min-p", "--repetition-penalty", "--max-tokens"):
        assert "generation config" in _flags(generate)[flag].help, flag
    for flag in ("--min-tokens", "--presence-penalty", "--frequency-penalty", "--n", "--stop", "--ignore-eos"):
        assert "generation config" not in _flags(generate)[flag].help, flag
    assert RECOMMENDED_FIELDS == {"temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens"}


@pytest.mark.parametrize("flag", sorted(BAD_VALUES))
def test_bad_value_names_the_flag(flag, model, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    argv, expected = BAD_VALUES[flag]
    base = ["generate", "--quiet", "--num-gpu-blocks-override", "64", "--max-model-len", "128"]
    if "--model" not in argv:
        base += ["--model", model]
    try:
        rc = main(base + argv + ["hi"])
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    assert rc == 2
    assert expected in capsys.readouterr().err


def test_help_version_and_python_m():
    import subprocess

    out = subprocess.run([sys.executable, "-m", "ferrokv", "--version"], capture_output=True, text=True, check=True)
    from ferrokv import __version__

    assert out.stdout.strip() == f"ferrokv {__version__}"
    out = subprocess.run([sys.executable, "-m", "ferrokv", "generate", "--help"], capture_output=True, text=True,
                         check=True)
    assert "--max-num-seqs" in out.stdout and "--raw" in out.stdout and "(default: 256)" in out.stdout


def test_dtype_aliases_and_chat_template_by_default(model, capsys):
    common = ["generate", "--model", model, "--quiet", "--max-tokens", "2", "--num-kv-blocks", "64",
              "--max-model-len", "128", "hello"]
    assert main(common + ["--dtype", "half", "--raw"]) == 0
    raw = capsys.readouterr().out
    assert main(common + ["--dtype", "float"]) == 0
    templated = capsys.readouterr().out

    def prompt_tokens(out: str) -> int:
        return int(out.split("prefix cache: ")[1].split(" of ")[1].split()[0])

    # The chat template wraps the prompt in <|im_start|>user ... <|im_start|>assistant.
    assert prompt_tokens(templated) > prompt_tokens(raw) + 4


@pytest.mark.parametrize("text,value", [("16000", 16000), ("16k", 16000), ("25.6k", 25600), ("16K", 16384),
                                        ("2M", 2 << 20), ("1.5m", 1_500_000), ("1g", 10 ** 9), (" 7 ", 7)])
def test_integer_flags_take_vllms_suffixes(text, value):
    from ferrokv.cli import human_readable_int

    assert human_readable_int(text) == value


def test_a_binary_suffix_on_a_fraction_is_refused_with_the_decimal_one_suggested():
    import argparse

    from ferrokv.cli import human_readable_int

    with pytest.raises(argparse.ArgumentTypeError, match="1.5k"):
        human_readable_int("1.5K")


@pytest.mark.parametrize("flag,ferrokv_env,vllm_env,keys", [
    (None, None, None, ()),
    (None, None, "v", ("v",)),  # vLLM's variable: a deployment that sets it is not left open
    (None, "f", "v", ("f",)),
    (["a", "b"], "f", "v", ("a", "b")),
])
def test_the_api_keys_come_from_the_flag_then_ferrokvs_then_vllms_variable(flag, ferrokv_env, vllm_env, keys,
                                                                           monkeypatch):
    from ferrokv.cli_serve import _api_keys

    for name, value in (("FERROKV_API_KEY", ferrokv_env), ("VLLM_API_KEY", vllm_env)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert _api_keys(flag) == keys


def test_the_servers_own_integer_flags_take_the_suffixes_too():
    from ferrokv.cli import _parser

    args = _parser().parse_args(["serve", "m", "--max-body-bytes", "2M", "--max-waiting-requests", "1k",
                                 "--max-log-len", "4K"])
    assert (args.max_body_bytes, args.max_waiting_requests, args.max_log_len) == (2 << 20, 1000, 4096)


@pytest.mark.parametrize("argv, needle", [
    (["--blocks", "1"], "num_blocks"), (["--block-size", "3"], "block_size"), (["--max-num-seqs", "0"], "max_num_seqs"),
    (["--requests", "-5"], "--requests"), (["--blocks", "4"], "KV blocks"),
])
def test_the_demo_reports_bad_flags_as_usage_errors(argv, needle, capsys):
    """``python -m ferrokv.demo``: exit status 2 and the problem named, never a traceback."""
    from ferrokv.demo import main as demo

    with pytest.raises(SystemExit) as e:
        demo(argv + ["--requests", "3"] if "--requests" not in argv else argv)
    assert e.value.code == 2 and needle in capsys.readouterr().err


@pytest.mark.parametrize("command, status, told", [("chat", 0, ""), ("generate", 130, "ferrokv: interrupted")])
def test_ctrl_c_ends_a_command_without_a_traceback(monkeypatch, capsys, command, status, told):
    """vLLM's chat ends on Ctrl-C with status 0; the other commands with 128 + SIGINT and a line."""
    from ferrokv import cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, f"_{command}", interrupted)
    argv = [command, "--model", "unused"] if command == "chat" else [command, "hi", "--model", "unused"]
    assert cli.main(argv) == status
    assert capsys.readouterr().err.strip() == told


def test_sigterm_while_serve_loads_the_model_ends_it_as_an_interrupt(monkeypatch, capsys, tiny_model_dir):
    """vLLM's: SIGTERM before the server listens interrupts the start (a line, 128 + SIGTERM, no
    traceback), instead of killing the process mid-load without a word."""
    import os
    import signal
    import time

    from ferrokv import cli
    from ferrokv.async_llm import AsyncLLM

    def loading(engine_args):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # the handler raises here; a test that hangs 30 s has failed
        raise AssertionError("SIGTERM did not interrupt the load")

    monkeypatch.setattr(AsyncLLM, "from_engine_args", staticmethod(loading))
    model = str(tiny_model_dir("llama"))
    capsys.readouterr()  # (building the model may write to stderr)
    before = signal.getsignal(signal.SIGTERM)
    try:
        assert cli.main(["serve", model, "--port", "0"]) == 128 + signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, before)
    assert capsys.readouterr().err.strip() == "ferrokv: terminated"


def test_serve_holds_its_port_while_the_model_loads(monkeypatch, tiny_model_dir):
    """As vLLM's: the port is taken before the model loads, so no other server takes it meanwhile
    (not even one that reuses addresses, as uvicorn's do), and it is freed when the start fails."""
    import socket

    from helpers.server import free_port

    from ferrokv import cli
    from ferrokv.async_llm import AsyncLLM

    port, seen = free_port(), {}

    def loading(engine_args):
        with socket.socket() as other:
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            with pytest.raises(OSError, match="Address already in use"):
                other.bind(("127.0.0.1", port))
        seen["checked"] = True
        raise ValueError("model: this one does not load")

    monkeypatch.setattr(AsyncLLM, "from_engine_args", staticmethod(loading))
    assert cli.main(["serve", str(tiny_model_dir("llama")), "--port", str(port)]) == 2 and seen["checked"]
    with socket.socket() as again:  # given back
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", port))


def _nodelay_of_a_connection(listener) -> int:
    """TCP_NODELAY of a connection that an asyncio server (uvicorn's) on ``listener`` accepts."""
    import asyncio
    import socket

    async def main():
        seen = asyncio.get_running_loop().create_future()

        async def accepted(reader, writer):
            seen.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(accepted, sock=listener)
        async with server:
            _, writer = await asyncio.open_connection(*listener.getsockname()[:2])
            value = await asyncio.wait_for(seen, 30)
            writer.close()
            return value

    return asyncio.run(main())


def test_serve_binds_one_socket_as_vllm_and_refuses_a_uds_path_in_use(tmp_path):
    """As vLLM's (and uvicorn's own) bind: IPv6 only for an IPv6 host, ``localhost`` and ``''``
    as IPv4. ``--uds``: a live server's socket file or a regular file is refused (it would be
    replaced), a stale socket file is replaced (serve9)."""
    import socket

    from ferrokv.cli_serve import _listener

    for host, family in (("localhost", socket.AF_INET), ("", socket.AF_INET), ("127.0.0.1", socket.AF_INET)):
        with _listener(host, 0, None) as sock:
            assert sock.family == family and sock.getsockname()[1] > 0
    assert _nodelay_of_a_connection(_listener("127.0.0.1", 0, None)) == 1  # streams' small writes go at once
    path = str(tmp_path / "s.sock")
    live = _listener("unused", 0, path)
    with pytest.raises(ValueError, match="another server listens there"):
        _listener("unused", 0, path)
    live.close()  # gone, its file left behind: replaced
    with _listener("unused", 0, path) as again:
        assert again.getsockname() == path
    (tmp_path / "file.txt").write_text("keep me")
    with pytest.raises(ValueError, match="the path exists and is not a socket"):
        _listener("unused", 0, str(tmp_path / "file.txt"))
    assert (tmp_path / "file.txt").read_text() == "keep me"
    with pytest.raises(ValueError, match=r"--uds .*: cannot listen there \(AF_UNIX path too long"):
        _listener("unused", 0, str(tmp_path / ("x" * 200)))


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_help_tells_the_conventions_read_before_the_flags(command, capsys):
    """--config and the short flags are read before argparse (vLLM's), so --help tells them."""
    from ferrokv.cli import main

    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--config FILE.yaml" in out and "-tp N (--tensor-parallel-size)" in out
