"""vLLM's periodic stats line (``ferrokv.stats_log``): rates over the interval alone, the
prefix-cache hit rate of the interval's lookups, and one line when the engine goes idle, then
silence until work comes. Also through a real engine (``AsyncLLM.do_log_stats``)."""
from __future__ import annotations

import asyncio
import logging

from ferrokv.stats_log import StatsLog

ZERO = {"prompt_tokens": 0, "generated_tokens": 0, "prefix_cache_queried_tokens": 0,
        "first_admission_cached_tokens": 0, "num_running_seqs": 0, "num_waiting_seqs": 0, "kv_cache_usage": 0.0}


def test_rates_are_of_the_interval_and_idle_logs_once():
    log = StatsLog(ZERO, now=100.0)
    busy = {**ZERO, "prompt_tokens": 400, "generated_tokens": 50, "prefix_cache_queried_tokens": 400,
            "first_admission_cached_tokens": 100, "num_running_seqs": 3, "num_waiting_seqs": 2, "kv_cache_usage": 0.25}
    assert log.log(busy, now=110.0) == (
        "Avg prompt throughput: 40.0 tokens/s, Avg generation throughput: 5.0 tokens/s, Running: 3 reqs, "
        "Waiting: 2 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%")
    later = {**busy, "generated_tokens": 250, "num_waiting_seqs": 0}  # only decoding since
    line = log.log(later, now=120.0)
    assert "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 20.0 tokens/s" in line
    assert "Prefix cache hit rate: 0.0%" in line  # no lookup in this interval
    idle = {**later, "num_running_seqs": 0, "kv_cache_usage": 0.0}
    assert "Running: 0 reqs" in log.log(idle, now=130.0)  # the line that says it went idle
    assert log.log(idle, now=140.0) is None and log.log(idle, now=150.0) is None
    woke = {**idle, "num_waiting_seqs": 1}
    assert "Waiting: 1 reqs" in log.log(woke, now=151.0)


def test_a_fresh_engine_logs_nothing_until_work():
    log = StatsLog(ZERO, now=0.0)
    assert log.log(ZERO, now=10.0) is None


def test_do_log_stats_logs_a_real_engines_interval(llama_path, caplog):
    from ferrokv import AsyncLLM, SamplingParams

    llm = AsyncLLM(str(llama_path), device="cpu", dtype="float32", max_model_len=128, num_gpu_blocks_override=64)

    async def main():
        async for _ in llm.generate("the cat runs", SamplingParams(max_tokens=6, ignore_eos=True), "a"):
            pass
        await llm.do_log_stats()
        await llm.do_log_stats()  # the line that says it went idle
        await llm.do_log_stats()  # silence

    records: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda r: records.append(r.getMessage())  # type: ignore[method-assign]
    logging.getLogger("ferrokv").addHandler(handler)
    try:
        asyncio.run(main())
    finally:
        logging.getLogger("ferrokv").removeHandler(handler)
        llm.shutdown()
    lines = [r for r in records if r.startswith("Avg prompt throughput")]
    assert len(lines) == 2, records
    assert all("Running: 0 reqs, Waiting: 0 reqs" in line for line in lines)
    assert float(lines[0].split("Avg generation throughput: ")[1].split(" ")[0]) > 0
    assert "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s" in lines[1]


def test_every_key_it_reads_is_in_the_async_engines_stats(llama_path):
    """The keys are the engine's own: a renamed one fails here, not in a server's log."""
    from ferrokv import AsyncLLM

    llm = AsyncLLM(str(llama_path), device="cpu", dtype="float32", max_model_len=128, num_gpu_blocks_override=64)
    try:
        assert set(ZERO) <= set(llm.stats())
    finally:
        llm.shutdown()
