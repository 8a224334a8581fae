#!/usr/bin/env python
"""Soak test of the scheduler through the Python bindings (``ferrokv._core.Scheduler``).

Runs ``--ops`` operations (default 1,000,000) as a serving loop would, over four long-lived
schedulers with different configurations (block sizes 16, 8, 4 and 1; recompute and swap
preemption; prefix caching on and off; FCFS and priority): random ``add_request`` (prompts that
share system-prompt prefixes, some salted, n up to 4, EOS and stop ids), steps (``schedule``, the
arrays a runner reads, then ``update`` or, one step in 20, ``cancel_step``), ``fork_sequence``,
``drop_sequence`` and ``abort`` between steps and mid-step, ``reset_prefix_cache``, ``stats``
polls, and misuse (``update`` twice, ``schedule`` with a step in flight). Every API call is one
operation. Calls the random choice makes on a request that is gone or not running fail: they
must raise a ``FerrokvError`` (counted per kind), anything else ends the run.

Every ``--check-every`` operations (and at the end) every scheduler is drained: steps until no
request is left. Then every block must be free, ``check_invariants`` must pass, and every request
added must have ended once (``requests_finished + requests_aborted + capacity_aborts``). RSS
(``VmRSS``) is read at the start, at every check and at the end.

Writes ``benches/results/soak.json`` (``--quick``: 50,000 operations, to
``benches/results/quick/soak.json``).
Usage: ``python benches/soak.py [--quick] [--ops N] [--check-every N] [--seed 0] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np

from ferrokv._core import FerrokvError, Scheduler, SchedulerStateError

RESULTS = Path(__file__).resolve().parent / "results"
OPS = 1_000_000
QUICK_OPS = 50_000

CONFIGS = [
    dict(name="b16-recompute-cached", num_blocks=257, block_size=16, max_num_seqs=32,
         max_num_batched_tokens=512, max_model_len=512, enable_prefix_caching=True,
         preemption_mode="recompute"),
    dict(name="b8-swap-cached", num_blocks=129, block_size=8, max_num_seqs=16,
         max_num_batched_tokens=256, max_model_len=256, enable_prefix_caching=True,
         preemption_mode="swap", num_cpu_blocks=96),
    dict(name="b4-recompute-priority-uncached", num_blocks=97, block_size=4, max_num_seqs=8,
         max_num_batched_tokens=64, max_model_len=128, enable_prefix_caching=False,
         preemption_mode="recompute", policy="priority"),
    dict(name="b1-swap-tight", num_blocks=97, block_size=1, max_num_seqs=4,
         max_num_batched_tokens=16, max_model_len=48, enable_prefix_caching=True,
         preemption_mode="swap", num_cpu_blocks=24),
]

# Shared system prompts: prefix-cache hits across requests.
SYSTEM = [list(range(1000 * k, 1000 * k + 96)) for k in range(1, 4)]
EOS = 2
STOP = 3


def rss_kb() -> int:
    """Resident set size of this process in KiB (Linux ``VmRSS``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


class Soak:
    """Drives the schedulers and counts operations: attempts and successes per kind."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.np_rng = np.random.default_rng(seed)
        self.scheds = []
        for c in CONFIGS:
            kw = {k: v for k, v in c.items() if k != "name"}
            self.scheds.append({"name": c["name"], "s": Scheduler(**kw), "live": set(), "next_id": 0,
                                "max_model_len": c["max_model_len"], "max_num_seqs": c["max_num_seqs"],
                                "num_blocks": c["num_blocks"]})
        self.ops = 0
        self.tried: dict[str, int] = {}
        self.ok: dict[str, int] = {}

    def call(self, kind: str, fn, *args, **kw):
        """One operation: returns (True, result) or (False, None) on a ferrokv error."""
        self.ops += 1
        self.tried[kind] = self.tried.get(kind, 0) + 1
        try:
            r = fn(*args, **kw)
        except FerrokvError:
            return False, None
        self.ok[kind] = self.ok.get(kind, 0) + 1
        return True, r

    def misuse(self, kind: str, fn, *args) -> None:
        """A call out of order: it must raise SchedulerStateError."""
        self.ops += 1
        self.tried[kind] = self.tried.get(kind, 0) + 1
        try:
            fn(*args)
        except SchedulerStateError:
            self.ok[kind] = self.ok.get(kind, 0) + 1
            return
        raise AssertionError(f"{kind} did not raise SchedulerStateError")

    def add(self, d: dict) -> None:
        if len(d["live"]) >= 3 * d["max_num_seqs"]:
            return  # keep the queue bounded, as a server's admission control would
        rng = self.rng
        rid = d["next_id"]
        d["next_id"] += 1
        longest = min(64, d["max_model_len"] - 1)
        n_prefix = rng.randrange(0, longest) if rng.random() < 0.6 else 0
        prompt = SYSTEM[rng.randrange(len(SYSTEM))][:n_prefix]
        prompt += [rng.randrange(10, 50_000) for _ in range(rng.randrange(1, longest - n_prefix + 1))]
        ok, _ = self.call(
            "add", d["s"].add_request, rid, prompt, rng.randrange(1, 64),
            n=rng.choice((1, 1, 1, 2, 4)), priority=rng.randrange(-1, 2),
            eos_token_id=EOS if rng.random() < 0.5 else None,
            stop_token_ids=[STOP] if rng.random() < 0.2 else None,
            cache_salt=rng.choice((None, None, "tenant-a", "tenant-b")),
        )
        if ok:
            d["live"].add(rid)

    def ended(self, d: dict, done) -> None:
        for f in done:
            if f.request_finished:
                d["live"].discard(f.request_id)

    def pick_seq(self, d: dict):
        if not d["live"]:
            return None
        rid = self.rng.choice(tuple(d["live"]))
        try:
            seqs = d["s"].request_seq_ids(rid)
        except FerrokvError:
            return None  # ended mid-step or by a cancel; reported by the next update
        return rid, self.rng.choice(seqs)

    def step(self, d: dict) -> None:
        s, rng = d["s"], self.rng
        ok, out = self.call("schedule", s.schedule)
        assert ok, "schedule() failed with no step in flight"
        # What a runner reads (numpy views are created on first access).
        rows = len(out.logits_indices)
        _ = (out.input_ids, out.positions, out.slot_mapping, out.block_tables, out.query_start_loc,
             out.seq_lens, out.copy_ops, out.swap_in, out.swap_out)
        if rng.random() < 0.02:
            self.misuse("schedule_in_flight", s.schedule)
        if rows and rng.random() < 0.15:
            r = rng.randrange(rows)
            what = rng.randrange(3)
            if what == 0:
                ok, _ = self.call("abort_mid_step", s.abort, int(out.row_req_ids[r]))
                if ok:
                    d["live"].discard(int(out.row_req_ids[r]))
            elif what == 1:
                self.call("fork_mid_step", s.fork_sequence, int(out.row_seq_ids[r]), rng.randrange(10, 100))
            else:
                ok, last = self.call("drop_mid_step", s.drop_sequence, int(out.row_seq_ids[r]))
                if ok and last:
                    d["live"].discard(int(out.row_req_ids[r]))
        if rng.random() < 0.05:
            ok, _ = self.call("cancel_step", s.cancel_step, out)
            assert ok, "cancel_step() of the step in flight failed"
            return
        sampled = self.np_rng.integers(2, 60, size=rows)
        ok, done = self.call("update", s.update, out, sampled)
        assert ok, "update() of the step in flight failed"
        self.ended(d, done)
        if rng.random() < 0.01:
            self.misuse("update_twice", s.update, out, sampled)

    def one(self) -> None:
        d = self.rng.choice(self.scheds)
        x = self.rng.random()
        if x < 0.25:
            self.add(d)
        elif x < 0.80:
            self.step(d)
        elif x < 0.86:
            picked = self.pick_seq(d)
            if picked:
                self.call("fork", d["s"].fork_sequence, picked[1])
        elif x < 0.89:
            picked = self.pick_seq(d)
            if picked:
                ok, last = self.call("drop", d["s"].drop_sequence, picked[1])
                if ok and last:
                    d["live"].discard(picked[0])
        elif x < 0.95:
            if d["next_id"]:
                # A live request, or any id ever used (most of them ended).
                live = self.rng.random() < 0.7 and d["live"]
                rid = self.rng.choice(tuple(d["live"])) if live else self.rng.randrange(d["next_id"])
                ok, _ = self.call("abort", d["s"].abort, rid)
                if ok:
                    d["live"].discard(rid)
        elif x < 0.995:
            self.call("stats", d["s"].stats)  # what a metrics endpoint polls
        else:
            self.call("reset_prefix_cache", d["s"].reset_prefix_cache)

    def drain(self) -> list[dict]:
        """Steps every scheduler until nothing is left; checks that every block is free."""
        report = []
        for d in self.scheds:
            s = d["s"]
            for _ in range(1_000_000):
                if not s.has_unfinished():
                    break
                ok, out = self.call("schedule", s.schedule)
                ok, done = self.call("update", s.update, out, self.np_rng.integers(4, 60, size=len(out.logits_indices)))
                self.ended(d, done)
            else:
                raise AssertionError(f"{d['name']}: did not drain")
            # One more step reports what ended last (nothing is scheduled).
            out = s.schedule()
            self.ended(d, s.update(out, []))
            s.check_invariants()
            st = s.stats()
            free, usable = s.num_free_blocks, d["num_blocks"] - 1
            ended = st["requests_finished"] + st["requests_aborted"] + st["capacity_aborts"]
            assert free == usable, f"{d['name']}: {free} of {usable} blocks free after draining"
            assert not d["live"], f"{d['name']}: requests never reported ended: {sorted(d['live'])[:10]}"
            assert ended == st["requests_added"], f"{d['name']}: {st['requests_added']} added, {ended} ended"
            report.append({"config": d["name"], "free_blocks": free, "usable_blocks": usable,
                           "requests_added": st["requests_added"], "steps": st["steps"],
                           "preemptions": st["preemptions"], "swap_preemptions": st["swap_preemptions"],
                           "cancelled_steps": st["cancelled_steps"], "cow_copies": st["cow_copies"],
                           "cached_prompt_tokens": st["cached_prompt_tokens"]})
        return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_OPS:,} operations instead of {OPS:,}")
    ap.add_argument("--ops", type=int, default=None)
    ap.add_argument("--check-every", type=int, default=None, help="operations between drains (default ops / 10)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print the result as one JSON line")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    total = args.ops or (QUICK_OPS if args.quick else OPS)
    every = args.check_every or max(1, total // 10)
    out_path = Path(args.out) if args.out else (RESULTS / "quick" / "soak.json" if args.quick else RESULTS / "soak.json")

    soak = Soak(args.seed)
    rss = [{"ops": 0, "rss_kb": rss_kb()}]
    checks = []
    t0 = time.perf_counter()
    next_check = every
    while soak.ops < total:
        soak.one()
        if soak.ops >= next_check or soak.ops >= total:
            checks.append({"ops": soak.ops, "configs": soak.drain()})
            rss.append({"ops": soak.ops, "rss_kb": rss_kb()})
            if not args.json:
                print(f"{soak.ops:>10,} ops  {soak.ops / (time.perf_counter() - t0):>9,.0f} ops/s  "
                      f"RSS {rss[-1]['rss_kb'] / 1024:7.1f} MiB  every block free after draining", flush=True)
            next_check = soak.ops + every
    elapsed = time.perf_counter() - t0
    result = {
        "result": "soak",
        "ops": soak.ops,
        "seconds": round(elapsed, 2),
        "ops_per_s": round(soak.ops / elapsed),
        "rss_kb_start": rss[0]["rss_kb"],
        "rss_kb_end": rss[-1]["rss_kb"],
        "rss_kb_after_first_check": rss[1]["rss_kb"],
        "rss_kb": rss,
        "all_blocks_free_after_every_drain": True,
        "drains": len(checks),
        "tried": dict(sorted(soak.tried.items())),
        "succeeded": dict(sorted(soak.ok.items())),
        "final": checks[-1]["configs"],
        "seed": args.seed,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=1))
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{soak.ops:,} operations in {elapsed:.1f} s ({result['ops_per_s']:,} ops/s); RSS "
              f"{result['rss_kb_start'] / 1024:.1f} MiB at the start, {result['rss_kb_after_first_check'] / 1024:.1f} MiB "
              f"after the first drain, {result['rss_kb_end'] / 1024:.1f} MiB at the end; written to {out_path}")
        for k in sorted(soak.tried):
            print(f"  {k:<20} {soak.ok.get(k, 0):>9,} of {soak.tried[k]:>9,} succeeded")
    return 0


if __name__ == "__main__":
    sys.exit(main())
