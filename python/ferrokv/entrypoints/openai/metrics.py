"""``GET /metrics``: the engine's gauges and counters and the requests' latency histograms, in
Prometheus' text format, with vLLM's metric names under the ``ferrokv:`` prefix.

Invariants: every server has its own ``CollectorRegistry`` (never the global one), so two apps in
one process do not mix. Gauges and counters are read from the engine at scrape time
(``AsyncLLM.stats``: the engine is their one home); the histograms are observed from each
request's ``RequestOutput.metrics`` (the core's timestamps), once per request for TTFT, e2e and
queue time, and per output for inter-token latency. A request that never got a token (aborted
while waiting) observes nothing.
Costs: a scrape is one ``stats()`` snapshot, O(KV blocks); an observation is O(1).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

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
    "ferrokv:prefix_cache_queries": ("prompt_tokens", "Prompt tokens looked up in the prefix cache."),
    "ferrokv:prefix_cache_hits": ("cached_prompt_tokens", "Prompt tokens served from the prefix cache."),
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

    def __init__(self, async_llm: Any, extra: dict[str, Any]) -> None:
        self._llm = async_llm
        self._extra = extra  # name -> (callable, help): server-side gauges

    def collect(self) -> Iterator[Metric]:
        st = self._llm.stats()
        for name, (key, doc) in _GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=float(st[key]))
        for name, (key, doc) in _COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=float(st[key]))
        for name, (read, doc) in self._extra.items():
            yield GaugeMetricFamily(name, doc, value=float(read()))


class ServerMetrics:
    """The server's registry: engine metrics, latency histograms, finished-request counts."""

    def __init__(self, async_llm: Any, model_name: str, in_flight_http: Any) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        extra = {"ferrokv:num_requests_in_flight": (in_flight_http, "HTTP generation requests being served.")}
        self.registry.register(_EngineCollector(async_llm, extra))
        labels = ["model_name"]
        self.ttft = Histogram("ferrokv:time_to_first_token_seconds", "Time to the first token (queued to token).",
                              labels, buckets=_TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram("ferrokv:inter_token_latency_seconds", "Time between a request's tokens.",
                             labels, buckets=_ITL_BUCKETS, registry=self.registry).labels(model_name)
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
        timer.see_finishes(output)
        for reason in timer.finish_reasons.values():
            self._success.labels(self._model, reason).inc()
        if m is None or not m.queued_ts:
            return  # aborted before the engine recorded anything
        if m.first_token_ts:
            self.ttft.observe(max(m.first_token_ts - m.queued_ts, 0.0))
            timer.on_output(self, output)
            if timer.observed == 0 and m.num_generation_tokens > 1 and m.last_token_ts > m.first_token_ts:
                # One output for the whole request (FINAL_ONLY): its mean gap, once.
                self.itl.observe((m.last_token_ts - m.first_token_ts) / (m.num_generation_tokens - 1))
        if m.scheduled_ts:
            self.queue.observe(max(m.scheduled_ts - m.queued_ts, 0.0))
        if m.finished_ts:
            self.e2e.observe(max(m.finished_ts - m.queued_ts, 0.0))


@dataclass(slots=True)
class RequestTimer:
    """Per request: the last token time seen, for inter-token latency across streamed outputs, and
    the finish reason of each choice as it ends."""

    last_token_ts: float = 0.0
    observed: int = 0
    finish_reasons: dict[int, str] = field(default_factory=dict)  # choice index -> its finish reason

    def see_finishes(self, output: RequestOutput) -> None:
        for c in output.outputs:
            if c.finish_reason is not None:
                self.finish_reasons.setdefault(c.index, c.finish_reason)

    def on_output(self, metrics: ServerMetrics, output: RequestOutput) -> None:
        self.see_finishes(output)
        m = output.metrics
        if m is None or not m.last_token_ts:
            return
        if self.last_token_ts and m.last_token_ts > self.last_token_ts:
            metrics.itl.observe(m.last_token_ts - self.last_token_ts)
            self.observed += 1
        self.last_token_ts = max(self.last_token_ts, m.last_token_ts)
