"""vLLM's ``FlexibleArgumentParser`` (``vllm.utils.argparse_utils``; ``ferrokv.utils`` re-exports it).

Invariants: flags parse as argparse parses them, except that a ``--flag_name`` spelled with
underscores is read as ``--flag-name`` (vLLM's spelling rule); values are never changed.
Costs: O(arguments) per parse.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["FlexibleArgumentParser"]


class FlexibleArgumentParser(argparse.ArgumentParser):
    """vLLM's argument parser: ``argparse.ArgumentParser`` that also takes ``--max_num_seqs``.
    ``EngineArgs.add_cli_args(FlexibleArgumentParser())`` adds the engine flags, as in vLLM."""

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:
        given = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args([_dashed(a) for a in given], namespace)


def _dashed(arg: str) -> str:
    """``--flag_name[=value]`` -> ``--flag-name[=value]``; anything else as it is."""
    if not arg.startswith("--") or arg == "--":
        return arg
    name, eq, value = arg.partition("=")
    return name.replace("_", "-") + eq + value
