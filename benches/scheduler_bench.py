#!/usr/bin/env python
"""Scheduler loop benchmark through the Python boundary (``ferrokv._core.Scheduler``).

Drives the scheduler the way the model runner will: ``schedule()``, read the arrays a runner
copies to the device (input_ids, positions, slot_mapping, query_start_loc, seq_lens,
block_tables, logits_indices), run a stand-in "model" that returns one token per logits row,
then ``update()``. The timed part of a step is ``schedule()`` + reading the arrays (their numpy
wrappers are created lazily, on first access, so this is part of the boundary) + ``update()``;
the stand-in model (``np.full(num_rows, 7)``) is not timed.

Two experiments; ``rust/ferrokv-bench/src/bin/sched_loop.rs`` runs both without Python
(``cargo run --release -p ferrokv-bench --bin sched_loop``), so the difference between the two programs is the cost of the Python boundary.

1. Workload (ShareGPT-like): prompt and output lengths are lognormal with means of 160 and 340
   tokens (before clipping; sigma 1.0), clipped to [4, 2048], drawn from a splitmix64 +
   Box-Muller generator implemented identically in both programs, so for one seed both run
   exactly the same requests (compare the ``checksum``). Request ``r`` has prompt tokens
   ``r * 4096 + [0, len)`` (no shared prefixes), samples token 7 with ``ignore_eos`` and stops at
   ``max_tokens`` = its output length. All requests are queued at the start. Configurations:
   for every size S in ``--sizes``, max_num_seqs = S with a roomy KV cache (64 blocks of 16
   tokens per sequence); S=1024 again with 4x the requests; S=256 with a tight cache (16
   blocks per sequence: recompute preemption). Reported: ``all`` steps and ``decode-only
   steady`` steps (no prefill token while requests are still queued, i.e. the batch is as
   full as the cache and max_num_seqs allow): mean / p50 / p99 µs per step, µs per
   sequence-step, mean sequences and mean block-table width per step; steps, preemptions, max
   running sequences; prefill tokens computed (prompt_tokens_computed +
   output_tokens_recomputed) vs the minimum (prompt_tokens - first_admission_cached_tokens)
   and their ratio ("waste").

2. Fixed decode batch: S requests with 160-token prompts are prefilled (untimed), then
   ``--fixed-steps`` pure decode steps are timed with exactly S running sequences. For S=1024
   it is repeated with requests queued behind the full batch (4,000 and 16,000 requests in
   total): the per-step cost must depend on the sequences scheduled, not on the number of
   requests. This is the clean "µs per step at S running decode sequences" number (the
   workload's steady state mixes in the block-table width of its longest sequence). The
   cache holds every sequence's prompt and all timed steps (no preemption, nobody finishes).
   The batches advance round-robin, 25 steps at a time, so that load from other processes
   on a shared machine hits all of them alike.

Usage::

    python benches/scheduler_bench.py                  # default, well under 2 min on 2 cores
    python benches/scheduler_bench.py --quick          # a few seconds
    python benches/scheduler_bench.py --sizes 64,1024 --requests 4000 --json
    python benches/scheduler_bench.py --only-fixed --json   # experiment 2, one line per size (compare_builds.py)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass

import numpy as np

from ferrokv._core import Scheduler

BLOCK_SIZE = 16
MAX_MODEL_LEN = 4096
MAX_NUM_BATCHED_TOKENS = 8192
MIN_LEN, MAX_LEN = 4, 2048
# lognormal(mu, sigma) has mean exp(mu + sigma^2 / 2).
PROMPT_MEAN, PROMPT_SIGMA = 160.0, 1.0
OUTPUT_MEAN, OUTPUT_SIGMA = 340.0, 1.0
ROOMY_BLOCKS_PER_SEQ = 64
TIGHT_BLOCKS_PER_SEQ = 16
SAMPLED_TOKEN = 7
DEFAULT_REQUESTS = {64: 1000, 256: 2000, 1024: 4000, 4096: 16000}
FIXED_PROMPT_LEN = 160
FIXED_QUEUE_TOTALS = (4000, 16000)
_M64 = (1 << 64) - 1


class SplitMix64:
    """splitmix64 (Steele, Lea, Flood); the same generator as in sched_loop.rs."""

    def __init__(self, seed: int) -> None:
        self.state = seed & _M64

    def next_u64(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & _M64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
        return z ^ (z >> 31)

    def uniform(self) -> float:
        """Uniform in (0, 1]."""
        return ((self.next_u64() >> 11) + 1) * (1.0 / (1 << 53))

    def normal(self) -> float:
        u1 = self.uniform()
        u2 = self.uniform()
        return math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)

    def lognormal_len(self, mean: float, sigma: float) -> int:
        mu = math.log(mean) - sigma * sigma / 2.0
        x = math.exp(mu + sigma * self.normal())
        return int(min(max(math.floor(x + 0.5), MIN_LEN), MAX_LEN))


def workload(num_requests: int, seed: int) -> tuple[list[int], list[int]]:
    """(prompt lengths, output lengths); request r draws its prompt length, then its output."""
    rng = SplitMix64(seed)
    prompts, outputs = [], []
    for _ in range(num_requests):
        prompts.append(rng.lognormal_len(PROMPT_MEAN, PROMPT_SIGMA))
        outputs.append(rng.lognormal_len(OUTPUT_MEAN, OUTPUT_SIGMA))
    return prompts, outputs


def prompt(r: int, length: int) -> np.ndarray:
    return np.arange(r * 4096, r * 4096 + length, dtype=np.int64)


def new_scheduler(size: int, num_blocks: int) -> Scheduler:
    return Scheduler(
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        max_num_seqs=size,
        max_num_batched_tokens=max(MAX_NUM_BATCHED_TOKENS, size),
        max_model_len=MAX_MODEL_LEN,
        enable_prefix_caching=True,
    )


class StepTimer:
    """Runs and times steps; records µs, sequences and block-table width per step."""

    def __init__(self, s: Scheduler) -> None:
        self.s = s
        self.times: list[int] = []
        self.seqs: list[int] = []
        self.widths: list[int] = []
        self.touched = 0

    def step(self):
        s, perf = self.s, time.perf_counter_ns
        t0 = perf()
        out = s.schedule()
        # What a runner reads (and would copy to the device) every step.
        touched = out.input_ids.shape[0]
        touched += out.positions.shape[0]
        touched += out.slot_mapping.shape[0]
        touched += out.query_start_loc.shape[0]
        touched += out.seq_lens.shape[0]
        width = out.block_tables.shape[1]
        touched += out.logits_indices.shape[0]
        t1 = perf()
        sampled = np.full(out.num_rows, SAMPLED_TOKEN, np.int32)  # the stand-in model
        t2 = perf()
        s.update(out, sampled)
        t3 = perf()
        self.touched += touched + width
        self.times.append((t1 - t0) + (t3 - t2))
        self.seqs.append(out.num_seqs)
        self.widths.append(width)
        return out


def summarize(times_ns, seqs, widths) -> dict:
    if len(times_ns) == 0:
        return {k: None for k in ("mean_us", "p50_us", "p99_us", "us_per_seq_step", "mean_seqs", "mean_width")} | {"steps": 0}
    us = np.asarray(times_ns, dtype=np.float64) / 1e3
    n = np.asarray(seqs, dtype=np.float64)
    return {
        "steps": int(len(us)),
        "mean_us": float(us.mean()),
        "p50_us": float(np.percentile(us, 50)),
        "p99_us": float(np.percentile(us, 99)),
        "us_per_seq_step": float(us.sum() / max(1.0, n.sum())),
        "mean_seqs": float(n.mean()),
        "mean_width": float(np.mean(widths)),
    }


@dataclass
class Config:
    label: str
    size: int
    requests: int
    blocks_per_seq: int

    @property
    def num_blocks(self) -> int:
        return 1 + self.size * self.blocks_per_seq


def run_workload(cfg: Config, seed: int) -> dict:
    prompts, outputs = workload(cfg.requests, seed)
    s = new_scheduler(cfg.size, cfg.num_blocks)
    for r, (p, o) in enumerate(zip(prompts, outputs)):
        s.add_request(r, prompt(r, p), o, ignore_eos=True)
    timer = StepTimer(s)
    steady: list[bool] = []
    wall0 = time.perf_counter()
    while s.has_unfinished():
        waiting = s.num_waiting > 0  # before schedule(): what it had to choose from
        out = timer.step()
        steady.append(waiting and out.num_prefill_tokens == 0 and out.num_seqs > 0)
    wall = time.perf_counter() - wall0
    st = s.stats()
    assert st["requests_finished"] == cfg.requests and s.num_free_blocks == cfg.num_blocks - 1, st
    assert st["generated_tokens"] == sum(outputs), st
    s.check_invariants()

    t, n, w = np.asarray(timer.times), np.asarray(timer.seqs), np.asarray(timer.widths)
    m = np.asarray(steady, dtype=bool)
    computed = st["prompt_tokens_computed"] + st["output_tokens_recomputed"]
    minimum = st["prompt_tokens"] - st["first_admission_cached_tokens"]
    return {
        "kind": "workload",
        "impl": "python",
        "label": cfg.label,
        "size": cfg.size,
        "requests": cfg.requests,
        "num_blocks": cfg.num_blocks,
        "checksum": [sum(prompts), sum(outputs)],
        "all": summarize(t, n, w),
        "decode_steady": summarize(t[m], n[m], w[m]),
        "steps": int(st["steps"]),
        "preemptions": int(st["preemptions"]),
        "max_running_seqs": int(st["max_running_seqs"]),
        "prefill_computed": int(computed),
        "prefill_min": int(minimum),
        "output_tokens_recomputed": int(st["output_tokens_recomputed"]),
        "cached_prompt_tokens": int(st["cached_prompt_tokens"]),
        "first_admission_cached_tokens": int(st["first_admission_cached_tokens"]),
        "waste_ratio": computed / minimum if minimum else None,
        "wall_s": wall,
    }


def setup_fixed(size: int, total_requests: int, steps: int) -> StepTimer:
    """`size` decode sequences running, `total_requests - size` queued behind them."""
    # Room for every sequence to decode all timed steps: no preemption, nobody finishes (the
    # first admitted start decoding while the last are still prefilling: at most `ramp` steps,
    # as the running sequences' decode tokens share the budget).
    budget = max(MAX_NUM_BATCHED_TOKENS, size)
    assert budget > size, "the fixed batch needs max_num_batched_tokens > size"
    ramp = -(-(size * FIXED_PROMPT_LEN) // (budget - size)) + 2
    max_tokens = steps + ramp + 2
    blocks_per_seq = -(-(FIXED_PROMPT_LEN + max_tokens) // BLOCK_SIZE)
    s = new_scheduler(size, 1 + size * blocks_per_seq)
    for r in range(size):
        s.add_request(r, prompt(r, FIXED_PROMPT_LEN), max_tokens, ignore_eos=True)
    while True:  # prefill, untimed
        out = s.schedule()
        s.update(out, np.full(out.num_rows, SAMPLED_TOKEN, np.int32))
        if out.num_prefill_tokens == 0 and s.num_waiting == 0:
            break
    for r in range(size, total_requests):
        s.add_request(r, prompt(r, FIXED_PROMPT_LEN), max_tokens, ignore_eos=True)
    return StepTimer(s)


def run_fixed(configs: list[tuple[int, int]], steps: int, chunk: int = 25) -> list[dict]:
    """Times `steps` decode steps of each (size, total_requests) batch. The batches advance
    round-robin, `chunk` steps at a time, so that load from other processes hits them alike
    (what matters when comparing queue sizes on a shared machine)."""
    timers = [setup_fixed(size, total, steps) for size, total in configs]
    for lo in range(0, steps, chunk):
        for (size, _), timer in zip(configs, timers):
            for _ in range(min(chunk, steps - lo)):
                out = timer.step()
                assert out.num_seqs == size and out.num_prefill_tokens == 0
    results = []
    for (size, total), timer in zip(configs, timers):
        assert timer.s.num_waiting == total - size
        results.append(
            {
                "kind": "fixed_decode",
                "impl": "python",
                "label": f"S={size} q={total - size}",
                "size": size,
                "requests": total,
                "queued": total - size,
                "decode": summarize(timer.times, timer.seqs, timer.widths),
            }
        )
    return results


def _f(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_tables(results: list[dict]) -> None:
    work = [r for r in results if r["kind"] == "workload"]
    if work:
        hdr = (
            f"{'workload':<16} {'reqs':>6} {'steps':>5} | {'all: mean':>9} {'p50':>6} {'p99':>7} {'us/seq':>6} {'seqs':>5} {'M':>4}"
            f" | {'decode steady: n':>16} {'mean':>6} {'p50':>6} {'p99':>7} {'us/seq':>6} {'seqs':>5} {'M':>4}"
            f" | {'preempt':>7} {'maxrun':>6} {'prefill computed/min':>20} {'waste':>5}"
        )
        print(hdr)
        print("-" * len(hdr))
        for r in work:
            a, d = r["all"], r["decode_steady"]
            print(
                f"{r['label']:<16} {r['requests']:>6} {r['steps']:>5}"
                f" | {_f(a['mean_us'], '9.1f')} {_f(a['p50_us'], '6.1f')} {_f(a['p99_us'], '7.1f')}"
                f" {_f(a['us_per_seq_step'], '6.3f')} {_f(a['mean_seqs'], '5.0f')} {_f(a['mean_width'], '4.0f')}"
                f" | {d['steps']:>16} {_f(d['mean_us'], '6.1f')} {_f(d['p50_us'], '6.1f')} {_f(d['p99_us'], '7.1f')}"
                f" {_f(d['us_per_seq_step'], '6.3f')} {_f(d['mean_seqs'], '5.0f')} {_f(d['mean_width'], '4.0f')}"
                f" | {r['preemptions']:>7} {r['max_running_seqs']:>6}"
                f" {str(r['prefill_computed']) + '/' + str(r['prefill_min']):>20} {_f(r['waste_ratio'], '5.3f')}"
            )
        print("checksums (sum prompt, sum output): " + ", ".join(f"{r['label']}={r['checksum']}" for r in work))
    fixed = [r for r in results if r["kind"] == "fixed_decode"]
    if fixed:
        print()
        hdr = f"{'fixed decode batch':<18} {'reqs':>6} {'steps':>5} | {'mean':>7} {'p50':>7} {'p99':>7} {'us/seq':>6} {'M':>4}"
        print(hdr)
        print("-" * len(hdr))
        for r in fixed:
            d = r["decode"]
            print(
                f"{r['label']:<18} {r['requests']:>6} {d['steps']:>5} | {d['mean_us']:>7.1f} {d['p50_us']:>7.1f}"
                f" {d['p99_us']:>7.1f} {d['us_per_seq_step']:>6.3f} {d['mean_width']:>4.0f}"
            )
    print(
        "µs per step of schedule() + array access + update() (Python boundary included); us/seq: µs per "
        "sequence-step; seqs: mean sequences per step; M: mean block-table width"
    )


def workload_configs(sizes: list[int], requests: int | None, quick: bool) -> list[Config]:
    def count(size: int) -> int:
        n = requests or DEFAULT_REQUESTS.get(size, min(16000, max(1000, 4 * size)))
        return max(size + size // 2, n // 8) if quick else n

    out = [Config(f"S={size}", size, count(size), ROOMY_BLOCKS_PER_SEQ) for size in sizes]
    if 1024 in sizes:
        out.append(Config("S=1024 x4 reqs", 1024, count(1024) * 4, ROOMY_BLOCKS_PER_SEQ))
    tight = 256 if 256 in sizes else min(sizes)
    out.append(Config(f"S={tight} tight KV", tight, count(tight), TIGHT_BLOCKS_PER_SEQ))
    return out


def fixed_configs(sizes: list[int], queued: bool = True) -> list[tuple[int, int]]:
    out = [(size, size) for size in sizes]
    if queued and 1024 in sizes:
        out += [(1024, total) for total in FIXED_QUEUE_TOTALS]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="64,256,1024,4096", help="comma-separated max_num_seqs values")
    ap.add_argument("--requests", type=int, default=None, help="workload requests per configuration (default: by size)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fixed-steps", type=int, default=None, help="timed steps of the fixed decode batch (default 500)")
    ap.add_argument("--quick", action="store_true", help="1/8 of the requests, 100 fixed steps: a smoke run")
    ap.add_argument("--json", action="store_true", help="one JSON line per configuration instead of the tables")
    ap.add_argument("--only-fixed", action="store_true",
                    help="experiment 2 only, without the queued batches: one line per size (what compare_builds.py reads)")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",") if x]
    fixed_steps = args.fixed_steps or (100 if args.quick else 500)
    results = []

    def report(r: dict) -> None:
        results.append(r)
        if args.json:
            print(json.dumps(r), flush=True)

    for cfg in [] if args.only_fixed else workload_configs(sizes, args.requests, args.quick):
        r = run_workload(cfg, args.seed)
        if not args.json:
            print(f"  {cfg.label}: {r['steps']} steps in {r['wall_s']:.1f} s", file=sys.stderr, flush=True)
        report(r)
    for r in run_fixed(fixed_configs(sizes, queued=not args.only_fixed), fixed_steps):
        report(r)
    if not args.json:
        print_tables(results)


if __name__ == "__main__":
    main()
