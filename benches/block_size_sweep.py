#!/usr/bin/env python
"""Block-size sweep on the utilization trace: internal waste vs block-table size.

Same KV memory (16,384 token slots), trace and step model as ``kv_utilization.py``; the real
core is run with block sizes 8, 16, 32, 64, 128 and 256 (``num_blocks = 16384 / B + 1``,
max_num_seqs 1024, watermark 1 %, prefix caching off). For each block size, over the
saturated window (from the first step at which every run has a queue, common to all runs):
waste = 1 - U_eff (allocated token slots holding no KV: the unfilled tail of each sequence's
last block), mean / max concurrent sequences, requests completed within the steps, recompute
preemptions, and the block-table entries per sequence (time-averaged ``num_block_refs`` per
running sequence; the maximum is ceil(max_model_len / B)). The contiguous allocator
(``max_model_len`` reservation) is the reference row: in effect one block of 2048 slots.

The per-step scheduler cost of the block sizes is measured elsewhere (not here).

Writes ``benches/results/block_size_sweep.json`` and ``block_size_sweep.png``.
Usage: ``python benches/block_size_sweep.py [--quick] [--seed 0] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
import kv_utilization as kvu  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
BLOCK_SIZES = (8, 16, 32, 64, 128, 256)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"{kvu.QUICK_STEPS} steps instead of {kvu.STEPS}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--rate", type=float, default=kvu.RATE)
    ap.add_argument("--block-sizes", default=",".join(map(str, BLOCK_SIZES)))
    ap.add_argument("--json", action="store_true", help="one JSON line per block size")
    ap.add_argument("--out", default=str(RESULTS / "block_size_sweep.json"))
    args = ap.parse_args()
    steps = args.steps or (kvu.QUICK_STEPS if args.quick else kvu.STEPS)
    sizes = [int(b) for b in args.block_sizes.split(",")]
    t0 = time.perf_counter()

    trace = kvu.make_trace(steps, args.rate, args.seed)
    runs = {f"B={b}": kvu.run_paged(trace, steps, block_size=b) for b in sizes}
    runs["contiguous"] = kvu.run_contiguous(trace, steps)
    start = kvu.saturation_start(runs)
    rows = []
    for name, run in runs.items():
        s = kvu.summarize(run, start)
        b = run.get("block_size", kvu.MAX_MODEL_LEN)
        rows.append({
            "config": name, "block_size": b, "num_blocks": run.get("num_blocks", kvu.CAPACITY_SLOTS // b),
            "watermark_blocks": run.get("watermark_blocks", 0),
            "waste": s["waste"], "U_eff": s["U_eff"], "used_over_capacity": s["used_over_capacity"],
            "mean_concurrency": s["mean_concurrency"], "max_concurrency": s["max_concurrency"],
            "completed": s["completed"], "preemptions": s.get("preemptions", 0),
            "recomputed_prefill_tokens": s.get("recomputed_prefill_tokens", 0),
            "mean_table_entries_per_seq": s.get("mean_table_entries_per_seq", 1.0),
            "max_table_entries_per_seq": math.ceil(kvu.MAX_MODEL_LEN / b),
        })
    info = {"steps": steps, "requests": len(trace), "rate_per_step": args.rate, "window": [start, steps],
            "capacity_slots": kvu.CAPACITY_SLOTS, "max_model_len": kvu.MAX_MODEL_LEN}

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paged = [r for r in rows if r["config"] != "contiguous"]
    contig = next(r for r in rows if r["config"] == "contiguous")
    bs = [r["block_size"] for r in paged]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    ax = axes[0]
    ax.plot(bs, [100 * r["waste"] for r in paged], "o-", label="paged (real core)")
    ax.axhline(100 * contig["waste"], color="tab:red", ls="--", label=f"contiguous ({contig['waste']:.0%})")
    ax.axhline(4, color="0.5", ls=":", label="4 % target")
    for r in paged:
        ax.annotate(f"{r['waste']:.1%}", (r["block_size"], 100 * r["waste"]), textcoords="offset points",
                    xytext=(0, 6), ha="center", fontsize=8)
    ax.set(xscale="log", xlabel="block size B (tokens)", ylabel="waste = 1 - U_eff (%)", title="Internal waste",
           yscale="log")
    ax.set_xticks(bs, [str(b) for b in bs])
    ax.legend(fontsize=8)
    ax = axes[1]
    ax.plot(bs, [r["mean_concurrency"] for r in paged], "o-", label="paged mean")
    ax.plot(bs, [r["max_concurrency"] for r in paged], "s--", label="paged max")
    ax.axhline(contig["mean_concurrency"], color="tab:red", ls="--", label="contiguous")
    ax.set(xscale="log", xlabel="block size B (tokens)", ylabel="running sequences",
           title="Concurrency in the same KV memory", ylim=(0, None))
    ax.set_xticks(bs, [str(b) for b in bs])
    ax.legend(fontsize=8)
    ax = axes[2]
    ax.plot(bs, [r["mean_table_entries_per_seq"] for r in paged], "o-", label="mean per running sequence")
    ax.plot(bs, [r["max_table_entries_per_seq"] for r in paged], "s--", label="max (max_model_len / B)")
    ax.set(xscale="log", yscale="log", xlabel="block size B (tokens)", ylabel="block-table entries",
           title="Block-table size per sequence")
    ax.set_xticks(bs, [str(b) for b in bs])
    ax.legend(fontsize=8)
    fig.suptitle(f"Block-size sweep: {kvu.CAPACITY_SLOTS} token slots, {len(trace)} requests, steps {start}..{steps}")
    fig.tight_layout()
    png = Path(args.out).with_suffix(".png")
    RESULTS.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    elapsed = time.perf_counter() - t0
    Path(args.out).write_text(json.dumps({"args": vars(args), "info": info, "rows": rows, "elapsed_s": elapsed}, indent=1))

    if args.json:
        for r in rows:
            print(json.dumps({"result": "block_size", **info, **r}))
        return
    print(f"block-size sweep: {len(trace)} requests, {steps} steps, window {start}..{steps}, "
          f"{kvu.CAPACITY_SLOTS} token slots")
    print(f"{'config':<12}{'blocks':>7}{'waste':>8}{'mean seq':>9}{'max seq':>8}{'done':>6}{'preempt':>8}"
          f"{'table/seq':>10}{'max table':>10}")
    for r in rows:
        print(f"{r['config']:<12}{r['num_blocks']:>7}{r['waste']:>8.2%}{r['mean_concurrency']:>9.1f}{r['max_concurrency']:>8d}"
              f"{r['completed']:>6d}{r['preemptions']:>8d}{r['mean_table_entries_per_seq']:>10.1f}{r['max_table_entries_per_seq']:>10d}")
    print(f"wrote {args.out} and {png} in {elapsed:.1f}s")


if __name__ == "__main__":
    main()
