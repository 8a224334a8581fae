"""The server's per-request histograms (``ferrokv.entrypoints.openai.metrics``), fed outputs as
the server gets them: vLLM's families, buckets and semantics (each of n choices counts as one of
vLLM's child requests; ``n``, ``max_tokens`` and the longest choice once per request)."""

from __future__ import annotations

import collections

import pytest

from ferrokv.entrypoints.openai.metrics import RequestTimer, ServerMetrics, token_buckets
from ferrokv.outputs import CompletionOutput, RequestOutput, RequestStateStats


class _Engine:
    max_model_len = 100

    def stats(self):
        return collections.defaultdict(int, step_tokens_le_inf=0)  # the core's keys (no step yet)


def _sample(m, name, **labels):
    return m.registry.get_sample_value(f"ferrokv:{name}", {"model_name": "m", **labels})


def _finished(choice_tokens, stats, prompt_len=7):
    comps = [CompletionOutput(i, "x", [5] * k, finish_reason="length") for i, k in enumerate(choice_tokens)]
    return RequestOutput("r", None, [1] * prompt_len, None, comps, True, metrics=stats)


def test_token_buckets_are_vllms_1_2_5_series():
    assert token_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert token_buckets(4096)[-3:] == (500, 1000, 2000)
    assert token_buckets(1) == (1,)


def test_a_finished_request_observes_vllms_per_request_histograms():
    m = ServerMetrics(_Engine(), "m", lambda: 0)
    stats = RequestStateStats(13, 0.0, queued_ts=1.0, scheduled_ts=1.5, first_token_ts=1.75, last_token_ts=2.75,
                              finished_ts=2.75)
    m.on_output(_finished([3, 10], stats), RequestTimer(n=2, max_tokens=10))
    # Once per request: n, the longest choice.
    assert (_sample(m, "request_params_n_count"), _sample(m, "request_params_n_sum")) == (1, 2)
    assert _sample(m, "request_params_max_tokens_sum") == 2 * 10  # per choice, as vLLM's child requests
    assert _sample(m, "request_max_num_generation_tokens_sum") == 10
    assert _sample(m, "request_max_num_generation_tokens_bucket", le="5.0") == 0
    # Once per choice: max_tokens, prompt and generated tokens, the phases, the time per output token.
    assert (_sample(m, "request_prompt_tokens_count"), _sample(m, "request_prompt_tokens_sum")) == (2, 14)
    assert (_sample(m, "request_generation_tokens_count"), _sample(m, "request_generation_tokens_sum")) == (2, 13)
    assert _sample(m, "request_generation_tokens_bucket", le="5.0") == 1
    for name, each in (("prefill", 0.25), ("decode", 1.0), ("inference", 1.25)):
        assert _sample(m, f"request_{name}_time_seconds_count") == 2, name
        assert _sample(m, f"request_{name}_time_seconds_sum") == pytest.approx(2 * each), name
    assert _sample(m, "request_time_per_output_token_seconds_count") == 2
    assert _sample(m, "request_time_per_output_token_seconds_sum") == pytest.approx(1.0 / 2 + 1.0 / 9)


def test_max_tokens_not_asked_counts_what_the_context_leaves_and_a_tokenless_request_times_nothing():
    m = ServerMetrics(_Engine(), "m", lambda: 0)
    queued_only = RequestStateStats(0, 0.0, queued_ts=1.0, finished_ts=1.2)  # aborted before any token
    m.on_output(_finished([], queued_only, prompt_len=30), RequestTimer())
    assert _sample(m, "request_params_max_tokens_sum") == 100 - 30  # vLLM's server default
    assert _sample(m, "request_params_n_count") == 1
    assert _sample(m, "request_prompt_tokens_count") == 1  # its one choice, which got no token
    assert _sample(m, "request_generation_tokens_sum") == 0
    for name in ("prefill", "decode", "inference"):
        assert _sample(m, f"request_{name}_time_seconds_count") == 0, name
    # An unfinished output observes none of them; a one-token choice's time per output token is 0 (vLLM's).
    one = RequestStateStats(1, 0.0, queued_ts=1.0, scheduled_ts=1.0, first_token_ts=1.1, last_token_ts=1.1,
                            finished_ts=1.1)
    timer = RequestTimer(max_tokens=1)
    m.on_output(RequestOutput("r", None, [1], None, [CompletionOutput(0, "x", [5])], False, metrics=one), timer)
    assert _sample(m, "request_params_n_count") == 1
    m.on_output(_finished([0], one), timer)
    assert _sample(m, "request_params_n_count") == 2
    assert _sample(m, "request_generation_tokens_sum") == 1
    assert _sample(m, "request_time_per_output_token_seconds_count") == 1
    assert _sample(m, "request_time_per_output_token_seconds_sum") == 0.0


def test_a_request_whose_client_left_counts_its_unfinished_choices_as_aborted():
    """vLLM records aborted requests by finish reason too (its request_success_total "abort"); one
    that never had an output (refused, or gone while queued) counts nothing, one that finished
    counts once."""
    m = ServerMetrics(_Engine(), "m", lambda: 0)
    stats = RequestStateStats(1, 0.0, queued_ts=1.0, scheduled_ts=1.0, first_token_ts=1.1, last_token_ts=1.1)
    timer = RequestTimer(n=3)
    m.on_output(RequestOutput("r", None, [1], None, [CompletionOutput(0, "x", [5]),
                                                       CompletionOutput(1, "x", [5], finish_reason="stop")],
                              False, metrics=stats), timer)
    m.on_close(timer)
    m.on_close(timer)  # closing is idempotent
    assert (_sample(m, "request_success_total", finished_reason="abort"),
            _sample(m, "request_success_total", finished_reason="stop")) == (2, 1)
    m.on_close(RequestTimer())
    done = RequestTimer(n=2)
    m.on_output(_finished([1, 2], stats), done)
    m.on_close(done)
    assert (_sample(m, "request_success_total", finished_reason="abort"),
            _sample(m, "request_success_total", finished_reason="length")) == (2, 2)
