"""vLLM's periodic engine-stats line: throughput since the last line, running and waiting
requests, KV-cache usage and prefix-cache hit rate.

``StatsLog.log(stats)`` logs one line from an ``LLMEngine.stats()`` snapshot: prompt and
generation tokens per second since the previous call, the running sequences (each of n samples
is a request, as vLLM's children), the waiting requests, the KV-cache usage and the share of the
prompt tokens looked up since the previous call that the prefix cache served. As vLLM's
``LoggingStatLogger``, an idle engine logs one line when it becomes idle, then nothing until work
comes. ``ferrokv serve`` calls it every ``LOG_STATS_INTERVAL_S`` seconds (``AsyncLLM.do_log_stats``)
unless ``--disable-log-stats``.
Invariants: counters only grow, so every rate is of the interval alone. Costs: O(1) per call.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

__all__ = ["LOG_STATS_INTERVAL_S", "StatsLog"]

logger = logging.getLogger("ferrokv")

LOG_STATS_INTERVAL_S = 10.0  # vLLM's VLLM_LOG_STATS_INTERVAL default


class StatsLog:
    """One engine's stats lines (module docs)."""

    __slots__ = ("_at", "_prompt", "_generated", "_queried", "_hits", "_was_busy")

    def __init__(self, stats: Mapping[str, float], now: float | None = None) -> None:
        self._at = time.monotonic() if now is None else now
        self._prompt, self._generated = stats["prompt_tokens"], stats["generated_tokens"]
        self._queried, self._hits = stats["prefix_cache_queried_tokens"], stats["first_admission_cached_tokens"]
        self._was_busy = False

    def log(self, stats: Mapping[str, float], now: float | None = None) -> str | None:
        """Logs the line for the interval since the previous call and returns it (None: idle, and
        the idle line was logged already)."""
        now = time.monotonic() if now is None else now
        elapsed = max(now - self._at, 1e-9)
        prompt, generated = stats["prompt_tokens"] - self._prompt, stats["generated_tokens"] - self._generated
        queried = stats["prefix_cache_queried_tokens"] - self._queried
        hits = stats["first_admission_cached_tokens"] - self._hits
        self._at, self._prompt, self._generated = now, stats["prompt_tokens"], stats["generated_tokens"]
        self._queried, self._hits = stats["prefix_cache_queried_tokens"], stats["first_admission_cached_tokens"]
        busy = bool(prompt or generated or stats["num_running_seqs"] or stats["num_waiting_seqs"])
        if not busy and not self._was_busy:
            return None
        self._was_busy = busy
        line = (f"Avg prompt throughput: {prompt / elapsed:.1f} tokens/s, Avg generation throughput: "
                f"{generated / elapsed:.1f} tokens/s, Running: {stats['num_running_seqs']} reqs, Waiting: "
                f"{stats['num_waiting_seqs']} reqs, KV cache usage: {100 * stats['kv_cache_usage']:.1f}%, "
                f"Prefix cache hit rate: {100 * hits / queried if queried else 0.0:.1f}%")
        logger.info("%s", line)
        return line
