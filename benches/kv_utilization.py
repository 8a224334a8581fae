#!/usr/bin/env python
"""KV-cache utilization: the REAL ferrokv core (paged, block size 16) against a contiguous
reference allocator, on the same KV memory, the same trace and the same step model.

Setup (defaults): KV memory of 16,384 token slots (1,024 blocks of 16; for Llama-7B that is
8 GiB of KV), max_model_len 2048, a ShareGPT-like trace (lognormal prompt / output lengths with
means 160 / 340 before clipping, sigma 1.0, each clipped to [4, 1024]; fixed seed) with
Poisson arrivals (0.3 requests per step, about twice what the paged side serves, so memory is
the limit) over a fixed number of steps. A step is one forward pass: each running sequence computes
one token (a newly admitted one its whole prompt; the core gets a token budget that never
chunks). Quantities are read right after ``schedule()``, i.e. during the step's forward pass.

* Paged: ``ferrokv._core.Scheduler(num_blocks=16384/16 + 1, block_size=16,
  max_num_seqs=1024, prefix caching off, recompute preemption, watermark 1%)``; a stand-in
  model returns token 7 for every logits row; ``ignore_eos=True`` and ``max_tokens`` = the
  output length. allocated = ``num_used_blocks * B``, used = ``num_used_token_slots``.
* Contiguous (``contiguous_allocator.py``): one contiguous range of ``max_model_len`` slots per
  request, first-fit, coalescing, FCFS with head-of-line blocking. Also reported: the "exact"
  oracle variant that reserves ``prompt + output`` slots (knows the output length in advance).

Reported per side: U_eff = sum_t used / sum_t allocated (time-averaged), eta = 1 - used /
reserved (the seeds' fragmentation; reserved = allocated on both sides, so eta = 1 - U_eff),
used / total KV memory, mean / max concurrent sequences, requests completed within the steps,
preemptions (paged), external fragmentation (contiguous: free memory stranded while the head
of the queue is blocked, and the steps where the free total would have fit it).

Sharing (real core, prefix caching off; the first 32 requests of the trace, 8 with --quick,
all started at once in a cache big enough for all of them): parallel sampling ``n = 2, 4, 6``
(the prompt's blocks shared copy-on-write) and beam search of width 2, 4, 6 emulated with
``fork_sequence`` / ``drop_sequence``: after every step each of the ``width`` new beams picks
a uniformly random parent among the current beams ("random parents"; parents nobody picked are
dropped, a parent picked c times is forked c - 1 times), or keeps its own lineage with
probability 0.9 ("sticky"). Each is compared with ``k`` independent n=1 requests with the same
prompt and output lengths. Saving = 1 - block-steps with sharing / block-steps without (i.e.
of the time-averaged blocks); the saving of the peak block count is reported too. Random
parents coalesce within a few steps, so the beam rows are the optimistic end; the parallel
sampling rows (only the prompt is shared) are the pessimistic end.

Paged admission watermark sensitivity: the paged run repeated with watermarks 0, 5 % and 10 %
(the core admits a request when its prompt fits in the free blocks minus the watermark, and
preempts the latest arrival for recompute when running sequences outgrow the memory).

Also prints the seeds' M_KV sanity check for Llama-7B (32 layers, 32 heads, head_dim 128, 2048
tokens, fp16) and the targets: paged waste (1 - U_eff) < 4 %, paged mean concurrency >= 3x the
contiguous baseline's.

Writes ``benches/results/kv_utilization.json`` and ``kv_utilization.png`` (timeline + bars).
Usage: ``python benches/kv_utilization.py [--quick] [--seed 0] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from contiguous_allocator import ContiguousServer  # noqa: E402

from ferrokv._core import Scheduler  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"

CAPACITY_SLOTS = 16_384
BLOCK_SIZE = 16
MAX_MODEL_LEN = 2048
MAX_NUM_SEQS = 1024
RATE = 0.3  # Poisson arrivals per step (about 2x what the paged side serves)
STEPS = 4000
QUICK_STEPS = 1500
PROMPT_MEAN, OUTPUT_MEAN, SIGMA = 160.0, 340.0, 1.0
LEN_MIN, LEN_MAX = 4, 1024
SAMPLE_TOKEN = 7
WATERMARKS = (0.0, 0.01, 0.05, 0.1)  # paged admission watermark sensitivity (0.01 = the main run)
BEAM_KEEP = 0.9  # the "sticky" beam variant: a beam keeps its own lineage with this probability


@dataclass(frozen=True)
class TraceReq:
    req_id: int
    arrival: int  # step at which it is queued (before that step's schedule)
    prompt_len: int
    output_len: int


def lognormal_lengths(rng: np.random.Generator, mean: float, sigma: float, size: int) -> np.ndarray:
    mu = math.log(mean) - sigma * sigma / 2  # so that E[X] = mean before clipping
    return np.clip(np.rint(rng.lognormal(mu, sigma, size)), LEN_MIN, LEN_MAX).astype(np.int64)


def make_trace(num_steps: int, rate: float = RATE, seed: int = 0) -> list[TraceReq]:
    """Poisson arrivals over ``num_steps`` steps with ShareGPT-like lengths (fixed seed).

    Arrivals, prompt lengths and output lengths come from three separate streams, so the trace
    of fewer steps is a prefix of the trace of more steps (same seed and rate).
    """
    arrivals = np.repeat(np.arange(num_steps), np.random.default_rng([seed, 0]).poisson(rate, num_steps))
    n = len(arrivals)
    prompts = lognormal_lengths(np.random.default_rng([seed, 1]), PROMPT_MEAN, SIGMA, n)
    outputs = lognormal_lengths(np.random.default_rng([seed, 2]), OUTPUT_MEAN, SIGMA, n)
    return [TraceReq(i, int(a), int(p), int(o)) for i, (a, p, o) in enumerate(zip(arrivals, prompts, outputs))]


def prompt_ids(req_id: int, length: int) -> np.ndarray:
    """Distinct tokens per request (no shared prefixes)."""
    return (np.arange(length, dtype=np.int64) + req_id * 4096) % (1 << 31)


# --------------------------------------------------------------------------- paged (real core)


def run_paged(trace: list[TraceReq], num_steps: int, block_size: int = BLOCK_SIZE, capacity: int = CAPACITY_SLOTS,
              max_model_len: int = MAX_MODEL_LEN, max_num_seqs: int = MAX_NUM_SEQS, watermark: float = 0.01,
              record=None) -> dict:
    """Drives the real scheduler for ``num_steps`` steps; per-step series plus the core's stats.

    ``record(step, scheduler, output, live_request_ids)`` is called right after each ``schedule()``.
    """
    sched = Scheduler(num_blocks=capacity // block_size + 1, block_size=block_size, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=capacity, max_model_len=max_model_len,
                      enable_prefix_caching=False, preemption_mode="recompute", watermark=watermark)
    keys = ("allocated", "used", "running", "waiting", "table_entries")
    series = {k: np.zeros(num_steps, dtype=np.int64) for k in keys}
    live: set[int] = set()
    seen: set[int] = set()
    prompt_len = {r.req_id: r.prompt_len for r in trace}
    first_prefill = 0  # prompt tokens of first admissions: the prefill work without preemption
    completed = 0
    nxt = 0
    for t in range(num_steps):
        while nxt < len(trace) and trace[nxt].arrival <= t:
            r = trace[nxt]
            sched.add_request(r.req_id, prompt_ids(r.req_id, r.prompt_len), r.output_len, ignore_eos=True)
            live.add(r.req_id)
            nxt += 1
        out = sched.schedule()
        for rid in out.req_ids.tolist():
            if rid not in seen:
                seen.add(rid)
                first_prefill += prompt_len[rid]
        st = sched.stats()
        series["allocated"][t] = st["num_used_blocks"] * block_size
        series["used"][t] = st["num_used_token_slots"]
        series["running"][t] = st["num_running_seqs"]
        series["waiting"][t] = st["num_waiting"]
        series["table_entries"][t] = st["num_block_refs"]
        if record is not None:
            record(t, sched, out, live)
        for f in sched.update(out, np.full(out.num_rows, SAMPLE_TOKEN, dtype=np.int64)):
            if f.request_finished:
                live.discard(f.request_id)
                completed += f.reason == "length"
    sched.check_invariants()
    st = sched.stats()
    recomputed = st["prompt_tokens_computed"] + st["output_tokens_recomputed"] - first_prefill
    return {"series": series, "completed": completed, "preemptions": st["preemptions"], "recomputed_tokens": recomputed,
            "first_prefill_tokens": first_prefill,
            "max_running_seqs_core": st["max_running_seqs"], "arrived": nxt, "block_size": block_size,
            "num_blocks": capacity // block_size + 1, "watermark_blocks": int((capacity // block_size) * watermark)}


# --------------------------------------------------------------------------- contiguous baseline


def run_contiguous(trace: list[TraceReq], num_steps: int, capacity: int = CAPACITY_SLOTS,
                   max_model_len: int = MAX_MODEL_LEN, reserve: str = "max_model_len", record=None) -> dict:
    srv = ContiguousServer(capacity, max_model_len, reserve)
    keys = ("allocated", "used", "running", "waiting", "stranded", "frag_blocked", "largest_free")
    series = {k: np.zeros(num_steps, dtype=np.int64) for k in keys}
    nxt = 0
    for t in range(num_steps):
        while nxt < len(trace) and trace[nxt].arrival <= t:
            r = trace[nxt]
            srv.add_request(r.req_id, r.prompt_len, r.output_len)
            nxt += 1
        s = srv.step(observe=None if record is None else (lambda srv, t=t: record(t, srv)))
        series["allocated"][t] = s.reserved
        series["used"][t] = s.used
        series["running"][t] = s.running
        series["waiting"][t] = s.waiting
        series["stranded"][t] = s.stranded
        series["frag_blocked"][t] = s.frag_blocked
        series["largest_free"][t] = s.largest_free
    srv.alloc.check()
    return {"series": series, "completed": srv.completed, "arrived": nxt, "reserve": reserve}


# --------------------------------------------------------------------------- metrics


def saturation_start(runs: dict) -> int:
    """First step from which every side has had a non-empty queue: memory, not load, limits."""
    start = 0
    for run in runs.values():
        w = np.flatnonzero(run["series"]["waiting"] > 0)
        start = max(start, int(w[0]) if len(w) else len(run["series"]["waiting"]))
    return start


def summarize(run: dict, start: int = 0, capacity: int = CAPACITY_SLOTS) -> dict:
    """Metrics over steps ``[start, end)`` (``completed`` / ``arrived`` are over the whole run)."""
    s = {k: v[start:] for k, v in run["series"].items()}
    alloc, used, running = s["allocated"].sum(), s["used"].sum(), s["running"]
    steps = len(running)
    u_eff = float(used / alloc) if alloc else float("nan")
    busy = s["allocated"] > 0
    out = {
        "window": [start, start + steps],
        "U_eff": u_eff,
        "waste": 1 - u_eff,
        # eta = 1 - sum S_i / sum S_i^max with S_i^max = the slots reserved for request i
        # (paged: its blocks; contiguous: its range). Reserved == allocated on both sides.
        "eta": 1 - u_eff,
        "U_eff_mean_of_steps": float(np.mean(s["used"][busy] / s["allocated"][busy])) if busy.any() else float("nan"),
        "used_over_capacity": float(used / (capacity * steps)),
        "allocated_over_capacity": float(alloc / (capacity * steps)),
        "mean_concurrency": float(running.mean()),
        "max_concurrency": int(running.max()),
        "mean_waiting": float(s["waiting"].mean()),
        "completed": int(run["completed"]),
        "arrived": int(run["arrived"]),
    }
    if "stranded" in s:
        out["external_frag_over_capacity"] = float(s["stranded"].sum() / (capacity * steps))
        out["steps_blocked_by_fragmentation"] = int(s["frag_blocked"].sum())
        blocked = s["stranded"] > 0
        out["mean_stranded_slots_when_blocked"] = float(s["stranded"][blocked].mean()) if blocked.any() else 0.0
    if "table_entries" in s:
        out["preemptions"] = int(run["preemptions"])
        out["recomputed_prefill_tokens"] = int(run["recomputed_tokens"])
        out["first_prefill_tokens"] = int(run["first_prefill_tokens"])
        seq_steps = running.sum()
        out["mean_table_entries_per_seq"] = float(s["table_entries"].sum() / seq_steps) if seq_steps else 0.0
        out["max_table_entries_per_seq"] = math.ceil(MAX_MODEL_LEN / run["block_size"])
    return out


# --------------------------------------------------------------------------- sharing


def _drive(sched: Scheduler, on_update=None, max_steps: int = 100_000) -> tuple[int, int, list[int], list[int]]:
    """Steps until nothing is left; returns (block-steps, peak blocks, used series, refs series)."""
    used_series, refs_series = [], []
    rng_tok = np.random.default_rng(1)
    for _ in range(max_steps):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        st = sched.stats()
        used_series.append(st["num_used_blocks"])
        refs_series.append(st["num_block_refs"])
        # distinct tokens per row, like real samples (irrelevant to memory, but realistic)
        finished = sched.update(out, rng_tok.integers(100, 30_000, out.num_rows))
        if on_update is not None:
            on_update(finished)
    else:
        raise RuntimeError("sharing run did not finish")
    sched.check_invariants()
    return int(sum(used_series)), int(max(used_series)), used_series, refs_series


def _big_scheduler(reqs: list[TraceReq], k: int) -> Scheduler:
    need = sum(k * math.ceil((r.prompt_len + r.output_len) / BLOCK_SIZE) + 1 for r in reqs)
    return Scheduler(num_blocks=need + 1, block_size=BLOCK_SIZE, max_num_seqs=MAX_NUM_SEQS,
                     max_num_batched_tokens=1 << 20, max_model_len=MAX_MODEL_LEN,
                     enable_prefix_caching=False, watermark=0.0)


def independent_blocks(reqs: list[TraceReq], k: int) -> tuple[int, int]:
    """k independent n=1 copies of every request (no sharing at all)."""
    sched = _big_scheduler(reqs, k)
    for r in reqs:
        for j in range(k):
            rid = r.req_id * 16 + j
            sched.add_request(rid, prompt_ids(rid, r.prompt_len), r.output_len, ignore_eos=True)
    total, peak, _, _ = _drive(sched)
    return total, peak


def parallel_sampling_blocks(reqs: list[TraceReq], n: int) -> tuple[int, int, float]:
    sched = _big_scheduler(reqs, n)
    for r in reqs:
        sched.add_request(r.req_id, prompt_ids(r.req_id, r.prompt_len), r.output_len, n=n, ignore_eos=True)
    total, peak, used, refs = _drive(sched)
    return total, peak, float(sum(refs) / sum(used))


def beam_search_blocks(reqs: list[TraceReq], width: int, seed: int, keep: float = 0.0) -> tuple[int, int, float]:
    """Beams emulated with fork/drop: after each step, each of the ``width`` new beams continues
    beam ``i`` (its own slot) with probability ``keep``, else a uniformly random current beam."""
    rng = np.random.default_rng(seed)
    sched = _big_scheduler(reqs, width)
    for r in reqs:
        sched.add_request(r.req_id, prompt_ids(r.req_id, r.prompt_len), r.output_len, ignore_eos=True)
    live = {r.req_id for r in reqs}

    def reselect(finished) -> None:
        for f in finished:
            if f.request_finished:
                live.discard(f.request_id)
        for rid in sorted(live):
            beams = sched.request_seq_ids(rid)
            if not sched.seq_block_table(beams[0]):
                continue  # not admitted yet
            parents = rng.integers(0, len(beams), width)
            if keep > 0:
                own = np.arange(width)
                stay = (rng.random(width) < keep) & (own < len(beams))
                parents[stay] = own[stay]
            counts = np.bincount(parents, minlength=len(beams))
            for b, c in zip(beams, counts):
                if c == 0:
                    sched.drop_sequence(b)
            for b, c in zip(beams, counts):
                for _ in range(int(c) - 1):
                    sched.fork_sequence(b)

    total, peak, used, refs = _drive(sched, reselect)
    return total, peak, float(sum(refs) / sum(used))


def sharing_experiment(trace: list[TraceReq], num_reqs: int, seed: int) -> list[dict]:
    reqs = trace[:num_reqs]
    rows = []
    for k in (2, 4, 6):
        ind_total, ind_peak = independent_blocks(reqs, k)
        for kind, fn in (("parallel_sampling", lambda: parallel_sampling_blocks(reqs, k)),
                         ("beam_search", lambda: beam_search_blocks(reqs, k, seed)),
                         ("beam_search_sticky", lambda: beam_search_blocks(reqs, k, seed, keep=BEAM_KEEP))):
            tot, peak, refs_ratio = fn()
            rows.append({
                "kind": kind, "k": k, "requests": len(reqs),
                "block_steps_shared": tot, "block_steps_independent": ind_total,
                "saving": 1 - tot / ind_total,
                "peak_blocks_shared": peak, "peak_blocks_independent": ind_peak,
                "peak_saving": 1 - peak / ind_peak,
                "mean_refs_per_used_block": refs_ratio,
            })
    return rows


# --------------------------------------------------------------------------- report


def mkv_sanity() -> dict:
    import torch

    from ferrokv.kv_cache import kv_bytes_per_block, kv_bytes_per_sequence

    seq = kv_bytes_per_sequence(32, 32, 128, 2048, torch.float16)
    blk = kv_bytes_per_block(32, 32, 128, BLOCK_SIZE, torch.float16)
    assert seq == 2 * 32 * 32 * 128 * 2048 * 2
    return {"llama7b_2048_fp16_bytes": seq, "llama7b_2048_fp16_GiB": seq / 2**30,
            "llama7b_block16_bytes": blk, "budget_GiB_llama7b": CAPACITY_SLOTS * seq / 2048 / 2**30}


def plot(runs: dict, summaries: dict, sharing: list[dict], path: Path, start: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    ax = axes[0, 0]
    colors = {"paged": "tab:blue", "contiguous": "tab:red", "contiguous_exact": "tab:orange"}
    for name, run in runs.items():
        s = run["series"]
        ax.plot(s["allocated"] / CAPACITY_SLOTS, color=colors[name], lw=1, label=f"{name} allocated")
        ax.plot(s["used"] / CAPACITY_SLOTS, color=colors[name], lw=1, ls="--", label=f"{name} used")
    ax.axvspan(0, start, color="0.9", zorder=0, label="warm-up (excluded)")
    ax.set(xlabel="step", ylabel="fraction of KV memory", title="Allocated vs used KV slots", ylim=(0, 1.05))
    ax.legend(fontsize=7, loc="lower right")
    ax = axes[0, 1]
    for name, run in runs.items():
        ax.plot(run["series"]["running"], color=colors[name], lw=1, label=name)
    ax.axvspan(0, start, color="0.9", zorder=0)
    ax.set(xlabel="step", ylabel="running sequences", title="Concurrency")
    ax.legend(fontsize=8)
    ax = axes[1, 0]
    names = list(summaries)
    x = np.arange(len(names))
    ax.bar(x - 0.2, [summaries[n]["U_eff"] for n in names], 0.4, label="U_eff = used / allocated")
    ax.bar(x + 0.2, [summaries[n]["used_over_capacity"] for n in names], 0.4, label="used / total KV memory")
    for i, n in enumerate(names):
        ax.text(i - 0.2, summaries[n]["U_eff"] + 0.01, f"{summaries[n]['U_eff']:.1%}", ha="center", fontsize=8)
        ax.text(i + 0.2, summaries[n]["used_over_capacity"] + 0.01, f"{summaries[n]['used_over_capacity']:.1%}",
                ha="center", fontsize=8)
    ax.set_xticks(x, names)
    ax.set(ylim=(0, 1.1), title=f"Time-averaged utilization (steps {start}..{len(runs['paged']['series']['used'])})")
    ax.legend(fontsize=8)
    ax = axes[1, 1]
    ks = sorted({r["k"] for r in sharing})
    labels = {"parallel_sampling": "parallel sampling (n=k)", "beam_search": "beam search, random parents",
              "beam_search_sticky": f"beam search, sticky (keep {BEAM_KEEP})"}
    for off, kind in ((-0.27, "parallel_sampling"), (0.0, "beam_search_sticky"), (0.27, "beam_search")):
        vals = [next(r["saving"] for r in sharing if r["kind"] == kind and r["k"] == k) for k in ks]
        ax.bar(np.arange(len(ks)) + off, vals, 0.27, label=labels[kind])
        for i, v in enumerate(vals):
            ax.text(i + off, v + 0.01, f"{v:.0%}", ha="center", fontsize=8)
    ax.set_xticks(np.arange(len(ks)), [f"k={k}" for k in ks])
    ax.set(ylim=(0, 1), ylabel="KV memory saved vs k independent copies", title="Copy-on-write sharing (block-steps)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS} steps instead of {STEPS}, 8 sharing requests instead of 32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--rate", type=float, default=RATE, help="Poisson arrivals per step")
    ap.add_argument("--json", action="store_true", help="one JSON line per result instead of tables")
    ap.add_argument("--out", default=str(RESULTS / "kv_utilization.json"))
    args = ap.parse_args()
    steps = args.steps or (QUICK_STEPS if args.quick else STEPS)
    t0 = time.perf_counter()

    trace = make_trace(steps, args.rate, args.seed)
    runs = {
        "paged": run_paged(trace, steps),
        "contiguous": run_contiguous(trace, steps),
        "contiguous_exact": run_contiguous(trace, steps, reserve="exact"),
    }
    start = saturation_start(runs)
    summaries = {name: summarize(run, start) for name, run in runs.items()}
    whole = {name: summarize(run, 0) for name, run in runs.items()}
    watermarks = []
    for wm in WATERMARKS:
        ws = summarize(runs["paged"] if wm == 0.01 else run_paged(trace, steps, watermark=wm), start)
        watermarks.append({"watermark": wm, **{k: ws[k] for k in (
            "waste", "mean_concurrency", "max_concurrency", "completed", "preemptions", "recomputed_prefill_tokens",
            "first_prefill_tokens", "used_over_capacity")}})
    sharing = sharing_experiment(trace, 8 if args.quick else 32, args.seed)
    mkv = mkv_sanity()
    p, c = summaries["paged"], summaries["contiguous"]
    ratio = p["mean_concurrency"] / c["mean_concurrency"]
    targets = {
        "paged_waste_below_4pct": {"value": p["waste"], "target": 0.04, "pass": p["waste"] < 0.04},
        "concurrency_ratio_at_least_3x": {"value": ratio, "target": 3.0, "pass": ratio >= 3.0},
    }
    trace_info = {
        "requests": len(trace), "steps": steps, "rate_per_step": args.rate,
        "mean_prompt": float(np.mean([r.prompt_len for r in trace])),
        "mean_output": float(np.mean([r.output_len for r in trace])),
        "capacity_slots": CAPACITY_SLOTS, "block_size": BLOCK_SIZE, "max_model_len": MAX_MODEL_LEN,
        "max_num_seqs": MAX_NUM_SEQS, "watermark_blocks": runs["paged"]["watermark_blocks"],
    }
    result = {"args": vars(args), "trace": trace_info, "summary": summaries, "summary_all_steps": whole,
              "concurrency_ratio": ratio,
              "concurrency_ratio_all_steps": whole["paged"]["mean_concurrency"] / whole["contiguous"]["mean_concurrency"],
              "sharing": sharing, "watermark_sensitivity": watermarks, "mkv": mkv, "targets": targets}
    RESULTS.mkdir(parents=True, exist_ok=True)
    png = Path(args.out).with_suffix(".png")
    plot(runs, summaries, sharing, png, start)
    elapsed = result["elapsed_s"] = time.perf_counter() - t0
    Path(args.out).write_text(json.dumps(result, indent=1))

    if args.json:
        print(json.dumps({"result": "trace", **trace_info}))
        for name, s in summaries.items():
            print(json.dumps({"result": "utilization", "side": name, **s}))
        for row in sharing:
            print(json.dumps({"result": "sharing", **row}))
        for row in watermarks:
            print(json.dumps({"result": "paged_watermark", **row}))
        print(json.dumps({"result": "mkv", **mkv}))
        for name, t in targets.items():
            print(json.dumps({"result": "target", "name": name, **t}))
        return

    print(f"trace: {len(trace)} requests over {steps} steps (rate {args.rate}/step), mean prompt "
          f"{trace_info['mean_prompt']:.0f}, mean output {trace_info['mean_output']:.0f}; KV memory "
          f"{CAPACITY_SLOTS} slots ({CAPACITY_SLOTS // BLOCK_SIZE} blocks of {BLOCK_SIZE}), max_model_len {MAX_MODEL_LEN}")
    print(f"M_KV sanity (Llama-7B, 2048 tokens, fp16): {mkv['llama7b_2048_fp16_bytes']:,} bytes = "
          f"{mkv['llama7b_2048_fp16_GiB']:.2f} GiB; one block of 16 = {mkv['llama7b_block16_bytes']:,} bytes; "
          f"the budget = {mkv['budget_GiB_llama7b']:.0f} GiB of Llama-7B KV")
    print(f"window: steps {start}..{steps} (from the first step at which every side has a queue; whole-run numbers in the JSON)")
    hdr = f"{'side':<17}{'U_eff':>7}{'eta':>7}{'used/mem':>9}{'alloc/mem':>10}{'mean seq':>9}{'max seq':>8}{'done':>6}{'preempt':>8}{'ext.frag':>9}"
    print(hdr)
    for name, s in summaries.items():
        ext = f"{s['external_frag_over_capacity']:.1%}" if "external_frag_over_capacity" in s else "-"
        pre = str(s.get("preemptions", "-"))
        print(f"{name:<17}{s['U_eff']:>7.1%}{s['eta']:>7.1%}{s['used_over_capacity']:>9.1%}{s['allocated_over_capacity']:>10.1%}"
              f"{s['mean_concurrency']:>9.1f}{s['max_concurrency']:>8d}{s['completed']:>6d}{pre:>8}{ext:>9}")
    ce = summaries["contiguous_exact"]
    print(f"contiguous_exact: {ce['steps_blocked_by_fragmentation']} steps where the queue head was blocked although "
          f"enough memory was free (mean {ce['mean_stranded_slots_when_blocked']:.0f} slots stranded while blocked)")
    pg = summaries["paged"]
    print(f"paged: {pg['preemptions']} recompute preemptions, {pg['recomputed_prefill_tokens']:,} prefill tokens recomputed "
          f"(+{pg['recomputed_prefill_tokens'] / max(pg['first_prefill_tokens'], 1):.0%} over the first prefills); "
          f"mean block-table entries per sequence {pg['mean_table_entries_per_seq']:.1f}")
    print("paged admission watermark (fraction of blocks admission keeps free) vs recompute preemptions:")
    for w in watermarks:
        print(f"  watermark {w['watermark']:<5} waste {w['waste']:.2%}  mean seqs {w['mean_concurrency']:5.1f}  "
              f"done {w['completed']}  preemptions {w['preemptions']:4d}  recomputed prefill "
              f"{w['recomputed_prefill_tokens'] / max(w['first_prefill_tokens'], 1):.0%} of the first prefill")
    print(f"concurrency ratio paged / contiguous: {ratio:.2f}x (whole run incl. warm-up: "
          f"{result['concurrency_ratio_all_steps']:.2f}x)")
    print(f"{'sharing':<20}{'k':>3}{'saving':>8}{'peak saving':>12}{'refs/block':>11}")
    for r in sharing:
        print(f"{r['kind']:<20}{r['k']:>3}{r['saving']:>8.1%}{r['peak_saving']:>12.1%}{r['mean_refs_per_used_block']:>11.2f}")
    for name, t in targets.items():
        print(f"{'PASS' if t['pass'] else 'FAIL'}: {name} (value {t['value']:.4g}, target {t['target']})")
    print(f"wrote {args.out} and {png} in {elapsed:.1f}s")


if __name__ == "__main__":
    main()
