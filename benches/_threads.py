"""The torch thread count of the benches that run a model: one ``--threads`` option, default 1.

A helper module, not a benchmark (``run_all`` skips ``benches/_*.py``). Why 1: on a shared
2-core machine, 2 torch threads are at the mercy of other load (a matmul can be several times
slower from one minute to the next), so a run's time and its ratios vary wildly; one thread
leaves the other core to the rest of the machine. Both sides of a comparison run in the same
process, so they share the setting.
"""

from __future__ import annotations

import argparse

DEFAULT_THREADS = 1
HELP = ("torch threads (default 1: steadier on a shared 2-core machine, where 2 threads are at the mercy "
        "of other load)")


def add_threads_option(ap: argparse.ArgumentParser, text: str = HELP) -> None:
    ap.add_argument("--threads", type=int, default=DEFAULT_THREADS, help=text)


def set_threads(n: int) -> int:
    """Sets torch's intra-op thread count; returns what torch reports. torch is imported here
    because some scripts import it only after parsing their arguments (a fast ``--help``)."""
    if n < 1:
        raise SystemExit(f"--threads must be >= 1, got {n}")
    import torch

    torch.set_num_threads(n)
    return torch.get_num_threads()
