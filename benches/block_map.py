#!/usr/bin/env python
"""Block map: which request owns which piece of the KV memory, step by step, paged beside
contiguous, drawn from the real allocator states.

Same setup and trace as ``kv_utilization.py`` (16,384 token slots, max_model_len 2048,
ShareGPT-like lengths, Poisson arrivals at 0.3 per step, same seed; the trace of fewer steps
is a prefix of the longer one). Every step, right after ``schedule()``:

* paged (the real core, block size 16): for every live request,
  ``Scheduler.request_seq_ids(rid)`` then ``Scheduler.seq_block_table(seq_id)`` give the
  physical blocks it holds; the fill of each block comes from the step's ``seq_lens``. The
  number of owned blocks is checked against ``stats()['num_used_blocks']`` at every step.
* contiguous (``contiguous_allocator.py``): the ranges of the running requests, for the
  ``max_model_len`` reservation and for the ``exact`` (prompt + output) oracle.

Picture: x = step, y = the KV memory (physical block for paged; the same 16-slot rows of
the contiguous memory), colour = request id, pale = reserved/allocated but not holding KV yet
(the tint strength is the fraction of the 16 slots in use), white = free. A timeline of
allocated vs used slots for the three sides sits below the maps.

Writes ``benches/results/block_map.png`` and ``block_map.json``.
Usage: ``python benches/block_map.py [--quick] [--seed 0] [--json]``.
"""

from __future__ import annotations

import argparse
import colorsys
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kv_utilization as kvu  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
STEPS = 1500
QUICK_STEPS = 600


class MapRecorder:
    """Owner (request id, -1 = free) and fill (used slots, 0..B) of each memory row per step."""

    def __init__(self, rows: int, steps: int, row_slots: int) -> None:
        self.owner = np.full((rows, steps), -1, dtype=np.int32)
        self.fill = np.zeros((rows, steps), dtype=np.int16)
        self.row_slots = row_slots
        self.mismatches = 0

    def paged(self, t: int, sched, out, live: set[int]) -> None:
        bs = sched.block_size
        seq_len = dict(zip(out.seq_ids.tolist(), out.seq_lens.tolist()))
        owned = 0
        for rid in live:
            for sid in sched.request_seq_ids(rid):
                table = sched.seq_block_table(sid)
                if not table:
                    continue  # waiting (or preempted): holds nothing
                n = seq_len[sid]
                for j, b in enumerate(table):
                    self.owner[b - 1, t] = rid  # block 0 is the null block
                    self.fill[b - 1, t] = min(bs, n - j * bs)
                owned += len(table)
        if owned != sched.stats()["num_used_blocks"]:
            self.mismatches += 1

    def contiguous(self, t: int, srv) -> None:
        cap = srv.capacity
        owner = np.full(cap, -1, dtype=np.int32)
        used = np.zeros(cap, dtype=np.int16)
        for start, reserved, n_used, rid in srv.owner_map():
            owner[start:start + reserved] = rid
            used[start:start + n_used] = 1
        rs = self.row_slots
        self.owner[:, t] = owner.reshape(-1, rs).max(axis=1)
        self.fill[:, t] = used.reshape(-1, rs).sum(axis=1)


def colorize(owner: np.ndarray, fill: np.ndarray, row_slots: int) -> np.ndarray:
    """RGB image: hue from the request id (golden-ratio spacing), tint from the fill."""
    ids = np.unique(owner[owner >= 0])
    palette = np.ones((len(ids), 3))
    for i, rid in enumerate(ids):
        palette[i] = colorsys.hsv_to_rgb((rid * 0.6180339887) % 1.0, 0.75, 0.85)
    img = np.ones(owner.shape + (3,))
    mask = owner >= 0
    idx = np.searchsorted(ids, owner[mask])
    alpha = (0.22 + 0.78 * fill[mask] / row_slots)[:, None]
    img[mask] = 1 - alpha * (1 - palette[idx])
    return img


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS} steps instead of {STEPS}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--rate", type=float, default=kvu.RATE)
    ap.add_argument("--json", action="store_true", help="one JSON line per result")
    ap.add_argument("--out", default=str(RESULTS / "block_map.png"))
    args = ap.parse_args()
    steps = args.steps or (QUICK_STEPS if args.quick else STEPS)
    t0 = time.perf_counter()

    bs, cap = kvu.BLOCK_SIZE, kvu.CAPACITY_SLOTS
    rows = cap // bs
    trace = kvu.make_trace(steps, args.rate, args.seed)
    maps = {"paged": MapRecorder(rows, steps, bs), "contiguous": MapRecorder(rows, steps, bs),
            "contiguous_exact": MapRecorder(rows, steps, bs)}
    runs = {
        "paged": kvu.run_paged(trace, steps, record=maps["paged"].paged),
        "contiguous": kvu.run_contiguous(trace, steps, record=maps["contiguous"].contiguous),
        "contiguous_exact": kvu.run_contiguous(trace, steps, reserve="exact", record=maps["contiguous_exact"].contiguous),
    }
    # The map must agree with the allocators' own accounting at every step.
    assert maps["paged"].mismatches == 0, f"{maps['paged'].mismatches} steps where the block tables disagree with stats()"
    for name, m in maps.items():
        assert np.array_equal(m.fill.sum(axis=0), runs[name]["series"]["used"]), name
        if name != "contiguous_exact":  # exact reservations are not 16-slot aligned: rows can be shared
            assert np.array_equal((m.owner >= 0).sum(axis=0) * bs, runs[name]["series"]["allocated"]), name

    start = kvu.saturation_start(runs)
    summaries = {name: kvu.summarize(run, start) for name, run in runs.items()}
    info = {"steps": steps, "requests": len(trace), "rate_per_step": args.rate, "window_start": start,
            "rows": rows, "row_slots": bs,
            "distinct_requests_drawn": {n: int(len(np.unique(m.owner[m.owner >= 0]))) for n, m in maps.items()}}

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = {
        "paged": f"paged (real core): physical block 1..{rows}, block size {bs}",
        "contiguous": "contiguous, reserve max_model_len = 2048 slots per request (first fit)",
        "contiguous_exact": "contiguous, reserve prompt + output exactly (oracle; first fit)",
    }
    fig, axes = plt.subplots(4, 1, figsize=(15, 17), sharex=True, gridspec_kw={"height_ratios": [3, 3, 3, 2]})
    for ax, (name, m) in zip(axes, maps.items()):
        s = summaries[name]
        ax.imshow(colorize(m.owner, m.fill, bs), aspect="auto", interpolation="nearest", origin="lower",
                  extent=(0, steps, 0, cap))
        ax.set_ylabel("KV memory (token slots)")
        ax.set_title(f"{titles[name]} - U_eff {s['U_eff']:.1%}, mean {s['mean_concurrency']:.1f} sequences "
                     f"(steps {start}..{steps})", fontsize=10)
    ax = axes[3]
    colors = {"paged": "tab:blue", "contiguous": "tab:red", "contiguous_exact": "tab:orange"}
    for name, run in runs.items():
        sr = run["series"]
        ax.plot(sr["allocated"] / cap, color=colors[name], lw=1, label=f"{name} allocated")
        ax.plot(sr["used"] / cap, color=colors[name], lw=1, ls="--", label=f"{name} used")
    ax.axvspan(0, start, color="0.9", zorder=0, label="warm-up")
    ax.set(xlabel="step", ylabel="fraction of KV memory", ylim=(0, 1.05), xlim=(0, steps))
    ax.legend(fontsize=8, ncol=4, loc="lower right")
    fig.suptitle("Who owns the KV memory: colour = request, pale = allocated but empty, white = free", fontsize=12)
    fig.tight_layout(rect=(0, 0, 1, 0.985))
    RESULTS.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=100)
    plt.close(fig)

    elapsed = time.perf_counter() - t0
    result = {"args": vars(args), "info": info, "summary": summaries, "elapsed_s": elapsed}
    Path(args.out).with_suffix(".json").write_text(json.dumps(result, indent=1))
    if args.json:
        print(json.dumps({"result": "block_map", **info}))
        for name, s in summaries.items():
            print(json.dumps({"result": "utilization", "side": name, **s}))
        return
    print(f"block map: {steps} steps, {len(trace)} requests; maps checked against the allocators' stats at every step")
    for name, s in summaries.items():
        print(f"  {name:<17} U_eff {s['U_eff']:6.1%}  used/mem {s['used_over_capacity']:6.1%}  "
              f"mean seqs {s['mean_concurrency']:5.1f}  requests drawn {info['distinct_requests_drawn'][name]}")
    print(f"wrote {args.out} and {Path(args.out).with_suffix('.json')} in {elapsed:.1f}s")


if __name__ == "__main__":
    main()
