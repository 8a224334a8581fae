"""Scheduler demo: drives the Rust core with a simulated load (no model) and prints what each
step looks like — batch sizes, KV utilization and prefix-cache hits.

Run: ``python -m ferrokv.demo [--requests N] [--blocks N] [--seed S]``.
"""

from __future__ import annotations

import argparse

import numpy as np

from ferrokv import Scheduler


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--blocks", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.requests < 0:
        ap.error(f"--requests must be >= 0, got {args.requests}")
    try:  # a bad flag, or a cache too small for the load, is a usage error (exit status 2)
        _run(args)
    except ValueError as e:
        ap.error(str(e))


def _run(args: argparse.Namespace) -> None:
    rng = np.random.default_rng(args.seed)
    s = Scheduler(
        args.blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=4096,
    )
    system_prompt = rng.integers(1000, 30000, size=96)  # shared by a third of the requests
    arrivals = np.cumsum(rng.exponential(0.5, size=args.requests)).astype(int)
    prompt_lens = np.clip(rng.lognormal(np.log(120), 0.8, args.requests), 4, 1024).astype(int)
    output_lens = np.clip(rng.lognormal(np.log(150), 0.8, args.requests), 1, 1024).astype(int)

    next_req, step, tokens_total = 0, 0, 0
    print(f"{'step':>5} {'seqs':>5} {'tokens':>6} {'prefill':>7} {'decode':>6} {'waiting':>7} "
          f"{'KV used':>8} {'U_eff':>6} {'prefix hits':>11}")
    while next_req < args.requests or s.has_unfinished():
        while next_req < args.requests and arrivals[next_req] <= step:
            body = rng.integers(1000, 30000, size=prompt_lens[next_req])
            prompt = np.concatenate([system_prompt, body]) if next_req % 3 == 0 else body
            s.add_request(next_req, prompt, int(output_lens[next_req]), ignore_eos=True)
            next_req += 1
        out = s.schedule()
        sampled = rng.integers(1000, 30000, size=out.num_rows).astype(np.int32)
        s.update(out, sampled)
        tokens_total += out.num_tokens
        if step % 25 == 0:
            st = s.stats()
            used = st["num_used_blocks"]
            u_eff = st["num_used_token_slots"] / max(1, used * st["block_size"])
            print(f"{step:>5} {out.num_seqs:>5} {out.num_tokens:>6} {out.num_prefill_tokens:>7} "
                  f"{out.num_decode_tokens:>6} {s.num_waiting:>7} "
                  f"{used / (st['num_blocks'] - 1):>7.1%} {u_eff:>6.1%} {st['cached_prompt_tokens']:>11}")
        step += 1
    st = s.stats()
    print(
        f"\n{step} steps, {tokens_total} tokens scheduled, {st['generated_tokens']} generated, "
        f"{st['preemptions']} preemptions, prefix-cache hits {st['first_admission_cached_tokens']} of "
        f"{st['prefix_cache_queried_tokens']} looked up, max running {st['max_running_seqs']}"
    )


if __name__ == "__main__":
    main()
