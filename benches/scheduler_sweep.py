#!/usr/bin/env python
"""Scheduler cost against the number of running sequences: the Rust core vs a pure-Python
scheduler doing the same bookkeeping, in the same run, on three loads.

For every S in ``--sizes`` (64 ... 4096 running sequences) and three cases, the same request
stream is driven through two schedulers and the steps are timed:

- **rust**: ``ferrokv.Scheduler`` through the Python boundary, timed as in
  ``scheduler_bench.py``: ``schedule()`` + reading every array a model runner copies to the
  device + ``update()``; the stand-in model (one token 7 per logits row) is not timed.
- **python** (the baseline): ``PyScheduler`` (``_py_scheduler.py``), a minimal but faithful
  pure-Python scheduler with the core's semantics for single-sample requests: FCFS running list
  under a token budget with chunked prefill (a partial chunk stops one token short of the prompt,
  as in the core), admission with the same watermark and per-sequence headroom, block tables over
  a free list with the same order (LRU eviction of cached blocks), prefix caching with chained
  block keys registered as soon as the step that computes them is planned, in plan order (as the
  core since 0a0072a: a request admitted later in the same step hits them), the same output
  arrays built as numpy arrays (block tables padded with block 0) and ``update`` appending
  tokens and freeing finished requests. It
  does what a Python scheduler must do per sequence-step: block-table append, slot mapping,
  token list append (and a decode fast path, as the core has). Preemption is not modelled (the
  loads never need it: the KV cache is sized so). Python's cyclic garbage collector is disabled
  while a configuration runs (``--gc on`` keeps it: at S = 4096 its gen-2 scans of the
  scheduler's state nearly double the baseline's cost); nothing here makes reference cycles.
  Before timing, every case is run through both schedulers at the smallest S and every output
  array is compared step by step (``--no-check`` skips it): the baseline produces exactly the
  core's batches, slots and block tables.

Cases (prefix caching on everywhere, as in the engine's default; block size 16):

1. ``decode``: S requests with 160-token prompts are prefilled (untimed), then every timed step
   decodes exactly S sequences. Budget max(8192, 2S) tokens.
2. ``mixed``: the same S decoding sequences plus a steady stream of long prompts: one new
   1,024-token prompt every 2 steps (distinct tokens, 8 output tokens), chunked under a budget of
   S + 528 tokens, so each step carries S decodes + ~512 prefill tokens of 1-2 chunked prompts +
   the stream's few short decodes. max_num_seqs = S + 32.
3. ``shared_prefix``: the S decoding requests' prompts are a common 1,000-token prefix + a
   distinct 32-token suffix (they share 62 cached blocks), and 2 new such requests arrive every
   step (8 output tokens): each admission looks the prefix up (62 block hits) and computes
   only its 38-token tail. Budget S + 528, max_num_seqs = S + 32.

Every case is warmed up (untimed, with its stream) to step 400 before timing, so contexts and
block-table widths do not depend on S (the width is that of the longest sequence: ~42 / 65 / 96
blocks). All sizes of a case and both implementations then advance round-robin, 10 steps at a
time, so load from other processes on a shared machine hits the whole curve and both sides alike.
Reported per case, S and implementation: mean / p50 / p99 µs per step, µs per sequence-step (step
time / sequences scheduled), mean sequences and tokens per step and the mean block-table width;
for Python also the share spent outside the numpy conversion; the python/rust ratio.

``--criterion`` also runs the criterion benches of the core operations in pure Rust
(``cargo bench -p ferrokv-bench --features criterion --bench core -- --warm-up-time 1
--measurement-time 2`` in the repository root, a couple of minutes) and reads ``target/criterion/*/*/new/estimates.json``:
allocate/free of a block (prefix caching off and on), fork with copy-on-write, prefix lookup at
1/8/64 cached blocks and the pure-Rust decode step at 64..4096 sequences.

Writes ``benches/results/scheduler_sweep.json`` and ``scheduler_sweep.png``.
Usage::

    python benches/scheduler_sweep.py                  # ~1.5 min on 2 cores
    python benches/scheduler_sweep.py --criterion      # + cargo bench (~1 min when already built)
    python benches/scheduler_sweep.py --quick          # 64, 256, 1024; 40 steps: ~10 s
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from ferrokv import Scheduler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _py_scheduler import PyScheduler  # noqa: E402  (the baseline; benches/ is not a package)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
SIZES = (64, 128, 256, 512, 1024, 2048, 4096)
QUICK_SIZES = (64, 256, 1024)
CASES = ("decode", "mixed", "shared_prefix")
BLOCK_SIZE = 16
MAX_MODEL_LEN = 8192
SAMPLED = 7
DECODE_PROMPT = 160
LONG_PROMPT, LONG_EVERY, CHUNK_ROOM = 1024, 2, 512
PREFIX_LEN, SUFFIX_LEN, PREFIX_ARRIVALS = 1000, 32, 2
STREAM_MAX_TOKENS = 8
EXTRA_SEQS = 32
CHUNK = 10  # steps per turn when interleaving rust and python
WARMUP = 400  # timing starts at step max(WARMUP, setup + 50) for every S


# ================================================================================================
# Drivers: the same request stream for both schedulers
# ================================================================================================
ARRAYS = ("req_ids", "query_start_loc", "seq_lens", "block_tables", "input_ids", "positions", "slot_mapping",
          "logits_indices", "row_req_ids")


class Side:
    """One scheduler (rust or python) running one case at one S; times its steps."""

    def __init__(self, impl: str, case: str, size: int, seed: int, timed_steps: int, record: bool = False,
                 block_size: int = BLOCK_SIZE) -> None:
        self.impl, self.case, self.size = impl, case, size
        self.rng = np.random.default_rng(seed)
        self.next_rid = 0
        self.step_no = 0
        self.times: list[int] = []
        self.seqs: list[int] = []
        self.tokens: list[int] = []
        self.widths: list[int] = []
        self.array_ns: list[int] = []
        self.record = record
        self.trace: list[dict] = []
        cfg = case_config(case, size, timed_steps, block_size)
        self.cfg = cfg
        kw = dict(block_size=block_size, max_num_seqs=cfg["max_num_seqs"],
                  max_num_batched_tokens=cfg["budget"], max_model_len=MAX_MODEL_LEN, enable_prefix_caching=True)
        self.s = Scheduler(cfg["num_blocks"], **kw) if impl == "rust" else PyScheduler(cfg["num_blocks"], **kw)
        self.prefix = (self.rng.integers(100_000, 200_000, PREFIX_LEN).tolist() if case == "shared_prefix" else None)
        for _ in range(size):  # the S long-running decode requests
            self._add(self._prompt(DECODE_PROMPT if case != "shared_prefix" else None), cfg["decode_max_tokens"])
        while True:  # prefill them (untimed, no other arrivals)
            out = self._step(timed=False)
            if out.num_prefill_tokens == 0 and self.s.num_waiting == 0:
                break
        self.setup_steps = self.step_no
        assert self.setup_steps < WARMUP, f"{case} S={size}: setup took {self.setup_steps} steps (WARMUP={WARMUP})"
        # Warm up (untimed, with the stream) to a fixed age, so that contexts and block-table
        # widths do not depend on S, and the stream is in its steady state.
        self.start_step = max(WARMUP, self.setup_steps + 50)
        while self.step_no < self.start_step:
            self.arrivals()
            self._step(timed=False)

    def _prompt(self, length: int | None) -> np.ndarray:
        base = self.next_rid * 4096 + 300_000
        if length is None:  # shared prefix + distinct suffix
            return np.asarray(self.prefix + list(range(base, base + SUFFIX_LEN)), dtype=np.int64)
        return np.arange(base, base + length, dtype=np.int64)

    def _add(self, prompt: np.ndarray, max_tokens: int) -> None:
        if self.impl == "rust":
            self.s.add_request(self.next_rid, prompt, max_tokens, ignore_eos=True)
        else:
            self.s.add_request(self.next_rid, prompt.tolist(), max_tokens)
        self.next_rid += 1

    def arrivals(self) -> None:
        """The stream of new requests due before this step (untimed)."""
        if self.case == "mixed" and self.step_no % LONG_EVERY == 0:
            self._add(self._prompt(LONG_PROMPT), STREAM_MAX_TOKENS)
        elif self.case == "shared_prefix":
            for _ in range(PREFIX_ARRIVALS):
                self._add(self._prompt(None), STREAM_MAX_TOKENS)

    def _step(self, timed: bool):
        s, perf = self.s, time.perf_counter_ns
        if self.impl == "rust":
            t0 = perf()
            out = s.schedule()
            n = out.input_ids.shape[0] + out.positions.shape[0] + out.slot_mapping.shape[0]
            n += out.query_start_loc.shape[0] + out.seq_lens.shape[0] + out.logits_indices.shape[0]
            width = out.block_tables.shape[1]
            t1 = perf()
        else:
            t0 = perf()
            out = s.schedule()
            width = out.block_tables.shape[1]
            t1 = perf()
        sampled = np.full(out.num_rows, SAMPLED, np.int32)  # the stand-in model
        if self.record:
            self.trace.append({k: np.array(getattr(out, k)) for k in ARRAYS})
        t2 = perf()
        s.update(out, sampled)
        t3 = perf()
        self.step_no += 1
        if timed:
            self.times.append((t1 - t0) + (t3 - t2))
            self.seqs.append(out.num_seqs)
            self.tokens.append(out.num_tokens)
            self.widths.append(width)
            if self.impl == "python":
                self.array_ns.append(out.array_ns)
        return out

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.arrivals()
            self._step(timed=True)

    def summary(self) -> dict:
        us = np.asarray(self.times, dtype=np.float64) / 1e3
        n = np.asarray(self.seqs, dtype=np.float64)
        extra = {}
        if self.array_ns:  # python: the part that is list bookkeeping, without the numpy conversion
            extra["arrays_us_per_seq_step"] = float(np.sum(self.array_ns) / 1e3 / n.sum())
            extra["lists_us_per_seq_step"] = float((np.sum(self.times) - np.sum(self.array_ns)) / 1e3 / n.sum())
        return {
            "steps": len(us), "mean_us": float(us.mean()), "p50_us": float(np.percentile(us, 50)),
            "p99_us": float(np.percentile(us, 99)), "us_per_seq_step": float(us.sum() / n.sum()),
            "p50_us_per_seq_step": float(np.percentile(us, 50) / n.mean()),
            "mean_seqs": float(n.mean()), "mean_tokens": float(np.mean(self.tokens)),
            "mean_width": float(np.mean(self.widths)), "setup_steps": self.setup_steps,
            "start_step": self.start_step, **extra,
        }


def case_config(case: str, size: int, timed_steps: int, block_size: int = BLOCK_SIZE) -> dict:
    if case == "decode":
        budget = max(8192, 2 * size)
        max_seqs = size
    else:
        budget = size + CHUNK_ROOM + 16
        max_seqs = size + EXTRA_SEQS
    prompt = PREFIX_LEN + SUFFIX_LEN if case == "shared_prefix" else DECODE_PROMPT
    # The decode requests never finish and the cache never runs short within the run: setup
    # takes fewer than WARMUP steps (checked), then WARMUP + 50 + timed steps at most.
    horizon = WARMUP + 64 + timed_steps + 64
    private = (SUFFIX_LEN + 16 if case == "shared_prefix" else prompt) + horizon
    per_seq = -(-private // block_size)
    stream = (EXTRA_SEQS + 8) * -(-(LONG_PROMPT + STREAM_MAX_TOKENS) // block_size)
    shared = 16 * -(-prompt // block_size)  # the shared prefix, plus the copies computed before it was cached
    num_blocks = 1 + size * per_seq + stream + shared + size  # + admission headroom (0.5 block per sequence)
    return {"budget": budget, "max_num_seqs": max_seqs, "num_blocks": num_blocks, "decode_max_tokens": horizon + 64}


def per_sequence(a: dict) -> dict[int, dict]:
    """One step's arrays regrouped per scheduled request (n = 1 here: a request is a sequence),
    independent of the order the scheduler lists them in."""
    qsl, lens, bt = a["query_start_loc"], a["seq_lens"], a["block_tables"]
    last_tokens = set(a["logits_indices"].tolist())
    out = {}
    for i, rid in enumerate(a["req_ids"].tolist()):
        lo, hi, n = int(qsl[i]), int(qsl[i + 1]), int(lens[i])
        out[rid] = {
            "len": n,
            "ids": a["input_ids"][lo:hi],
            "pos": a["positions"][lo:hi],
            "offsets": a["slot_mapping"][lo:hi] % BLOCK_SIZE,
            "blocks": bt[i, : -(-n // BLOCK_SIZE)],
            "samples": (hi - 1) in last_tokens,
        }
    return out


def check_case(case: str, size: int, steps: int, seed: int) -> int:
    """Runs both schedulers through setup + `steps` steps and compares every step: the same
    requests scheduled with the same lengths, tokens, positions, in-block offsets and sampling
    rows, and block tables equal up to a one-to-one renaming of block ids."""
    rust = Side("rust", case, size, seed, steps, record=True)
    py = Side("python", case, size, seed, steps, record=True)
    rust.run(steps)
    py.run(steps)
    assert rust.setup_steps == py.setup_steps, (case, rust.setup_steps, py.setup_steps)
    assert len(rust.trace) == len(py.trace)
    for i, (a, b) in enumerate(zip(rust.trace, py.trace)):
        where = f"{case} S={size} step {i}"
        ra, pa = per_sequence(a), per_sequence(b)
        if ra.keys() != pa.keys():
            raise AssertionError(f"{where}: scheduled requests differ: {sorted(ra.keys() ^ pa.keys())[:8]}")
        if a["block_tables"].shape[1] != b["block_tables"].shape[1]:
            raise AssertionError(f"{where}: block-table width {a['block_tables'].shape} vs {b['block_tables'].shape}")
        if sorted(a["row_req_ids"].tolist()) != sorted(b["row_req_ids"].tolist()):
            raise AssertionError(f"{where}: sampling rows differ")
        to_py: dict[int, int] = {}
        for rid, x in ra.items():
            y = pa[rid]
            for k in ("len", "samples"):
                if x[k] != y[k]:
                    raise AssertionError(f"{where}: request {rid}: {k} {x[k]} vs {y[k]}")
            for k in ("ids", "pos", "offsets"):
                if not np.array_equal(x[k], y[k]):
                    raise AssertionError(f"{where}: request {rid}: {k} differ")
            # Block ids may differ (allocation order is an implementation choice); the step's
            # sharing structure may not: a consistent one-to-one renaming must exist.
            for rb, pb in zip(x["blocks"].tolist(), y["blocks"].tolist()):
                if to_py.setdefault(rb, pb) != pb:
                    raise AssertionError(f"{where}: request {rid}: block {rb} maps to {to_py[rb]} and {pb}")
        if len(set(to_py.values())) != len(to_py):
            raise AssertionError(f"{where}: two blocks in one implementation are one in the other")
    st = rust.s.stats()
    for k in ("prompt_tokens", "cached_prompt_tokens", "generated_tokens", "requests_finished"):
        if py.s.stats[k] != st[k]:
            raise AssertionError(f"{case}: stats {k}: rust {st[k]} python {py.s.stats[k]}")
    return len(rust.trace)


# ================================================================================================
# criterion
# ================================================================================================
CRITERION_IDS = {
    "kv/allocate_free_block": "allocate + free one block (prefix caching off)",
    "kv/allocate_free_block_prefix_caching": "allocate + free one block (prefix caching on)",
    "kv/fork_cow": "fork a 2-block table + copy-on-write of the shared last block + free",
    "prefix_lookup/find_cached_prefix/1": "prefix lookup, 1 cached block",
    "prefix_lookup/find_cached_prefix/8": "prefix lookup, 8 cached blocks",
    "prefix_lookup/find_cached_prefix/64": "prefix lookup, 64 cached blocks",
    "scheduler/decode_step/64": "schedule + update, 64 decode sequences",
    "scheduler/decode_step/256": "schedule + update, 256 decode sequences",
    "scheduler/decode_step/1024": "schedule + update, 1024 decode sequences",
    "scheduler/decode_step/4096": "schedule + update, 4096 decode sequences",
}


def run_criterion() -> dict:
    cmd = ["cargo", "bench", "-p", "ferrokv-bench", "--features", "criterion", "--bench", "core", "--", "--warm-up-time", "1",
           "--measurement-time", "2"]
    print("running: " + " ".join(cmd), file=sys.stderr, flush=True)
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"cargo bench failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = []
    for bench_id, what in CRITERION_IDS.items():
        path = ROOT / "target" / "criterion" / bench_id / "new" / "estimates.json"
        if not path.is_file() or path.stat().st_mtime < t0 - 1:
            rows.append({"id": bench_id, "what": what, "missing": True})
            continue
        est = json.loads(path.read_text())
        mean = est["mean"]
        row = {"id": bench_id, "what": what, "mean_ns": mean["point_estimate"],
               "mean_ci95_ns": [mean["confidence_interval"]["lower_bound"], mean["confidence_interval"]["upper_bound"]],
               "median_ns": est["median"]["point_estimate"]}
        last = bench_id.rsplit("/", 1)[-1]
        if last.isdigit():  # throughput element: blocks (lookup) or sequences (decode step)
            row["per_element_ns"] = mean["point_estimate"] / int(last)
        rows.append(row)
    return {"command": " ".join(cmd), "seconds": time.time() - t0, "rows": rows}


# ================================================================================================
def plot(results: list[dict], png: Path, criterion: dict | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    colors = {"decode": "tab:blue", "mixed": "tab:orange", "shared_prefix": "tab:green"}
    for case in CASES:
        for impl, style in (("rust", "-o"), ("python", "--s")):
            rs = sorted((r for r in results if r["case"] == case and r["impl"] == impl), key=lambda r: r["size"])
            if not rs:
                continue
            x = [r["size"] for r in rs]
            axes[0].plot(x, [r["mean_us"] for r in rs], style, color=colors[case], label=f"{case} ({impl})")
            axes[1].plot(x, [r["us_per_seq_step"] for r in rs], style, color=colors[case], label=f"{case} ({impl})")
    if criterion:
        pts = [(int(r["id"].rsplit("/", 1)[1]), r["mean_ns"] / 1e3) for r in criterion["rows"]
               if r["id"].startswith("scheduler/decode_step/") and not r.get("missing")]
        if pts:
            pts.sort()
            axes[0].plot([p[0] for p in pts], [p[1] for p in pts], ":^", color="black", label="decode (pure Rust, criterion)")
            axes[1].plot([p[0] for p in pts], [p[1] / p[0] for p in pts], ":^", color="black",
                         label="decode (pure Rust, criterion)")
    axes[0].set_yscale("log")
    axes[0].set_ylabel("µs per step (schedule + arrays + update)")
    axes[1].set_ylabel("µs per sequence-step")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("running sequences S")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7, loc="lower right", ncol=2)
    fig.suptitle("Scheduler cost: ferrokv Rust core (solid) vs pure-Python scheduler (dashed), block size 16")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default=None, help="comma-separated S values (default 64..4096; quick: 64,256,1024)")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--steps", type=int, default=None, help="timed steps per case and S (default 200; quick 40)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--criterion", action="store_true", help="also run the criterion benches (cargo bench, minutes)")
    ap.add_argument("--no-check", action="store_true", help="skip the step-by-step rust/python equivalence check")
    ap.add_argument("--gc", choices=("off", "on"), default="off",
                    help="Python's cyclic GC while a configuration runs (default off: the baseline makes no "
                         "reference cycles, so a tuned Python server would not pay for gen-2 scans of its state)")
    ap.add_argument("--json", action="store_true", help="one JSON line per result")
    ap.add_argument("--out", default=str(RESULTS / "scheduler_sweep.json"))
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else list(QUICK_SIZES if args.quick else SIZES)
    cases = [c for c in args.cases.split(",") if c]
    steps = args.steps or (40 if args.quick else 200)
    t_start = time.perf_counter()

    checked = {}
    if not args.no_check:
        for case in cases:
            checked[case] = check_case(case, min(sizes), 60, args.seed)
            print(f"check {case} S={min(sizes)}: {checked[case]} steps, every step equivalent", file=sys.stderr,
                  flush=True)

    results = []
    for case in cases:
        t0 = time.perf_counter()
        gc.collect()
        if args.gc == "off":
            gc.disable()
        try:
            sides = {size: [Side("rust", case, size, args.seed, steps), Side("python", case, size, args.seed, steps)]
                     for size in sizes}
            # Round-robin over every size and both implementations, CHUNK steps at a time, so that
            # load from other processes on a shared machine hits the whole curve alike.
            for lo in range(0, steps, CHUNK):
                for pair in sides.values():
                    for side in pair:
                        side.run(min(CHUNK, steps - lo))
        finally:
            gc.enable()
        for size, pair in sides.items():
            rs = {}
            for side in pair:
                r = {"case": case, "size": size, "impl": side.impl, **side.summary(), **side.cfg}
                rs[side.impl] = r
                results.append(r)
            ratio = rs["python"]["us_per_seq_step"] / rs["rust"]["us_per_seq_step"]
            rs["python"]["python_over_rust"] = ratio
            line = (f"{case:<14} S={size:<5} rust {rs['rust']['mean_us']:9.1f} µs/step {rs['rust']['us_per_seq_step']:6.3f}"
                    f" µs/seq | python {rs['python']['mean_us']:9.1f} µs/step {rs['python']['us_per_seq_step']:6.3f} µs/seq"
                    f" ({rs['python']['lists_us_per_seq_step']:.3f} lists)"
                    f" | x{ratio:5.1f}  seqs {rs['rust']['mean_seqs']:.0f} tokens {rs['rust']['mean_tokens']:.0f}"
                    f" width {rs['rust']['mean_width']:.0f}")
            print(line, file=sys.stderr if args.json else sys.stdout, flush=True)
            if args.json:
                for r in rs.values():
                    print(json.dumps({"result": "scheduler_sweep", **r}), flush=True)
        del sides
        print(f"  ({case}: {time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)

    criterion = None
    if args.criterion:
        criterion = run_criterion()
        for r in criterion["rows"]:
            if args.json:
                print(json.dumps({"result": "criterion", **r}), flush=True)
            elif r.get("missing"):
                print(f"criterion {r['id']:<42} missing")
            else:
                extra = f"  ({r['per_element_ns']:.1f} ns per element)" if "per_element_ns" in r else ""
                print(f"criterion {r['id']:<42} {r['mean_ns']:12.1f} ns{extra}")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    png = out.with_suffix(".png")
    plot(results, png, criterion)
    elapsed = time.perf_counter() - t_start
    out.write_text(json.dumps({
        "args": vars(args), "sizes": sizes, "steps": steps, "checked_steps": checked,
        "constants": {"block_size": BLOCK_SIZE, "decode_prompt": DECODE_PROMPT, "long_prompt": LONG_PROMPT,
                      "long_every": LONG_EVERY, "chunk_room": CHUNK_ROOM, "prefix_len": PREFIX_LEN,
                      "suffix_len": SUFFIX_LEN, "prefix_arrivals_per_step": PREFIX_ARRIVALS,
                      "stream_max_tokens": STREAM_MAX_TOKENS},
        "results": results, "criterion": criterion, "elapsed_s": elapsed}, indent=1))
    print(f"wrote {out} and {png} in {elapsed:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
