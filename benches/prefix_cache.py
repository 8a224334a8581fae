#!/usr/bin/env python
"""Prefix caching end to end: the engine with the prefix cache on vs off, same requests, same run.

Two workloads, each run twice on ``LLMEngine`` (``enable_prefix_caching=True`` and ``False``; the
baseline is the cache off), greedy, ``max_tokens`` = 16 with ``ignore_eos`` so every request
generates exactly 16 tokens:

1. **shared system prompt**: ``--requests`` (256) requests = one common 1,000-token system prompt +
   a distinct 50-token user turn (random token ids), all submitted at once.
2. **multi-turn chat**: ``--conversations`` (16) conversations x ``--turns`` (6) turns. Turn 1 is a
   distinct 200-token context + a 50-token user turn; turn k's prompt is turn k-1's prompt + its
   16-token answer + a new 50-token user turn. Each conversation submits turn k as soon as turn
   k-1 has finished (all conversations run concurrently).

The two engines (cache on and off) are built side by side and stepped alternately, each on its
own clock that advances by the measured time of its own steps (submission and TTFT are read on
that clock), so that load from other processes on a shared machine hits both alike. torch runs
with ``--threads`` (default 1: with 2 threads on a loaded 2-core machine a matmul can be several
times slower from one minute to the next).

Reported per run: prompt tokens, prefill tokens computed (``stats()['prompt_tokens_computed']``),
cached prompt tokens and the hit rate ``cached_prompt_tokens / prompt_tokens``, wall time,
output tokens/s and processed (prompt + output) tokens/s, TTFT (submission to first token:
mean / p50 / p90 / p99), steps, peak running sequences and KV blocks, and whether the greedy
outputs of cache on and off agree. For the shared prompt the script also reports the *ideal*
hit rate (every request but the first served its full cached prefix blocks) and how many
requests missed the cache. Since the core registers full blocks when the step that computes them
is planned (0a0072a), a request admitted in the same step as the prefix's first computation hits
it too, so the hit rate should equal the ideal; the miss count checks that.

Models: the default is a tiny random Llama built on the fly (4 layers, hidden 128, 4 heads,
2 KV heads, vocab 400; ``tests/helpers``) so that the full 256-request shape runs in minutes on
a CPU; ``--model smollm2`` runs the embedded SmolLM2-135M-Instruct (fp32 on CPU: with the cache
off the 256 x 1,050 prefill tokens take ~10 minutes; ``--quick`` uses 32 requests and 8 x 4
turns), ``--model PATH`` any local model folder. Engine defaults otherwise (block size 16,
max_num_seqs 256, 2,048-token step budget on CPU, 1 GiB of KV on CPU), max_model_len 2048.

Writes ``benches/results/prefix_cache.json`` (``prefix_cache_smollm2.json`` for SmolLM2) and the
PNG next to it. Usage::

    python benches/prefix_cache.py                     # tiny model, 256 requests + 16x6 chat
    python benches/prefix_cache.py --model smollm2 --quick
    python benches/prefix_cache.py --quick --json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _threads import add_threads_option, set_threads  # noqa: E402  (benches/ is not a package)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
TINY = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4,
            intermediate_size=512, max_position_embeddings=2048)
MAX_MODEL_LEN = 2048


def build_tiny_model(directory: Path, seed: int) -> Path:
    # tests/ (as pytest does), not the repository root: the root's kernels/ folder would shadow
    # the optional "kernels" package that transformers probes for.
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.tiny_models import save_tiny_model
    from helpers.tiny_tokenizer import save_tiny_tokenizer

    save_tiny_model(directory, "llama", seed=seed, **TINY)
    save_tiny_tokenizer(directory)
    return directory


def make_engine(model: str | None, caching: bool, max_num_seqs: int):
    from ferrokv.engine import EngineArgs, LLMEngine

    return LLMEngine(EngineArgs(model=model, enable_prefix_caching=caching, max_num_seqs=max_num_seqs,
                                max_model_len=MAX_MODEL_LEN, seed=0))


def _dist(x) -> dict:
    a = np.asarray(x, dtype=np.float64)
    if a.size == 0:
        return {}
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "max": float(a.max())}


class Driver:
    """Runs requests through one engine on its own clock, which advances by the measured time of
    that engine's steps only: two drivers can then be stepped alternately (see ``run_lockstep``)
    so that load from other processes on a shared machine hits cache on and off alike."""

    def __init__(self, engine, max_tokens: int) -> None:
        from ferrokv import SamplingParams

        self.engine = engine
        engine.peak_used_blocks = 0
        self.params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.clock = 0.0
        self.submitted: dict[str, float] = {}
        self.first: dict[str, float] = {}
        self.done: dict[str, float] = {}
        self.outputs: dict[str, list[int]] = {}
        self.cached: dict[str, int] = {}
        self.prompt_lens: dict[str, int] = {}
        self.steps = 0
        self.max_running = 0
        self.base = engine.stats()  # stats are cumulative: the run's numbers are differences

    def submit(self, rid: str, prompt: list[int]) -> None:
        t0 = time.perf_counter()
        self.engine.add_request(rid, {"prompt_token_ids": prompt}, self.params)
        self.clock += time.perf_counter() - t0
        self.submitted[rid] = self.clock
        self.prompt_lens[rid] = len(prompt)

    def busy(self) -> bool:
        return self.engine.has_unfinished_requests()

    def step(self) -> list[str]:
        """One engine step; returns the ids of the requests that finished in it."""
        t0 = time.perf_counter()
        outs = self.engine.step()
        self.clock += time.perf_counter() - t0
        now = self.clock
        self.steps += 1
        self.max_running = max(self.max_running, self.engine.scheduler.num_running_seqs)
        finished = []
        for o in outs:
            if o.request_id not in self.first and o.outputs and o.outputs[0].token_ids:
                self.first[o.request_id] = now
            if o.finished:
                self.done[o.request_id] = now
                self.outputs[o.request_id] = list(o.outputs[0].token_ids)
                self.cached[o.request_id] = o.num_cached_tokens
                finished.append(o.request_id)
        return finished

    def result(self) -> dict:
        st = {k: v - self.base.get(k, 0) if k in DIFF_KEYS else v for k, v in self.engine.stats().items()}
        wall = self.clock
        out_tokens = sum(len(v) for v in self.outputs.values())
        ttft = [self.first[k] - self.submitted[k] for k in self.first]
        return {
            "requests": len(self.submitted), "prompt_tokens": st["prompt_tokens"],
            "prompt_tokens_computed": st["prompt_tokens_computed"], "cached_prompt_tokens": st["cached_prompt_tokens"],
            "first_admission_cached_tokens": st["first_admission_cached_tokens"],
            "hit_rate": st["cached_prompt_tokens"] / st["prompt_tokens"],
            "requests_without_hit": sum(1 for v in self.cached.values() if v == 0),
            "output_tokens": out_tokens, "wall_s": wall, "output_tokens_per_s": out_tokens / wall,
            "processed_tokens_per_s": (st["prompt_tokens"] + out_tokens) / wall,
            "prefill_tokens_computed_per_s": st["prompt_tokens_computed"] / wall,
            "requests_per_s": len(self.outputs) / wall, "ttft_s": _dist(ttft),
            "steps": self.steps, "max_running_seqs": self.max_running, "preemptions": st["preemptions"],
            "peak_used_blocks": self.engine.peak_used_blocks, "num_blocks": st["num_blocks"],
        }


DIFF_KEYS = ("prompt_tokens", "prompt_tokens_computed", "cached_prompt_tokens", "first_admission_cached_tokens",
             "preemptions", "steps", "generated_tokens")


class SharedPrompt:
    """Every request submitted at once."""

    def __init__(self, engine, prompts: list[list[int]], max_tokens: int) -> None:
        self.d = Driver(engine, max_tokens)
        self.n = len(prompts)
        for i, p in enumerate(prompts):
            self.d.submit(f"r{i}", p)

    def step(self) -> None:
        self.d.step()

    def result(self) -> dict:
        r = self.d.result()
        r["ttft_by_request"] = [self.d.first[f"r{i}"] - self.d.submitted[f"r{i}"] for i in range(self.n)]
        return r


class Chat:
    """openings[c]: conversation c's turn-1 context; user_turns[c][k]: the user tokens of turn k+1.
    Turn k+1 is submitted right after turn k finished: conversation + answer + new user turn."""

    def __init__(self, engine, openings: list[list[int]], user_turns: list[list[list[int]]], max_tokens: int) -> None:
        self.d = Driver(engine, max_tokens)
        self.user_turns = user_turns
        self.n_conv, self.n_turns = len(openings), len(user_turns[0])
        self.conv = {c: list(openings[c]) + list(user_turns[c][0]) for c in range(self.n_conv)}
        self.turn = dict.fromkeys(self.conv, 0)
        for c, p in self.conv.items():
            self.d.submit(f"c{c}-t0", p)

    def step(self) -> None:
        for rid in self.d.step():
            c = int(rid[1:rid.index("-")])
            self.turn[c] += 1
            k = self.turn[c]
            if k < self.n_turns:
                self.conv[c] = self.conv[c] + self.d.outputs[rid] + list(self.user_turns[c][k])
                self.d.submit(f"c{c}-t{k}", self.conv[c])

    def result(self) -> dict:
        d = self.d
        r = d.result()
        r["per_turn"] = []
        for k in range(self.n_turns):
            ks = [f"c{c}-t{k}" for c in range(self.n_conv)]
            r["per_turn"].append({"turn": k + 1, "mean_prompt_len": float(np.mean([d.prompt_lens[x] for x in ks])),
                                  "mean_cached": float(np.mean([d.cached[x] for x in ks])),
                                  "ttft_mean_s": float(np.mean([d.first[x] - d.submitted[x] for x in ks]))})
        return r


def run_lockstep(sessions: dict) -> dict:
    """Steps the sessions alternately until all are done; each keeps its own clock."""
    while True:
        busy = [s for s in sessions.values() if s.d.busy()]
        if not busy:
            break
        for s in busy:
            s.step()
    return {k: s.result() for k, s in sessions.items()}


def agreement(a: dict[str, list[int]], b: dict[str, list[int]]) -> dict:
    same = sum(1 for k in a if a[k] == b.get(k))
    return {"identical_outputs": same, "of": len(a)}


def plot(res: dict, png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    labels = ["shared prompt", "multi-turn chat"]
    keys = ["shared", "chat"]
    x = np.arange(len(keys))
    w = 0.38
    for j, (side, color) in enumerate((("off", "tab:gray"), ("on", "tab:green"))):
        comp = [res[k][side]["prompt_tokens_computed"] / 1e3 for k in keys]
        ttft = [res[k][side]["ttft_s"]["mean"] for k in keys]
        axes[0].bar(x + (j - 0.5) * w, comp, w, color=color, label=f"cache {side}")
        axes[1].bar(x + (j - 0.5) * w, ttft, w, color=color, label=f"cache {side}")
        for i, k in enumerate(keys):
            axes[0].text(x[i] + (j - 0.5) * w, comp[i], f"{comp[i]:.0f}k", ha="center", va="bottom", fontsize=8)
            axes[1].text(x[i] + (j - 0.5) * w, ttft[i], f"{ttft[i]:.2f}s", ha="center", va="bottom", fontsize=8)
    for ax, yl in ((axes[0], "prefill tokens computed (thousands)"), (axes[1], "mean TTFT (s)")):
        ax.set_xticks(x, labels)
        ax.set_ylabel(yl)
        ax.legend()
    # TTFT of every request, in submission order, for the shared prompt
    for side, color in (("off", "tab:gray"), ("on", "tab:green")):
        axes[2].plot(res["shared"][side]["ttft_by_request"], ".", ms=3, color=color, label=f"cache {side}")
    axes[2].set_xlabel("request (submission order), shared prompt")
    axes[2].set_ylabel("TTFT (s)")
    axes[2].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="'tiny' (default, random tiny Llama), 'smollm2', or a model folder")
    ap.add_argument("--requests", type=int, default=None, help="shared-prompt requests (default 256; quick 32)")
    ap.add_argument("--prefix-len", type=int, default=1000)
    ap.add_argument("--user-len", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--conversations", type=int, default=None, help="default 16; quick 8")
    ap.add_argument("--turns", type=int, default=None, help="default 6; quick 4")
    ap.add_argument("--opening-len", type=int, default=200)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    add_threads_option(ap)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true", help="one JSON line per run")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    n_req = args.requests or (32 if args.quick else 256)
    n_conv = args.conversations or (8 if args.quick else 16)
    n_turns = args.turns or (4 if args.quick else 6)
    name = {"tiny": "prefix_cache", "smollm2": "prefix_cache_smollm2"}.get(args.model, "prefix_cache_model")
    out = Path(args.out or RESULTS / f"{name}.json")
    logging.getLogger("ferrokv").setLevel(logging.WARNING)
    set_threads(args.threads)
    t_start = time.perf_counter()

    tmp = None
    if args.model == "tiny":
        tmp = tempfile.TemporaryDirectory(prefix="ferrokv-tiny-")
        model = str(build_tiny_model(Path(tmp.name), args.seed))
    elif args.model == "smollm2":
        model = None
    else:
        model = args.model

    results: dict = {"shared": {}, "chat": {}}

    def report(kind: str, side: str, r: dict) -> None:
        results[kind][side] = r
        if args.json:
            r = {k: v for k, v in r.items() if k != "ttft_by_request"}
            print(json.dumps({"result": f"prefix_cache_{kind}", "cache": side, **r}), flush=True)
        else:
            print(f"{kind:<6} cache {side:<3}: {r['prompt_tokens_computed']:>7} of {r['prompt_tokens']:>7} prompt tokens "
                  f"computed, hit rate {100 * r['hit_rate']:5.1f} %, {r['wall_s']:7.2f} s, "
                  f"{r['output_tokens_per_s']:7.1f} out tok/s, {r['processed_tokens_per_s']:8.1f} tok/s processed, "
                  f"TTFT mean {r['ttft_s']['mean']:.3f} s p50 {r['ttft_s']['p50']:.3f} p99 {r['ttft_s']['p99']:.3f}, "
                  f"{r['steps']} steps, max {r['max_running_seqs']} seqs, peak {r['peak_used_blocks']} blocks",
                  flush=True)

    try:
        engines = {side: make_engine(model, side == "on", args.max_num_seqs) for side in ("off", "on")}
        vocab = engines["on"].vocab_size
        lo, hi = min(3, vocab - 1), vocab  # avoid the tiny tokenizer's special ids 0-2
        rng = np.random.default_rng(args.seed)
        system = rng.integers(lo, hi, args.prefix_len).tolist()
        prompts = [system + rng.integers(lo, hi, args.user_len).tolist() for _ in range(n_req)]
        openings = [rng.integers(lo, hi, args.opening_len).tolist() for _ in range(n_conv)]
        user_turns = [[rng.integers(lo, hi, args.user_len).tolist() for _ in range(n_turns)] for _ in range(n_conv)]
        # Warm-up (both engines): a few short requests, so that one-time costs are not measured.
        warm = [rng.integers(lo, hi, 40).tolist() for _ in range(4)]
        run_lockstep({side: SharedPrompt(engines[side], warm, 4) for side in engines})
        bs = engines["on"].args.block_size

        for kind in ("shared", "chat"):
            for e in engines.values():
                e.scheduler.reset_prefix_cache()
            if kind == "shared":
                sessions = {side: SharedPrompt(e, prompts, args.max_tokens) for side, e in engines.items()}
            else:
                sessions = {side: Chat(e, openings, user_turns, args.max_tokens) for side, e in engines.items()}
            res = run_lockstep(sessions)
            for side in ("off", "on"):
                report(kind, side, res[side])
            on, off = res["on"], res["off"]
            results[kind].update({
                "speedup_wall": off["wall_s"] / on["wall_s"], "ttft_mean_ratio": off["ttft_s"]["mean"] / on["ttft_s"]["mean"],
                "computed_ratio": off["prompt_tokens_computed"] / on["prompt_tokens_computed"],
                "outputs": agreement(sessions["on"].d.outputs, sessions["off"].d.outputs),
            })
        sh = results["shared"]
        on, off = sh["on"], sh["off"]
        total_len = args.prefix_len + args.user_len
        cacheable = min(args.prefix_len, total_len - 1) // bs * bs  # full blocks of the shared prefix
        ideal = (n_req - 1) * cacheable
        missed = ideal - on["cached_prompt_tokens"]
        s_per_prefill_token = off["wall_s"] / max(1, off["prompt_tokens_computed"])
        sh.update({
            "ideal_cached_tokens": ideal, "ideal_hit_rate": ideal / on["prompt_tokens"],
            "missed_shared_tokens": missed, "missed_requests": on["requests_without_hit"] - 1,
            "missed_cost_s_est": missed * s_per_prefill_token,
            "missed_share_of_computed": missed / max(1, on["prompt_tokens_computed"]),
        })
        summary = sys.stderr if args.json else sys.stdout
        print(f"shared: cache on computes {sh['computed_ratio']:.1f}x fewer prefill tokens, {sh['speedup_wall']:.2f}x "
              f"faster, mean TTFT {sh['ttft_mean_ratio']:.1f}x lower; hit rate {100 * on['hit_rate']:.1f} % vs ideal "
              f"{100 * sh['ideal_hit_rate']:.1f} %: {sh['missed_requests']} request(s) besides the first missed the "
              f"cached prefix ({missed} tokens, {100 * sh['missed_share_of_computed']:.0f} % of what "
              f"the cache-on run computed, ~{sh['missed_cost_s_est']:.2f} s at the cache-off prefill rate); greedy "
              f"outputs identical: {sh['outputs']['identical_outputs']}/{sh['outputs']['of']}", file=summary)
        ch = results["chat"]
        print(f"chat: cache on computes {ch['computed_ratio']:.1f}x fewer prefill tokens, {ch['speedup_wall']:.2f}x "
              f"faster, mean TTFT {ch['ttft_mean_ratio']:.1f}x lower; greedy outputs identical: "
              f"{ch['outputs']['identical_outputs']}/{ch['outputs']['of']}", file=summary)
        model_name = {"tiny": "tiny random Llama", "smollm2": "SmolLM2-135M-Instruct"}.get(args.model, engines["on"].model_path.name)
        info = {"model": args.model, "model_name": model_name, "tiny_config": TINY if args.model == "tiny" else None,
                "num_blocks": engines["on"].scheduler.num_blocks, "block_size": bs,
                "max_num_batched_tokens": engines["on"].args.max_num_batched_tokens or 2048,
                "torch_threads": torch.get_num_threads()}
    finally:
        if tmp is not None:
            tmp.cleanup()

    out.parent.mkdir(parents=True, exist_ok=True)
    png = out.with_suffix(".png")
    title = (f"Prefix cache on vs off ({info['model_name']}, {args.threads} thread(s)): "
             f"{n_req} requests x ({args.prefix_len} shared + {args.user_len}) tokens; chat {n_conv} x {n_turns} turns")
    plot(results, png, title)
    elapsed = time.perf_counter() - t_start
    out.write_text(json.dumps({"args": vars(args), "info": info, "results": results, "elapsed_s": elapsed}, indent=1))
    print(f"wrote {out} and {png} in {elapsed:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
