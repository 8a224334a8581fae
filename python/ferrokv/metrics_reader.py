"""The engine's metrics as values: vLLM's ``LLM.get_metrics()`` types (``vllm.v1.metrics.reader``:
``Metric``, ``Counter``, ``Gauge``, ``Vector``, ``Histogram``), and the one table of the engine's
counters and gauges, which ``/metrics`` serves under the same names.

``engine_stats(engine)`` is ``LLMEngine.stats()`` with the KV-cache gauges (free and usable
blocks, usage); ``engine_metrics(stats, model_name)`` turns it into ``Counter``s, ``Gauge``s and
the ``Histogram`` of tokens per step (vLLM's ``iteration_tokens_total``: the tokens each step
scheduled, counted by the core), labelled ``model_name``, as vLLM's are. The latency histograms
exist only in a server (their observations are of the requests it answers).
Invariants: names are vLLM's under the ``ferrokv:`` prefix; counters never decrease.
Costs: one ``stats()`` snapshot (O(KV blocks) when its usage counts are asked for), O(1) after.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["COUNTERS", "GAUGES", "ITERATION_TOKENS", "Counter", "Gauge", "Histogram", "Metric", "Vector",
           "engine_metrics", "engine_stats", "step_token_buckets"]

# Counter name (without the _total suffix) -> (engine stats key, help).
COUNTERS = {
    "ferrokv:prefix_cache_queries": ("prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache."),
    # Over the same admissions as the queries (each request's first), so hits never exceed them.
    "ferrokv:prefix_cache_hits": ("first_admission_cached_tokens", "Prompt tokens served from the prefix cache."),
    "ferrokv:num_preemptions": ("preemptions", "Sequences preempted."),
    "ferrokv:prompt_tokens": ("prompt_tokens", "Prompt tokens of the requests taken."),
    "ferrokv:generation_tokens": ("generated_tokens", "Tokens generated."),
}
# Gauge name -> (stats key, help).
GAUGES = {
    # Sequences: vLLM runs each of a request's n samples as a request of its own.
    "ferrokv:num_requests_running": ("num_running_seqs", "Requests (each of n samples) in the running batch."),
    "ferrokv:num_requests_waiting": ("num_waiting_seqs",
                                     "Requests (each of n samples) waiting for a place in the batch."),
    "ferrokv:kv_cache_usage_perc": ("kv_cache_usage", "Fraction of usable KV-cache blocks in use (1 = full)."),
    "ferrokv:num_free_blocks": ("num_free_blocks", "Free KV-cache blocks (cached prefix blocks count as free)."),
    "ferrokv:num_blocks": ("num_usable_blocks", "Usable KV-cache blocks (the null block excluded)."),
}

ITERATION_TOKENS = ("ferrokv:iteration_tokens_total", "Tokens scheduled per engine step.")
_STEP_TOKENS_KEY = "step_tokens_le_"  # the core's stats keys, one per bucket (not cumulative)


def step_token_buckets(stats: Mapping[str, Any]) -> tuple[list[tuple[str, int]], int]:
    """The tokens-per-step histogram in a stats snapshot: cumulative ``(bound, count)`` buckets
    by increasing bound (the last "+Inf"), and the sum."""
    counts = sorted((float(key[len(_STEP_TOKENS_KEY):]), count) for key, count in stats.items()
                    if key.startswith(_STEP_TOKENS_KEY))  # float("inf") sorts last
    buckets, cumulative = [], 0
    for bound, count in counts:
        cumulative += count
        buckets.append(("+Inf" if bound == float("inf") else f"{bound}", cumulative))
    return buckets, stats["step_tokens_sum"]


@dataclass(slots=True)
class Metric:
    """One series: its name and labels (vLLM's)."""

    name: str
    labels: dict[str, str]


@dataclass(slots=True)
class Counter(Metric):
    """A monotonically increasing integer counter."""

    value: int


@dataclass(slots=True)
class Gauge(Metric):
    """A value that goes up and down."""

    value: float


@dataclass(slots=True)
class Vector(Metric):
    """An ordered array of integer counters."""

    values: list[int]


@dataclass(slots=True)
class Histogram(Metric):
    """Observations: their count and sum, and the cumulative count of each bucket by bound."""

    count: int
    sum: float
    buckets: dict[str, int]


def engine_stats(engine: Any) -> dict[str, Any]:
    """``engine.stats()`` with the KV-cache gauges (safe from any thread: while a step runs, the
    snapshot of an earlier step's end)."""
    st = engine.stats()
    # The free-block count is refreshed at every step's end (the full stats only when asked).
    st["num_free_blocks"] = engine.num_free_blocks
    usable = st["num_blocks"] - 1  # block 0 is the null block
    st["num_usable_blocks"] = usable
    st["kv_cache_usage"] = 1.0 - st["num_free_blocks"] / usable if usable else 0.0
    return st


def engine_metrics(stats: Mapping[str, Any], model_name: str) -> list[Metric]:
    """The engine's counters and gauges (``COUNTERS``, ``GAUGES``) from an ``engine_stats`` snapshot;
    a counter is named as vLLM's reader names it, by its family (no ``_total``, which only the
    Prometheus text adds)."""
    labels = {"model_name": model_name}
    out: list[Metric] = [Counter(name, dict(labels), int(stats[key])) for name, (key, _) in COUNTERS.items()]
    out += [Gauge(name, dict(labels), float(stats[key])) for name, (key, _) in GAUGES.items()]
    buckets, total = step_token_buckets(stats)
    out.append(Histogram(ITERATION_TOKENS[0], dict(labels), buckets[-1][1], float(total), dict(buckets)))
    return out
