"""The ``ferrokv`` command (also ``python -m ferrokv``): ``ferrokv generate [PROMPT...]``, ``ferrokv chat``
and ``ferrokv serve [MODEL]`` (the OpenAI-compatible server: ``ferrokv.cli_serve``, ``ferrokv.entrypoints.openai``).

Both use the embedded SmolLM2-135M-Instruct unless ``--model`` names a Hub id, a folder or a
``.gguf`` file. The engine flags are generated from the ``EngineArgs`` fields (name, type,
default, help) and the sampling flags from ``SamplingParams``' fields, so the CLI repeats no
default of theirs. A sampling flag not given takes the model's recommendation (its generation
config, as vLLM applies it), else the CLI's own default (greedy, 128 tokens: ``_SAMPLING_FLAGS``).
Every flag's help ends with its default. A bad value exits with status 2 and a message naming
the flag or field. vLLM's conventions hold (``ferrokv.cli_argv``): underscores in flag names,
``-tp``, and ``--config FILE.yaml``. ``chat`` never exits on a message: one that is refused (too long, bad) is
reported on stderr and the conversation goes on, trimmed of its oldest turns when it outgrows
``max_model_len`` (``fit_conversation``; the system prompt always stays). Importing this module imports neither torch nor transformers: ``--help`` and
``--version`` stay fast.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time
import typing
from collections.abc import Callable
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

from ferrokv import __version__
from ferrokv.cli_argv import flags_read_as_values, vllm_argv
from ferrokv.checks import check_text
from ferrokv.engine_args import AUTO_MAX_MODEL_LEN, VLLM_ONLY_ARGS, EngineArgs, engine_arg_help, help_with_default
from ferrokv.generation_defaults import RECOMMENDED_FIELDS
from ferrokv.logger import LEVEL_ENV, LOGGER_NAME
from ferrokv.sampling_params import SamplingParams

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for writing clear code.",
    "Explain in one paragraph what a hash table is.",
    "Write a haiku about the sea.",
    "What is the capital of France? Answer in one word.",
    "Why is the sky blue?",
    "List the planets of the solar system.",
    "What does a compiler do?",
]


# SamplingParams field -> (flag, help, CLI default or MISSING for the field's own default).
_SAMPLING_FLAGS: dict[str, tuple[str, str, Any]] = {
    "max_tokens": ("--max-tokens", "most tokens generated per completion", 128),
    "min_tokens": ("--min-tokens", "tokens generated before EOS or a stop string may end a completion", MISSING),
    "temperature": ("--temperature", "sampling temperature; 0 is greedy", 0.0),
    "top_p": ("--top-p", "sample from the most likely tokens whose probabilities add up to top_p", MISSING),
    "top_k": ("--top-k", "sample from the top_k most likely tokens; 0 keeps all", MISSING),
    "min_p": ("--min-p", "drop tokens less likely than min_p times the most likely one", MISSING),
    "presence_penalty": ("--presence-penalty", "penalty in [-2, 2] on tokens already generated", MISSING),
    "frequency_penalty": ("--frequency-penalty", "penalty in [-2, 2] per occurrence of a generated token",
                          MISSING),
    "repetition_penalty": ("--repetition-penalty", "divides the logits of tokens in the prompt or output; "
                           "1 is off", MISSING),
    "n": ("--n", "completions per prompt", MISSING),
    "stop": ("--stop", "a string that ends a completion (repeat the flag for several)", MISSING),
    "ignore_eos": ("--ignore-eos", "keep generating after the end-of-sequence token", MISSING),
    "seed": ("--sampling-seed", "seed of each request's sampling (reproducible samples)", MISSING),
}


def _add_flag(group: Any, flag: str, dest: str, hint: Any, default: Any, help_text: str,
              choices: tuple[str, ...] | None = None) -> None:
    """One flag typed from a field's annotation; bools get ``--x/--no-x``, lists an appending flag."""
    args = typing.get_args(hint)
    kind = next((a for a in args if a is not type(None) and typing.get_origin(a) is None), hint) if args else hint
    if kind is bool:
        action = group.add_argument(flag, dest=dest, default=default, action=argparse.BooleanOptionalAction)
    elif any(typing.get_origin(a) is dict for a in args):
        action = group.add_argument(flag, dest=dest, default=default, type=_json_object, metavar="JSON")
    elif any(typing.get_origin(a) is list for a in args):
        action = group.add_argument(flag, dest=dest, default=default, action="append", type=str, metavar="TEXT")
    else:
        metavar = None if choices else flag.lstrip("-").replace("-", "_").upper()
        kind = (_max_model_len if dest == "max_model_len" else human_readable_int) if kind is int else kind
        action = group.add_argument(flag, dest=dest, default=default, choices=choices, metavar=metavar, type=kind)
    # Set after creation: BooleanOptionalAction would append a second "(default: ...)" to a given help.
    action.help = help_text.replace("%", "%%")


_SUFFIXED_INT = re.compile(r"(\d+(?:\.\d+)?)([kmgKMG])")


def human_readable_int(text: str) -> int:
    """vLLM's integer flags: ``16000``, ``16k`` (16,000), ``25.6k``, ``16K`` (16,384; binary
    suffixes take whole numbers only); likewise m/M and g/G."""
    m = _SUFFIXED_INT.fullmatch(text.strip())
    if m is None:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r} (such as 16000, 16k or 16K)") from None
    number, suffix = m.groups()
    power = "kmg".index(suffix.lower()) + 1
    if suffix.islower():
        return int(float(number) * 1000 ** power)
    if "." in number:
        raise argparse.ArgumentTypeError(f"{text!r}: a binary suffix ({suffix}) takes a whole number; "
                                         f"did you mean {number}{suffix.lower()}?")
    return int(number) * 1024 ** power


def _max_model_len(text: str) -> int:
    """``--max-model-len``: an integer as ``human_readable_int`` reads it, or vLLM's ``auto``."""
    return AUTO_MAX_MODEL_LEN if text.strip().lower() == "auto" else human_readable_int(text)


def _json_flag(what: str, fits: Callable[[Any], bool]) -> Callable[[str], Any]:
    """An argparse type: the flag's JSON text, which must be ``what``."""
    def parse(text: str) -> Any:
        try:
            value = json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
        if not fits(value):
            raise argparse.ArgumentTypeError(f"{what} is needed, got {text!r}")
        return value
    return parse


_json_object = _json_flag("a JSON object", lambda v: isinstance(v, dict))
_json_strings = _json_flag("a JSON list of strings", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v))


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


# vLLM's -O (its value attached: -O3; other short flags: ferrokv.cli_argv), and the flags for what
# ferrokv does not have that are switches (--x / --no-x, no value); the rest take a value.
_VLLM_ONLY_SHORT = {"compilation_config": ("-O",)}
_VLLM_ONLY_SWITCHES = frozenset({
    "disable_custom_all_reduce", "disable_async_output_proc", "enable_lora", "enable_sleep_mode", "skip_tokenizer_init",
    "async_scheduling", "disable_sliding_window", "calculate_kv_scales", "enable_expert_parallel", "use_tqdm_on_load",
    "use_v2_block_manager", "worker_use_ray"})


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine (the EngineArgs fields; LLM() takes the same names)")
    hints = typing.get_type_hints(EngineArgs)
    for f in fields(EngineArgs):
        _add_flag(g, "--" + f.name.replace("_", "-"), f.name, hints[f.name], f.default, engine_arg_help(f),
                  f.metadata["choices"])
    # As LLM() takes them (VLLM_ONLY_ARGS): a value that means what ferrokv does is accepted (a value
    # is read as JSON, else as text), any other refused naming it.
    v = p.add_argument_group("vLLM's flags for what ferrokv does not have: accepted at a value that means what "
                             "ferrokv does, else refused")
    for name, (_, what) in VLLM_ONLY_ARGS.items():
        flag = "--" + name.replace("_", "-")
        if flag in p._option_string_actions:  # (serve's own --served-model-name, ...)
            continue
        help_text = help_with_default(f"vLLM's: {what}", None)
        if name in _VLLM_ONLY_SWITCHES:
            v.add_argument(flag, dest=name, default=None, action=argparse.BooleanOptionalAction).help = help_text
        else:  # (--hf-token alone: the token of `hf auth login`, as vLLM's)
            v.add_argument(flag, *_VLLM_ONLY_SHORT.get(name, ()), dest=name, default=None, type=_json_or_text,
                           metavar="VALUE", help=help_text, **({"nargs": "?", "const": True} if name == "hf_token" else {}))


def _sampling_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (the SamplingParams fields)")
    hints = typing.get_type_hints(SamplingParams)
    by_name = {f.name: f for f in fields(SamplingParams)}
    for name, (flag, doc, cli_default) in _SAMPLING_FLAGS.items():
        default = by_name[name].default if cli_default is MISSING else cli_default
        # None: not given (the model's recommendation, else the default shown, applies).
        recommended = "; unset: the model's generation config's value, if any" if name in RECOMMENDED_FIELDS else ""
        _add_flag(g, flag, "sampling_" + name, hints[name], None, help_with_default(doc + recommended, default))


def _llm(args: argparse.Namespace) -> Any:
    engine_args = {name: getattr(args, name) for name in EngineArgs.field_names()}
    EngineArgs.from_cli_args(args).validate()  # a bad flag fails before torch is imported
    from ferrokv.llm import LLM

    return LLM(**engine_args)


def _params(args: argparse.Namespace, recommended: dict[str, Any] | None = None) -> SamplingParams:
    """The flags given, over the model's ``recommended`` parameters, over the CLI's defaults.
    ``recommended`` None (before the model loads): the flags given alone, to check them."""
    given = {name: v for name in _SAMPLING_FLAGS if (v := getattr(args, "sampling_" + name)) is not None}
    if recommended is None:
        return SamplingParams(**{"max_tokens": None, **given})  # a limit the model may raise is not checked
    own = {name: d for name, (_, _, d) in _SAMPLING_FLAGS.items() if d is not MISSING}
    return SamplingParams(**{**own, **recommended, **given})


def _inputs(llm: Any, prompts: list[str], raw: bool) -> list[Any]:
    """The prompts as text (``--raw``) or through the model's chat template (the default)."""
    if raw:
        return list(prompts)
    from ferrokv.llm import chat_token_ids

    tok = llm.get_tokenizer()
    if not getattr(tok, "chat_template", None):
        raise ValueError("prompts: the model's tokenizer has no chat template; pass --raw to send plain text")
    return [{"prompt": p, "prompt_token_ids": chat_token_ids(tok, [{"role": "user", "content": p}])}
            for p in prompts]


def _names_a_model(text: str) -> bool:
    """A model folder (with config.json) or a .gguf file; text no path could be is not one."""
    try:
        path = Path(text).expanduser()
        return (path / "config.json").is_file() or text.lower().endswith(".gguf") and path.is_file()
    except (OSError, RuntimeError, ValueError):  # a name too long, ~unknown-user, a NUL
        return False


def _generate(args: argparse.Namespace) -> int:
    prompts = [check_text("prompt", p) for p in args.prompts or DEFAULT_PROMPTS]  # before the model loads
    for p in prompts:  # `ferrokv generate MODEL`, written as `serve MODEL` is, would complete its path
        if _names_a_model(p):
            raise ValueError(f"prompts: {p!r} is a model, not a prompt: give it as --model {p} (generate's "
                             f"arguments are prompts)")
    _params(args)  # a bad flag fails before the model loads
    llm = _llm(args)
    params = _params(args, llm.llm_engine.default_sampling_params)
    inputs = _inputs(llm, prompts, args.raw)
    t0 = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=not args.quiet)
    dt = time.perf_counter() - t0
    for p, o in zip(prompts, outs):
        print(f"\n### {p}")
        for c in o.outputs:
            prefix = f"[{c.index}] " if len(o.outputs) > 1 else ""
            print(f"{prefix}{c.text}")  # as generated: a code completion's indentation is its meaning
    _print_stats(llm.llm_engine, outs, dt)
    return 0


def _print_stats(engine: Any, outs: list[Any], dt: float) -> None:
    st = engine.stats()
    gen = sum(len(c.token_ids) for o in outs for c in o.outputs)
    kv_total = st["num_blocks"] - 1
    hits, queried = st["first_admission_cached_tokens"], st["prefix_cache_queried_tokens"]
    print(
        f"\n--- {len(outs)} request{'' if len(outs) == 1 else 's'}, {gen} tokens generated in {dt:.1f}s: "
        f"{gen / dt:.1f} tokens/s "
        f"({(gen + st['prompt_tokens']) / dt:.1f} tokens/s with prompts)\n"
        f"--- KV cache: peak {engine.peak_used_blocks}/{kv_total} blocks "
        f"({engine.peak_used_blocks / kv_total:.1%}) of {st['block_size']} tokens, "
        f"{st['preemptions']} preemptions\n"
        f"--- prefix cache: {hits} of {queried} prompt tokens served from cache ({hits / max(1, queried):.1%})"
    )


def fit_conversation(tokenizer: Any, system: list[dict[str, str]], turns: list[dict[str, str]], max_model_len: int,
                     answer_room: int) -> tuple[list[int] | None, int]:
    """Drops the oldest turns (a user message and its answer) from ``turns``, in place, until the
    prompt of ``system + turns`` leaves ``answer_room`` tokens of ``max_model_len`` for the answer,
    or only the newest user message is left. Returns the prompt's token ids (None when even
    ``system`` and the newest message leave no room for one token) and how many messages went."""
    from ferrokv.llm import chat_token_ids

    dropped = 0
    while True:
        ids = chat_token_ids(tokenizer, system + turns)
        if len(ids) + answer_room <= max_model_len or len(turns) <= 1:
            return (ids if len(ids) < max_model_len else None), dropped
        del turns[:2]
        dropped += 2


def _chat(args: argparse.Namespace) -> int:
    """Reads user messages from stdin, one per line, and answers each in the conversation so far.
    A conversation that outgrows max_model_len loses its oldest turns (never the system prompt),
    and a message that cannot fit at all is refused: either way stderr says so, and the chat goes on."""
    _params(args)
    llm = _llm(args)
    params = _params(args, llm.llm_engine.default_sampling_params)
    tok = llm.get_tokenizer()
    if not getattr(tok, "chat_template", None):
        raise ValueError("model: its tokenizer has no chat template, which ferrokv chat needs")
    max_len = llm.llm_engine.max_model_len
    # The answer's room when trimming: max_tokens, but never more than half the context.
    answer_room = min(params.max_tokens or max_len, max_len // 2)
    system = [{"role": "system", "content": args.system}] if args.system else []
    turns: list[dict[str, str]] = []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("you> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            return 0
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return 0
        turns.append({"role": "user", "content": line})
        try:
            ids, dropped = fit_conversation(tok, system, turns, max_len, answer_room)
            if ids is None:
                turns.pop()
                print(f"ferrokv: this message does not fit in max_model_len={max_len} tokens"
                      f"{' with the system prompt' if system else ''}; it was not sent", file=sys.stderr)
                continue
            if dropped:
                print(f"ferrokv: the conversation outgrew max_model_len={max_len} tokens: dropped its {dropped} "
                      f"oldest messages{' (the system prompt stays)' if system else ''}", file=sys.stderr)
            out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
        except ValueError as e:  # this message is refused; the conversation goes on
            turns.pop()
            print(f"ferrokv: error: {e}", file=sys.stderr)
            continue
        answer = out.outputs[0].text  # as generated, in the history it resends too (vLLM's chat client)
        turns.append({"role": "assistant", "content": answer})
        print(f"assistant> {answer}", flush=True)


# What ferrokv.cli_argv reads before argparse, as vLLM does (so it is told here, not as flags).
_CONVENTIONS = ("also: --config FILE.yaml (its keys as flags; the command line wins), -tp N (--tensor-parallel-size), "
                "-pp N, -dp N (--pipeline- and --data-parallel-size), -q (--quantization); a flag may be spelled "
                "with '_' or '-', and a value as --flag=value")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ferrokv", description="ferrokv LLM inference engine")
    parser.add_argument("--version", action="version", version=f"ferrokv {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help=f"log at DEBUG level (default: off: the level is ${LEVEL_ENV}, else INFO)")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate completions for prompts (default: a few examples)",
                       epilog=_CONVENTIONS)
    g.add_argument("prompts", nargs="*", help="prompts to complete (default: a batch of example questions)")
    g.add_argument("--raw", action="store_true",
                   help="send prompts as plain text, without the chat template (default: off)")
    g.add_argument("--quiet", action="store_true", help="no progress bar (default: off)")
    add_engine_flags(g)
    _sampling_flags(g)
    c = sub.add_parser("chat", help="interactive chat (reads lines from stdin)", epilog=_CONVENTIONS)
    c.add_argument("--system", default=None, help="system prompt opening the conversation (default: none)")
    add_engine_flags(c)
    _sampling_flags(c)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, metrics)",
                       epilog=_CONVENTIONS)
    from ferrokv.cli_serve import serve_flags  # (it imports this module)

    serve_flags(s)
    return parser


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line, read with vLLM's conventions (``ferrokv.cli_argv``); a flag no command
    has is reported with the command's usage."""
    parser = _parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices

    def actions_of(command: str) -> dict[str, argparse.Action] | None:
        sub = commands.get(command)
        return None if sub is None else sub._option_string_actions | {str(a.metavar): a for a in sub._actions
                                                                        if not a.option_strings}

    try:
        argv = vllm_argv(sys.argv[1:] if argv is None else list(argv), actions_of)
    except ValueError as e:
        parser.error(str(e))
    args, unknown = parser.parse_known_args(argv)
    literal = set(argv[argv.index("--") + 1:]) if "--" in argv else set()  # after `--`: values, as given
    unknown += [v for v in flags_read_as_values([getattr(args, "model_pos", None), *(getattr(args, "prompts", None)
                                                                                    or [])]) if v not in literal]
    if unknown:
        commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)} (not a flag of 'ferrokv "
                                     f"{args.command}'; its --help lists them)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.verbose:
        logging.getLogger(LOGGER_NAME).setLevel(logging.DEBUG)
    try:
        from ferrokv.cli_serve import serve

        return {"generate": _generate, "chat": _chat, "serve": serve}[args.command](args)
    except ValueError as e:
        print(f"ferrokv: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C: ends chat as vLLM's does (status 0), else 128 + SIGINT, no traceback
        if args.command == "chat":
            print(file=sys.stderr)
            return 0
        status = getattr(e, "exit_status", 130)  # a serve start's SIGTERM (cli_serve.Terminated): 128 + SIGTERM
        print(f"\nferrokv: {'interrupted' if status == 130 else 'terminated'}", file=sys.stderr)
        return status


if __name__ == "__main__":
    sys.exit(main())
