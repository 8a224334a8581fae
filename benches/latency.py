#!/usr/bin/env python
"""The limits of paging: what block size costs the scheduler, and what paging does not buy.

(a) **Block-size sweep of the scheduler step** (complements ``block_size_sweep.py``, which
    measures waste and concurrency): the ``decode`` case of ``scheduler_sweep.py`` -- 256 running
    decode sequences, 160-token prompts prefilled and warmed up (untimed) to step 400, so contexts
    are ~560-760 tokens -- for block sizes 8, 16, 32, 64, 128 and 256: µs per step of
    ``ferrokv.Scheduler`` (schedule + arrays + update through Python) and, as the baseline in the
    same run, of the pure-Python scheduler ``_py_scheduler.PyScheduler`` (same batches), plus the
    block-table width (Python's cyclic GC off while timing, as in ``scheduler_sweep.py``; all
    block sizes advance round-robin, 10 steps at a time, so load drift hits them alike).
    B = 16 is the reference row.

(b) **A single short request**, offline, the case where paging and continuous batching have
    nothing to offer: one 32-token prompt, 32 new tokens, greedy (``ignore_eos``), SmolLM2-135M-
    Instruct fp32 on the CPU. ferrokv ``LLM.generate`` (engine defaults) vs transformers
    ``model.generate`` (``max_new_tokens = min_new_tokens = 32``, ``do_sample=False``, its default
    dynamic KV cache) on the same weights, in the same process and thread count (``--threads``,
    default 1): one warm-up run
    each, then ``--runs`` (5) alternating runs; median and min reported with the ratio, whatever
    it is. A separate instrumented ferrokv run splits the latency into the prefill step, the
    decode steps, and the share of each step spent outside the model forward (scheduler, sampler,
    detokenizer, output building). The greedy token ids of both are compared.

Writes ``benches/results/latency.json`` and ``latency.png``. Usage::

    python benches/latency.py              # ~1 min on 2 cores (model load included)
    python benches/latency.py --quick      # 3 runs, 100 timed scheduler steps
    python benches/latency.py --skip-model # only (a)
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scheduler_sweep as ss  # noqa: E402
from _threads import add_threads_option, set_threads  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
BLOCK_SIZES = (8, 16, 32, 64, 128, 256)
SWEEP_SEQS = 256


def report(result: str, data: dict, json_lines: bool, line: str) -> None:
    """One result: a JSON line with `--json`, else the human-readable line."""
    print(json.dumps({"result": result, **data}) if json_lines else line, flush=True)


def block_size_sweep(sizes: list[int], seqs: int, steps: int, seed: int, json_lines: bool) -> list[dict]:
    """Rust and Python decode steps at `seqs` sequences for every block size, interleaved."""
    rows = []
    gc.collect()
    gc.disable()  # as in scheduler_sweep.py (its --gc off default)
    try:
        sides = {b: [ss.Side("rust", "decode", seqs, seed, steps, block_size=b),
                     ss.Side("python", "decode", seqs, seed, steps, block_size=b)] for b in sizes}
        for lo in range(0, steps, ss.CHUNK):  # round-robin: load drift hits every block size alike
            for pair in sides.values():
                for side in pair:
                    side.run(min(ss.CHUNK, steps - lo))
    finally:
        gc.enable()
    for b, pair in sides.items():
        r = {"block_size": b, "seqs": seqs}
        for side in pair:
            r[side.impl] = side.summary()
        r["python_over_rust_p50"] = r["python"]["p50_us"] / r["rust"]["p50_us"]
        rows.append(r)
        report("block_size_step", r, json_lines,
               f"B={b:<4} rust {r['rust']['mean_us']:7.1f} µs/step (p50 {r['rust']['p50_us']:6.1f})  "
               f"python {r['python']['mean_us']:8.1f} µs/step (p50 {r['python']['p50_us']:7.1f})  "
               f"width {r['rust']['mean_width']:.0f}")
    ref = next((r for r in rows if r["block_size"] == 16), rows[0])
    for r in rows:
        r["rust_p50_vs_b16"] = r["rust"]["p50_us"] / ref["rust"]["p50_us"]
        r["python_p50_vs_b16"] = r["python"]["p50_us"] / ref["python"]["p50_us"]
    return rows


def single_request(runs: int, prompt_len: int, new_tokens: int, json_lines: bool) -> dict:
    from transformers import AutoModelForCausalLM

    from ferrokv import LLM, SamplingParams

    llm = LLM(model=None)
    engine = llm.llm_engine
    tok = llm.get_tokenizer()
    text = ("The paged KV cache splits every sequence into fixed-size blocks, so memory is allocated on demand "
            "and shared prefixes are stored once. Explain in simple words why this helps a server that handles "
            "many users at the same time.")
    ids = tok.encode(text)[:prompt_len]
    assert len(ids) == prompt_len, f"the text has only {len(ids)} tokens"
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    hf = AutoModelForCausalLM.from_pretrained(str(engine.model_path), dtype=torch.float32).eval()
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    x = torch.tensor([ids])
    mask = torch.ones_like(x)

    def run_ferrokv() -> tuple[float, list[int]]:
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        dt = time.perf_counter() - t0
        return dt, list(out[0].outputs[0].token_ids)

    def run_hf() -> tuple[float, list[int]]:
        t0 = time.perf_counter()
        with torch.no_grad():
            y = hf.generate(input_ids=x, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                            do_sample=False, pad_token_id=pad)
        dt = time.perf_counter() - t0
        return dt, y[0, prompt_len:].tolist()

    def hf_ttft() -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            hf.generate(input_ids=x, attention_mask=mask, max_new_tokens=1, do_sample=False, pad_token_id=pad)
        return time.perf_counter() - t0

    run_ferrokv()  # warm-up
    run_hf()
    fk, hft = [], []
    fk_ids = hf_ids = None
    for _ in range(runs):  # alternate, so that load from other processes hits both alike
        dt, fk_ids = run_ferrokv()
        fk.append(dt)
        dt, hf_ids = run_hf()
        hft.append(dt)
    hf_first = statistics.median(hf_ttft() for _ in range(runs))

    # Instrumented ferrokv run: time of every step and of the model forward inside it.
    fwd: list[float] = []
    orig = engine.runner.forward

    def timed_forward(inputs):
        t0 = time.perf_counter()
        r = orig(inputs)
        fwd.append(time.perf_counter() - t0)
        return r

    engine.runner.forward = timed_forward
    step_times = []
    try:
        engine.add_request("instrumented", {"prompt_token_ids": ids}, params)
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            engine.step()
            step_times.append(time.perf_counter() - t0)
    finally:
        engine.runner.forward = orig
    overhead = [s - f for s, f in zip(step_times, fwd)]
    res = {
        "prompt_tokens": prompt_len, "new_tokens": new_tokens, "runs": runs, "torch_threads": torch.get_num_threads(),
        "ferrokv_s": fk, "transformers_s": hft,
        "ferrokv_median_s": statistics.median(fk), "transformers_median_s": statistics.median(hft),
        "ferrokv_min_s": min(fk), "transformers_min_s": min(hft),
        "ratio_median": statistics.median(fk) / statistics.median(hft),
        "transformers_ttft_median_s": hf_first,
        "transformers_per_token_s": (statistics.median(hft) - hf_first) / (new_tokens - 1),
        "ferrokv_steps": len(step_times), "ferrokv_prefill_step_s": step_times[0],
        "ferrokv_decode_step_mean_s": float(np.mean(step_times[1:])),
        "ferrokv_forward_share": float(sum(fwd) / sum(step_times)),
        "ferrokv_overhead_per_step_s": float(np.mean(overhead)),
        "ferrokv_decode_forward_mean_s": float(np.mean(fwd[1:])),
        "greedy_ids_identical": fk_ids == hf_ids,
        "first_divergence": next((i for i, (a, b) in enumerate(zip(fk_ids, hf_ids)) if a != b), None),
    }
    line = (f"single request ({prompt_len} prompt + {new_tokens} new tokens, greedy): ferrokv median "
            f"{1e3 * res['ferrokv_median_s']:.1f} ms, transformers {1e3 * res['transformers_median_s']:.1f} ms, "
            f"ratio {res['ratio_median']:.2f}; ferrokv prefill step {1e3 * res['ferrokv_prefill_step_s']:.1f} ms, "
            f"decode step {1e3 * res['ferrokv_decode_step_mean_s']:.1f} ms (forward "
            f"{1e3 * res['ferrokv_decode_forward_mean_s']:.1f} ms, outside the forward "
            f"{1e3 * res['ferrokv_overhead_per_step_s']:.2f} ms); transformers first token "
            f"{1e3 * hf_first:.1f} ms, {1e3 * res['transformers_per_token_s']:.1f} ms per further token; "
            f"greedy ids identical: {res['greedy_ids_identical']}")
    report("single_request", res, json_lines, line)
    return res


def plot(sweep: list[dict], single: dict | None, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = 2 if single else 1
    fig, axes = plt.subplots(1, n, figsize=(6.5 * n, 4.6))
    axes = np.atleast_1d(axes)
    ax = axes[0]
    b = [r["block_size"] for r in sweep]
    ax.plot(b, [r["rust"]["p50_us"] for r in sweep], "-o", label="ferrokv (Rust core), median")
    ax.plot(b, [r["python"]["p50_us"] for r in sweep], "--s", label="pure-Python scheduler, median")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel(f"µs per step (median), {sweep[0]['seqs']} decode sequences")
    ax2 = ax.twinx()
    ax2.plot(b, [r["rust"]["mean_width"] for r in sweep], ":", color="gray", label="block-table width")
    ax2.set_ylabel("block-table width (blocks)", color="gray")
    ax.legend(loc="upper center")
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title("Scheduler step vs block size")
    if single:
        ax = axes[1]
        names = ["ferrokv LLM.generate", "transformers generate"]
        med = [1e3 * single["ferrokv_median_s"], 1e3 * single["transformers_median_s"]]
        ax.bar(names, med, color=["tab:green", "tab:gray"])
        for i, key in enumerate(("ferrokv_s", "transformers_s")):
            ax.plot([i] * len(single[key]), [1e3 * v for v in single[key]], "k.", ms=4)
            ax.text(i, med[i], f"{med[i]:.0f} ms", ha="center", va="bottom")
        ax.set_ylabel("latency (ms), median of runs (dots: every run)")
        ax.set_title(f"One request: {single['prompt_tokens']} prompt + {single['new_tokens']} new tokens, "
                     f"ratio {single['ratio_median']:.2f}")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--block-sizes", default=",".join(map(str, BLOCK_SIZES)))
    ap.add_argument("--seqs", type=int, default=SWEEP_SEQS)
    ap.add_argument("--steps", type=int, default=None, help="timed scheduler steps per block size (default 300; quick 100)")
    ap.add_argument("--runs", type=int, default=None, help="timed runs of the single request (default 5; quick 3)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--skip-model", action="store_true", help="only the scheduler block-size sweep")
    add_threads_option(ap, "torch threads for both engines (default 1: steadier on a shared 2-core machine)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true", help="one JSON line per result")
    ap.add_argument("--out", default=str(RESULTS / "latency.json"))
    args = ap.parse_args(argv)
    steps = args.steps or (100 if args.quick else 300)
    runs = args.runs or (3 if args.quick else 5)
    logging.getLogger("ferrokv").setLevel(logging.WARNING)
    set_threads(args.threads)
    t0 = time.perf_counter()
    sweep = block_size_sweep([int(b) for b in args.block_sizes.split(",")], args.seqs, steps, args.seed, args.json)
    single = None if args.skip_model else single_request(runs, args.prompt_len, args.new_tokens, args.json)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    png = out.with_suffix(".png")
    plot(sweep, single, png)
    elapsed = time.perf_counter() - t0
    out.write_text(json.dumps({"args": vars(args), "block_size_sweep": sweep, "single_request": single,
                               "elapsed_s": elapsed}, indent=1))
    print(f"wrote {out} and {png} in {elapsed:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
