"""``LLM.get_metrics()`` (vLLM's offline metrics, ``ferrokv.metrics_reader``): the engine's
counters and gauges as ``Counter``/``Gauge`` values with vLLM's names and labels, counting what was
run; the same table ``/metrics`` serves."""
from __future__ import annotations

import dataclasses

from ferrokv import SamplingParams
from ferrokv.metrics_reader import COUNTERS, GAUGES, Counter, Gauge, Histogram, Metric, Vector
from helpers.engine_faults import tiny_llm


def test_get_metrics_counts_what_ran(llama_path):
    llm = tiny_llm(llama_path)
    before = {m.name: m for m in llm.get_metrics()}
    assert set(before) == {n + "_total" for n in COUNTERS} | set(GAUGES)
    outs = llm.generate(["the cat runs", "a dog"], SamplingParams(max_tokens=5, ignore_eos=True, n=2), use_tqdm=False)
    after = {m.name: m for m in llm.get_metrics()}
    generated = sum(len(c.token_ids) for o in outs for c in o.outputs)
    prompts = sum(len(o.prompt_token_ids) for o in outs)
    assert generated == 20
    assert after["ferrokv:generation_tokens_total"].value - before["ferrokv:generation_tokens_total"].value == 20
    assert after["ferrokv:prompt_tokens_total"].value - before["ferrokv:prompt_tokens_total"].value == prompts
    for m in after.values():
        assert isinstance(m, Counter if m.name.endswith("_total") else Gauge), m
        assert isinstance(m, Metric) and m.labels == {"model_name": llm.model_config.model}
    assert after["ferrokv:num_requests_running"].value == after["ferrokv:num_requests_waiting"].value == 0
    assert after["ferrokv:kv_cache_usage_perc"].value == 0.0
    assert 0 < after["ferrokv:num_free_blocks"].value == after["ferrokv:num_blocks"].value
    assert isinstance(after["ferrokv:num_free_blocks"].value, float)
    assert isinstance(after["ferrokv:generation_tokens_total"].value, int)


def test_the_types_are_vllms():
    fields = {cls.__name__: [f.name for f in dataclasses.fields(cls)] for cls in (Counter, Gauge, Vector, Histogram)}
    assert fields == {"Counter": ["name", "labels", "value"], "Gauge": ["name", "labels", "value"],
                      "Vector": ["name", "labels", "values"],
                      "Histogram": ["name", "labels", "count", "sum", "buckets"]}
