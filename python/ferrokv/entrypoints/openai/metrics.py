"""``GET /metrics``: the engine's gauges and counters and the requests' latency histograms, in
Prometheus' text format, with vLLM's metric names under the ``ferrokv:`` prefix.

Invariants: every server has its own ``CollectorRegistry`` (never the global one), so two apps in
one process do not mix. Gauges and counters are read from the engine at scrape time
(``AsyncLLM.stats``: the engine is their one home); the histograms are observed from each
request's ``RequestOutput.metrics`` (the core's timestamps). Each of a request's n choices counts
as one request, as vLLM's child requests do (running and waiting sequences, successes, TTFT, e2e and queue
time). TTFT is observed with the first output that has a token (a stream's first chunk), e2e and
queue time at the end; inter-token latency once per decode step of each choice, however the
client reads it (streamed or not), the request's mean gap between steps (the core keeps the first
and latest token times, not each gap), and also for a stream whose client left before its end.
A request that never got a token observes nothing. A request whose client left counts its
unfinished choices as finished by "abort" once it had an output or the engine took it (one whose
call an error ended, a refused prompt of its batch or a failed step, is not counted, whenever the
error came). At a request's end, vLLM's per-request histograms too: per choice its prompt and
generated tokens and its prefill (scheduled to first token), decode (first to latest token),
inference (scheduled to latest token) and mean time-per-output-token and the request's ``max_tokens`` (none asked: what ``max_model_len`` leaves
after the prompt, vLLM's server default); per request its ``n`` and its longest choice. The core
keeps one set of timestamps per request, so every choice is timed with the request's (vLLM's
child requests each have their own).
Every series is labelled with ``model_name``, as vLLM's; ``/metrics`` answers OpenMetrics to a
scraper that asks for it.
Costs: a scrape is one ``stats()`` snapshot, O(KV blocks); an observation is O(1).
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from ferrokv.metrics_reader import COUNTERS, GAUGES, ITERATION_TOKENS, step_token_buckets
from ferrokv.outputs import RequestOutput, RequestStateStats

__all__ = ["RequestTimer", "ServerMetrics"]

_OPENMETRICS = "application/openmetrics-text"

# vLLM's buckets (seconds).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)
_N_BUCKETS = (1, 2, 5, 10, 20)


def token_buckets(max_model_len: int) -> tuple[float, ...]:
    """vLLM's buckets for token counts: 1, 2, 5, 10, 20, 50, ... up to ``max_model_len``."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(out)
            out.append(float(m * scale))
        scale *= 10


class _EngineCollector:
    """Reads the engine's stats at scrape time."""

    def __init__(self, async_llm: Any, model_name: str, extra: dict[str, Any]) -> None:
        self._llm = async_llm
        self._model = [model_name]
        self._extra = extra  # name -> (callable, help): server-side gauges

    def collect(self) -> Iterator[Metric]:
        st = self._llm.stats()
        values = [(GaugeMetricFamily, name, doc, st[key]) for name, (key, doc) in GAUGES.items()]
        values += [(CounterMetricFamily, name, doc, st[key]) for name, (key, doc) in COUNTERS.items()]
        values += [(GaugeMetricFamily, name, doc, read()) for name, (read, doc) in self._extra.items()]
        for family, name, doc, value in values:
            metric = family(name, doc, labels=["model_name"])
            metric.add_metric(self._model, float(value))
            yield metric
        buckets, total = step_token_buckets(st)
        steps = HistogramMetricFamily(*ITERATION_TOKENS, labels=["model_name"])
        steps.add_metric(self._model, buckets, float(total))
        yield steps


class _Histogram:
    """A histogram (one ``model_name`` series) whose observation may count several times at once
    (a request's n samples; its mean gap between decode steps, once per step). No ``_created``
    series: prometheus_client's own metrics would need a process-wide switch to drop them."""

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


class _Fixed:
    """A metric that never changes."""

    def __init__(self, metric: Metric) -> None:
        self._metric = metric

    def collect(self) -> Iterator[Metric]:
        yield self._metric


class _FinishCounter:
    """``request_success_total`` by finish reason, every reason's series there from the start (as
    vLLM's), so that ``rate()`` sees the first finish."""

    _REASONS = ("stop", "length", "abort", "error")  # vLLM's FinishReason values

    def __init__(self, model_name: str) -> None:
        self._model = model_name
        self._counts = dict.fromkeys(self._REASONS, 0)
        self._lock = threading.Lock()

    def inc(self, reason: str) -> None:
        with self._lock:
            self._counts[reason] = self._counts.get(reason, 0) + 1

    def collect(self) -> Iterator[Metric]:
        metric = CounterMetricFamily("ferrokv:request_success",
                                     "Sequences finished (each of a request's n choices), by finish reason.",
                                     labels=["model_name", "finished_reason"])
        with self._lock:
            counts = dict(self._counts)
        for reason, count in counts.items():
            metric.add_metric([self._model, reason], float(count))
        yield metric


class ServerMetrics:
    """The server's registry: engine metrics, latency histograms, finished-request counts."""

    def __init__(self, async_llm: Any, model_name: str, in_flight_http: Any,
                 cache_info: dict[str, str] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        if cache_info is not None:  # vLLM's cache_config_info: the cache's settings as labels, value 1
            info = GaugeMetricFamily("ferrokv:cache_config_info", "The KV cache's settings.",
                                     labels=["model_name", *cache_info])
            info.add_metric([model_name, *cache_info.values()], 1.0)
            self.registry.register(_Fixed(info))
        extra = {"ferrokv:num_requests_in_flight": (in_flight_http, "HTTP generation requests being served.")}
        self.registry.register(_EngineCollector(async_llm, model_name, extra))
        self.ttft = _Histogram("ferrokv:time_to_first_token_seconds", "Time to the first token (queued to token).",
                               _TTFT_BUCKETS, model_name)
        self.itl = _Histogram("ferrokv:inter_token_latency_seconds",
                              "Time between a sequence's decode steps (one observation per step).", _ITL_BUCKETS,
                              model_name)
        self.e2e = _Histogram("ferrokv:e2e_request_latency_seconds", "Time from queued to finished.", _E2E_BUCKETS,
                              model_name)
        self.queue = _Histogram("ferrokv:request_queue_time_seconds", "Time from queued to first scheduled.",
                                _E2E_BUCKETS, model_name)
        self._success = _FinishCounter(model_name)
        self._max_model_len = async_llm.max_model_len
        tokens = token_buckets(self._max_model_len)
        per_request = {  # attribute: (name, help, buckets)
            "prompt_tokens": ("request_prompt_tokens", "Prompt tokens of each finished request.", tokens),
            "generation_tokens": ("request_generation_tokens", "Tokens generated by each finished request.",
                                  tokens),
            "max_generation_tokens": ("request_max_num_generation_tokens",
                                      "The most tokens one of a finished request's n choices generated.", tokens),
            "params_n": ("request_params_n", "The n parameter of each finished request.", _N_BUCKETS),
            "params_max_tokens": ("request_params_max_tokens", "The max_tokens parameter of each finished request.",
                                  tokens),
            "prefill": ("request_prefill_time_seconds", "Time from first scheduled to the first token.",
                        _E2E_BUCKETS),
            "decode": ("request_decode_time_seconds", "Time from the first token to the last.", _E2E_BUCKETS),
            "inference": ("request_inference_time_seconds", "Time from first scheduled to the last token.",
                          _E2E_BUCKETS),
            "tpot": ("request_time_per_output_token_seconds", "Mean time between a finished request's tokens.",
                     _ITL_BUCKETS),
        }
        self._per_request = {key: _Histogram(f"ferrokv:{name}", doc, buckets, model_name)
                             for key, (name, doc, buckets) in per_request.items()}
        for collector in (self.ttft, self.itl, self.e2e, self.queue, self._success, *self._per_request.values()):
            self.registry.register(collector)

    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """The registry in the format ``accept`` asks for (OpenMetrics or Prometheus' text), and
        its content type."""
        encoder, content_type = choose_encoder(accept or "")
        if content_type.startswith(_OPENMETRICS):
            # Not prometheus_client's escaping: it would rename every sample ferrokv_x where its
            # family stays ferrokv:x (a colon is valid in these names, so nothing needs it).
            return openmetrics.generate_latest(self.registry, escaping="allow-utf-8"), \
                f"{_OPENMETRICS}; version=1.0.0; charset=utf-8"
        return encoder(self.registry), content_type

    def on_output(self, output: RequestOutput, timer: RequestTimer) -> None:
        """Counts one output the server got for a request: its time to first token as soon as it
        has one; at its end its choices by finish reason (a DELTA choice that ended earlier is not
        in the last output: the timer saw it), its queue and end-to-end times and its steps.
        Each of the n choices counts as one of vLLM's child requests."""
        timer.on_output(output)
        m = output.metrics
        timed = m is not None and bool(m.queued_ts)  # not when aborted before the engine recorded anything
        if timed:
            timer.last = m
            if not timer.ttft_seen and m.first_token_ts:
                timer.ttft_seen = True
                self.ttft.observe(max(m.first_token_ts - m.queued_ts, 0.0), len(timer.tokens))
        if not output.finished:
            return
        timer.outcome_counted = True
        for reason in timer.finish_reasons.values():
            self._success.inc(reason)
        self._observe_steps(timer)
        if timed and m.scheduled_ts:
            self.queue.observe(max(m.scheduled_ts - m.queued_ts, 0.0), len(timer.tokens))
        if timed and m.finished_ts:
            self.e2e.observe(max(m.finished_ts - m.queued_ts, 0.0), len(timer.tokens))
        self._observe_request(output, timer, m if timed else None)

    def _observe_request(self, output: RequestOutput, timer: RequestTimer, m: RequestStateStats | None) -> None:
        """vLLM's per-request histograms of a finished request (module docs)."""
        h = self._per_request
        prompt_len = len(output.prompt_token_ids or ())
        max_tokens = timer.max_tokens if timer.max_tokens is not None else self._max_model_len - prompt_len
        h["params_n"].observe(timer.n)
        h["max_generation_tokens"].observe(max(timer.tokens.values(), default=0))
        for choice in range(timer.n):  # each choice, as vLLM's child requests (one without a token too)
            h["params_max_tokens"].observe(max_tokens)
            h["prompt_tokens"].observe(prompt_len)
            h["generation_tokens"].observe(timer.tokens.get(choice, 0))
        if m is None or not m.first_token_ts or not m.scheduled_ts:
            return  # it never got a token: no phase to time
        choices = len(timer.tokens)
        decode = max(m.last_token_ts - m.first_token_ts, 0.0)
        h["prefill"].observe(max(m.first_token_ts - m.scheduled_ts, 0.0), choices)
        h["decode"].observe(decode, choices)
        h["inference"].observe(max(m.last_token_ts - m.scheduled_ts, 0.0), choices)
        for generated in timer.tokens.values():  # vLLM's: 0 for a choice of one token
            h["tpot"].observe(decode / (generated - 1) if generated > 1 else 0.0)

    def on_close(self, timer: RequestTimer, failed: bool = False) -> None:
        """A request closed before its end: its decode steps so far still count (vLLM observes each
        as it happens), and once it was the engine's (``seen``), each choice counts as finished by
        its own reason, or "abort" when its client went away (the server aborts it); one an error
        ended (``failed``) is no success, and no abort either."""
        if not timer.steps_counted:
            self._observe_steps(timer)
        if timer.seen and not timer.outcome_counted:
            timer.outcome_counted = True
            for choice in range(timer.n):
                reason = timer.finish_reasons.get(choice, None if failed else "abort")
                if reason is not None:
                    self._success.inc(reason)

    def _observe_steps(self, timer: RequestTimer) -> None:
        # The request's mean gap between decode steps, once per step of each choice (the core
        # keeps the first and latest token times, not each gap).
        timer.steps_counted = True
        m = timer.last
        steps = max(timer.tokens.values(), default=0) - 1
        if m is None or steps <= 0 or not m.first_token_ts or m.last_token_ts <= m.first_token_ts:
            return
        each_choice = sum(max(t - 1, 0) for t in timer.tokens.values())
        self.itl.observe((m.last_token_ts - m.first_token_ts) / steps, each_choice)


@dataclass(slots=True)
class RequestTimer:
    """Per request, from the outputs the server got (DELTA or FINAL_ONLY, the server's kinds):
    each choice's tokens so far (its decode steps) and its finish reason as it ends."""

    n: int = 1  # the request's n and max_tokens (None: the server's default), for the histograms
    max_tokens: int | None = None
    tokens: dict[int, int] = field(default_factory=dict)  # choice index -> tokens generated
    finish_reasons: dict[int, str] = field(default_factory=dict)  # choice index -> its finish reason
    last: RequestStateStats | None = None  # the timestamps of the latest output
    ttft_seen: bool = False
    steps_counted: bool = False
    seen: bool = False  # an output came: the request is the engine's
    outcome_counted: bool = False  # its choices are in request_success_total

    def on_output(self, output: RequestOutput) -> None:
        self.seen = True
        for c in output.outputs:
            self.tokens[c.index] = self.tokens.get(c.index, 0) + len(c.token_ids)
            if c.finish_reason is not None:
                self.finish_reasons.setdefault(c.index, c.finish_reason)
