"""vLLM's command-line conventions, applied to ``ferrokv``'s arguments before argparse reads them
(vLLM's ``FlexibleArgumentParser``), so that a ``vllm serve`` command line or config file works:

* a flag's name may use underscores: ``--max_model_len 256`` is ``--max-model-len 256`` (only a
  token spelt as a flag: a value keeps its underscores, and text with a space, which argparse reads
  as a value, is never a flag);
* vLLM's short flags name their long ones (``-tp 1`` is ``--tensor-parallel-size 1``);
* ``--config FILE.yaml`` puts the file's keys in as flags right after the command (and its
  positional model, if given, which wins over the file's ``model``): the command line's own flags
  come later, so they win. A key is a flag's name (underscores or dashes); ``true`` gives the flag,
  ``false`` its ``--no-`` form (nothing for a flag that has none), a list its items (one flag per
  item for a repeatable flag), a mapping its JSON, ``null`` nothing (the default), anything else
  its text (as ``--flag=text``, so that a text starting with ``-`` stays a value).

Invariants: tokens after ``--`` are left alone; errors are ``ValueError`` naming ``--config`` and
the file. Costs: one pass over the arguments, plus reading the file.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable, Collection, Mapping
from typing import Any

__all__ = ["SHORT_FLAGS", "flags_read_as_values", "vllm_argv"]

# vLLM's short flags for the long flags ferrokv has.
SHORT_FLAGS = {"-tp": "--tensor-parallel-size", "-q": "--quantization", "-pp": "--pipeline-parallel-size",
               "-dp": "--data-parallel-size"}


_FLAG = re.compile(r"--[A-Za-z0-9][A-Za-z0-9_.-]*")


def _flag_name(token: str) -> str:
    name, eq, value = token.partition("=")
    if _FLAG.fullmatch(name):
        name = "--" + name[2:].replace("_", "-")
    else:
        name = SHORT_FLAGS.get(name, name)
    return name + eq + value


def vllm_argv(argv: list[str], actions_of: Callable[[str], Mapping[str, argparse.Action] | None]) -> list[str]:
    """``argv`` with vLLM's conventions resolved (module docs). ``actions_of(command)``: the
    subcommand's actions by option string (None: not a subcommand)."""
    end = argv.index("--") if "--" in argv else len(argv)
    args = [_flag_name(t) for t in argv[:end]] + argv[end:]
    at = next((i for i in range(end) if args[i] == "--config" or args[i].startswith("--config=")), None)
    if at is None:
        return args
    if args[at] == "--config":
        if at + 1 >= end:
            raise ValueError("--config needs a YAML file")
        path, rest = args[at + 1], args[:at] + args[at + 2:]
    else:
        path, rest = args[at].partition("=")[2], args[:at] + args[at + 1:]
    command = next((i for i, t in enumerate(rest) if actions_of(t) is not None), None)
    if command is None:
        raise ValueError("--config goes after the command (ferrokv serve --config FILE.yaml)")
    actions = actions_of(rest[command])
    assert actions is not None
    insert = command + 1
    model_given = insert < len(rest) and not rest[insert].startswith("-") and "MODEL" in _positionals(actions)
    if model_given:
        insert += 1  # after `serve MODEL`, as vLLM places them
    flags = config_flags(path, actions, skip={"--model"} if model_given else set())
    return rest[:insert] + flags + rest[insert:]


def _positionals(actions: Mapping[str, argparse.Action]) -> set[str]:
    return {str(a.metavar) for a in actions.values() if not a.option_strings}


def config_flags(path: str, actions: Mapping[str, argparse.Action], skip: Collection[str] = ()) -> list[str]:
    """The flags a vLLM config file stands for (module docs), less those in ``skip``."""
    import yaml

    if not path.endswith((".yaml", ".yml")):
        raise ValueError(f"--config: {path!r} is not a .yaml or .yml file")
    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f)
    except OSError as e:
        raise ValueError(f"--config: {path!r} cannot be read ({e.strerror or e})") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config: {path!r} is not valid YAML ({e})") from None
    if config is None:
        return []
    if not isinstance(config, dict):
        raise ValueError(f"--config: {path!r} must hold a mapping of flag names to values, "
                         f"got a {type(config).__name__}")
    flags: list[str] = []
    for key, value in config.items():
        flag = _flag_name("--" + str(key))
        action = actions.get(flag)
        if flag in skip or value is None:  # null: the flag's default, as if not given
            continue
        if isinstance(value, bool):
            if value:
                flags.append(flag)
            elif f"--no-{flag[2:]}" in actions:
                flags.append(f"--no-{flag[2:]}")
        elif isinstance(value, list):
            if isinstance(action, argparse._AppendAction):
                for item in value:
                    flags += [flag, _text(item)]
            elif value:
                flags += [flag, *map(_text, value)]
        else:
            flags.append(f"{flag}={_text(value)}")
    return flags


def _text(value: Any) -> str:
    return json.dumps(value, separators=(",", ":")) if isinstance(value, (dict, list)) else str(value)


_FLAG_WITH_VALUE = re.compile(r"--[A-Za-z0-9][A-Za-z0-9_.-]*=", re.DOTALL)


def flags_read_as_values(values: list[Any]) -> list[str]:
    """Positional values spelt ``--name=value``: flags argparse did not know and, their value
    holding a space, read as positionals (``--compilation-config={"level": 3}`` as the model)."""
    return [v for v in values if isinstance(v, str) and _FLAG_WITH_VALUE.match(v)]
