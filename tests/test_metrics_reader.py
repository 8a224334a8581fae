"""``LLM.get_metrics()`` (vLLM's offline metrics, ``ferrokv.metrics_reader``): the engine's
counters and gauges as ``Counter``/``Gauge`` values with vLLM's names and labels, counting what was
run; the same table ``/metrics`` serves."""
from __future__ import annotations

import dataclasses

from ferrokv import SamplingParams
from ferrokv.metrics_reader import COUNTERS, GAUGES, ITERATION_TOKENS, Counter, Gauge, Histogram, Metric, Vector
from helpers.engine_faults import tiny_llm


def test_get_metrics_counts_what_ran(llama_path):
    llm = tiny_llm(llama_path)
    before = {m.name: m for m in llm.get_metrics()}
    assert set(before) == set(COUNTERS) | set(GAUGES) | {ITERATION_TOKENS[0]}  # vLLM's reader: no _total
    outs = llm.generate(["the cat runs", "a dog"], SamplingParams(max_tokens=5, ignore_eos=True, n=2), use_tqdm=False)
    after = {m.name: m for m in llm.get_metrics()}
    generated = sum(len(c.token_ids) for o in outs for c in o.outputs)
    prompts = sum(len(o.prompt_token_ids) for o in outs)
    assert generated == 20
    assert after["ferrokv:generation_tokens"].value - before["ferrokv:generation_tokens"].value == 20
    assert after["ferrokv:prompt_tokens"].value - before["ferrokv:prompt_tokens"].value == prompts
    steps, steps_before = after.pop(ITERATION_TOKENS[0]), before[ITERATION_TOKENS[0]]
    assert isinstance(steps, Histogram) and steps.labels == {"model_name": llm.model_config.model}
    # Four sequences decode one token per step; the first step took both prompts at once.
    assert steps.count - steps_before.count == 5 and steps.sum - steps_before.sum == prompts + 4 * 4
    assert list(steps.buckets)[:2] == ["1.0", "8.0"] and list(steps.buckets)[-1] == "+Inf"
    grew = {le: steps.buckets[le] - steps_before.buckets[le] for le in steps.buckets}  # cumulative buckets
    assert steps.buckets["+Inf"] == steps.count and grew["1.0"] == 0 and grew["8.0"] == 4 + (prompts <= 8)
    for m in after.values():
        assert isinstance(m, Counter if m.name in COUNTERS else Gauge), m
        assert isinstance(m, Metric) and m.labels == {"model_name": llm.model_config.model}
    assert after["ferrokv:num_requests_running"].value == after["ferrokv:num_requests_waiting"].value == 0
    assert after["ferrokv:kv_cache_usage_perc"].value == 0.0
    assert 0 < after["ferrokv:num_free_blocks"].value == after["ferrokv:num_blocks"].value
    assert isinstance(after["ferrokv:num_free_blocks"].value, float)
    assert isinstance(after["ferrokv:generation_tokens"].value, int)


def test_the_types_are_vllms():
    fields = {cls.__name__: [f.name for f in dataclasses.fields(cls)] for cls in (Counter, Gauge, Vector, Histogram)}
    assert fields == {"Counter": ["name", "labels", "value"], "Gauge": ["name", "labels", "value"],
                      "Vector": ["name", "labels", "values"],
                      "Histogram": ["name", "labels", "count", "sum", "buckets"]}
