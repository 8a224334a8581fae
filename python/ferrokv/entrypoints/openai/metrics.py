"""``GET /metrics``: the engine's gauges and counters and the requests' latency histograms, in
Prometheus' text format, with vLLM's metric names under the ``ferrokv:`` prefix.

Invariants: every server has its own ``CollectorRegistry`` (never the global one), so two apps in
one process do not mix. Gauges and counters are read from the engine at scrape time
(``AsyncLLM.stats``: the engine is their one home); the histograms are observed from each
request's ``RequestOutput.metrics`` (the core's timestamps), once per request for TTFT, e2e and
queue time; inter-token latency counts once per decode step of the request, as vLLM's does,
however the client reads it (streamed or not, n samples or one): the request's mean gap between
steps, times its number of steps. A request that never got a token (aborted while waiting)
observes nothing. Every series is labelled with ``model_name``, as vLLM's.
Costs: a scrape is one ``stats()`` snapshot, O(KV blocks); an observation is O(1).
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from ferrokv.outputs import RequestOutput

__all__ = ["CONTENT_TYPE", "RequestTimer", "ServerMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# No "<name>_created" series (their timestamps double the output and no dashboard reads them).
prometheus_client.disable_created_metrics()

# vLLM's buckets (seconds).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)

# Counter name (without the _total suffix) -> (engine stats key, help).
_COUNTERS = {
    "ferrokv:prefix_cache_queries": ("prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache."),
    # Over the same admissions as the queries (each request's first), so hits never exceed them.
    "ferrokv:prefix_cache_hits": ("first_admission_cached_tokens", "Prompt tokens served from the prefix cache."),
    "ferrokv:num_preemptions": ("preemptions", "Sequences preempted."),
    "ferrokv:prompt_tokens": ("prompt_tokens", "Prompt tokens of the requests taken."),
    "ferrokv:generation_tokens": ("generated_tokens", "Tokens generated."),
}
# Gauge name -> (stats key, help).
_GAUGES = {
    "ferrokv:num_requests_running": ("num_running", "Requests in the engine's running batch."),
    "ferrokv:num_requests_waiting": ("num_waiting", "Requests waiting for a place in the batch."),
    "ferrokv:kv_cache_usage_perc": ("kv_cache_usage", "Fraction of usable KV-cache blocks in use (1 = full)."),
    "ferrokv:num_free_blocks": ("num_free_blocks", "Free KV-cache blocks (cached prefix blocks count as free)."),
    "ferrokv:num_blocks": ("num_usable_blocks", "Usable KV-cache blocks (the null block excluded)."),
}


class _EngineCollector:
    """Reads the engine's stats at scrape time."""

    def __init__(self, async_llm: Any, model_name: str, extra: dict[str, Any]) -> None:
        self._llm = async_llm
        self._model = [model_name]
        self._extra = extra  # name -> (callable, help): server-side gauges

    def collect(self) -> Iterator[Metric]:
        st = self._llm.stats()
        values = [(GaugeMetricFamily, name, doc, st[key]) for name, (key, doc) in _GAUGES.items()]
        values += [(CounterMetricFamily, name, doc, st[key]) for name, (key, doc) in _COUNTERS.items()]
        values += [(GaugeMetricFamily, name, doc, read()) for name, (read, doc) in self._extra.items()]
        for family, name, doc, value in values:
            metric = family(name, doc, labels=["model_name"])
            metric.add_metric(self._model, float(value))
            yield metric


class _StepHistogram:
    """A histogram (one ``model_name`` series) whose observation may count several times at once:
    a request's mean gap between decode steps, once per step."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...], model_name: str) -> None:
        self._name, self._doc, self._model = name, doc, [model_name]
        self._bounds = (*buckets, math.inf)
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        self._lock = threading.Lock()  # scrapes may come from another thread

    def observe(self, value: float, times: int = 1) -> None:
        i = bisect.bisect_left(self._bounds, value)  # the first bucket whose bound is >= value
        with self._lock:
            self._counts[i] += times
            self._sum += value * times

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, buckets = 0, []
        for bound, count in zip(self._bounds, counts):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        metric = HistogramMetricFamily(self._name, self._doc, labels=["model_name"])
        metric.add_metric(self._model, buckets, total)
        yield metric


class ServerMetrics:
    """The server's registry: engine metrics, latency histograms, finished-request counts."""

    def __init__(self, async_llm: Any, model_name: str, in_flight_http: Any) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        extra = {"ferrokv:num_requests_in_flight": (in_flight_http, "HTTP generation requests being served.")}
        self.registry.register(_EngineCollector(async_llm, model_name, extra))
        labels = ["model_name"]
        self.ttft = Histogram("ferrokv:time_to_first_token_seconds", "Time to the first token (queued to token).",
                              labels, buckets=_TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = _StepHistogram("ferrokv:inter_token_latency_seconds",
                                  "Time between a request's decode steps (one observation per step).", _ITL_BUCKETS,
                                  model_name)
        self.registry.register(self.itl)
        self.e2e = Histogram("ferrokv:e2e_request_latency_seconds", "Time from queued to finished.",
                             labels, buckets=_E2E_BUCKETS, registry=self.registry).labels(model_name)
        self.queue = Histogram("ferrokv:request_queue_time_seconds", "Time from queued to first scheduled.",
                               labels, buckets=_E2E_BUCKETS, registry=self.registry).labels(model_name)
        self._success = Counter("ferrokv:request_success",
                                "Sequences finished (each of a request's n choices), by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self._model = model_name

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def finished(self, output: RequestOutput, timer: RequestTimer) -> None:
        """Observes a finished request's latencies (``output``: its last output) and counts its
        choices by finish reason (streamed or not: a DELTA choice that ended earlier is not in
        the last output, the timer saw it)."""
        m = output.metrics
        timer.on_output(output)
        for reason in timer.finish_reasons.values():
            self._success.labels(self._model, reason).inc()
        if m is None or not m.queued_ts:
            return  # aborted before the engine recorded anything
        if m.first_token_ts:
            self.ttft.observe(max(m.first_token_ts - m.queued_ts, 0.0))
            steps = max(timer.tokens.values(), default=0) - 1  # decode steps after the first token's
            if steps > 0 and m.last_token_ts > m.first_token_ts:
                self.itl.observe((m.last_token_ts - m.first_token_ts) / steps, steps)
        if m.scheduled_ts:
            self.queue.observe(max(m.scheduled_ts - m.queued_ts, 0.0))
        if m.finished_ts:
            self.e2e.observe(max(m.finished_ts - m.queued_ts, 0.0))


@dataclass(slots=True)
class RequestTimer:
    """Per request, from the outputs the server got (DELTA or FINAL_ONLY, the server's kinds):
    each choice's tokens so far (its decode steps) and its finish reason as it ends."""

    tokens: dict[int, int] = field(default_factory=dict)  # choice index -> tokens generated
    finish_reasons: dict[int, str] = field(default_factory=dict)  # choice index -> its finish reason

    def on_output(self, output: RequestOutput) -> None:
        for c in output.outputs:
            self.tokens[c.index] = self.tokens.get(c.index, 0) + len(c.token_ids)
            if c.finish_reason is not None:
                self.finish_reasons.setdefault(c.index, c.finish_reason)
