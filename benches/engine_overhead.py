#!/usr/bin/env python
"""Host overhead of the engine step in steady decode, by stage, model stubbed; and its overlap
with a forward pass that takes time.

Workload (``benches/engine_step.py``'s): N requests (``--sizes``, default 64,256,1024) with
distinct random 128-token prompts, all running together, greedy, ``ignore_eos``, output kind
``--kind`` (default ``final_only``: what ``LLM.generate`` asks for; ``delta``/``cumulative``
stream an output per sequence per step). The model is ``engine_step.StubModel``: the forward
pass returns at once and the logits are rows of one preallocated ``[N, 512]`` tensor, so what is
timed is the host work around the model (on a GPU sampling over the real vocabulary is device
work; the stub keeps it small here).

Per N, reported (µs per step and per sequence-step, p50 over ``--window`` steps):

- ``short`` / ``long``: windows starting at output length 20 and ``--long`` (2000), with the
  engine's ``StepProfile`` splitting each step into ``schedule``, ``inputs`` (sampling metadata
  + model inputs), ``sampling`` (the step job's sampler), ``update`` (``Scheduler.update``),
  ``detokenize`` (the text layer's results) and ``outputs`` (``RequestOutput`` building), plus
  ``wait`` (for the step job: forward + sampling + the hand-off) and the ``total``;
  ``critical`` = total - the overlapped work (the previous step's text and outputs, which run
  while a forward pass is in flight), measured with overlap on; ``long_over_short`` compares
  the p50 totals;
- ``serial``: the short window of the same engine with overlap off, timed interleaved with the
  other two: everything runs on one thread and nothing waits, so its step is the total host CPU
  of a step (``host_cpu_per_seq_step_us``), detokenization included (reported by stage too);
- ``core``: the Rust scheduler alone (``schedule`` + ``update`` of a fresh ``Scheduler`` with
  N sequences in steady decode, no text layer), per sequence-step;
- ``overlap``: the same engine with a forward pass that sleeps ``--sleep-ms`` (5) without the
  GIL, overlap on: p50 step time against ``max(forward, host)``, where host is the p50 total of
  the zero-time stub, timed interleaved with it; ``ratio`` = step / max(forward, host) (1.0 =
  fully hidden), and ``ratio_measured_forward`` with the forward pass as the step job timed it
  (the sleep's overshoot and the worker thread's wake-up are the machine's).

``--device cuda`` runs the same engines on a GPU: the stub's logits live there (sampling is device
work), and the sleeping forward pass is a kernel that spins on the GPU while the host goes on (its
own length is the forward's). ``--tokenizer DIR`` hands a machine without the embedded GGUF the
SmolLM2 tokenizer files.

The short and long windows run on engines side by side, timed interleaved in blocks (each engine
in turn: 2 untimed steps that bring its data back into the caches, then 5 timed ones), so drift
of a shared machine falls on all alike while every timed step finds its engine warm.

Steady decode is checked on every timed step (N decode tokens, no prefill). Timings drift
between runs on a shared machine: compare within one run, or with ``benches/compare_builds.py``
(the ``short.per_seq_step_us``-style metrics; ``--sizes``/``--quick`` as it passes them).

Usage::

    python benches/engine_overhead.py --sizes 64,256 --quick
    python benches/engine_overhead.py --json --sizes 256,1024
    python benches/engine_overhead.py --json --sizes 256,1024 --device cuda --tokenizer tok/
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine_step  # noqa: E402  (benches/ is not a package)
from _threads import add_threads_option, set_threads  # noqa: E402

STAGES = ("schedule", "inputs", "sampling", "update", "detokenize", "outputs", "wait", "overlap", "finish")


def _setup(model_dir: Path, n: int, kind: str, long_len: int, window: int, seed: int, **kw):
    import numpy as np
    from ferrokv.sampling_params import SamplingParams

    _, kind_kwargs = engine_step.output_kind_param(kind)
    max_tokens = engine_step.max_tokens_for(n, long_len, _steps_per_window(window))
    max_model_len = max(4096, engine_step.PROMPT_LEN + max_tokens)
    stub = engine_step.StubbedEngine(model_dir, n, max_tokens, max_model_len, seed, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kind_kwargs)
    rng = np.random.default_rng(seed)
    prompts: set[tuple[int, ...]] = set()
    while len(prompts) < n:
        prompts.add(tuple(int(x) for x in rng.integers(0, engine_step.VOCAB, engine_step.PROMPT_LEN)))
    for i, p in enumerate(sorted(prompts)):
        stub.engine.add_request(f"r{i}", {"prompt_token_ids": list(p)}, params)
    steps = 0
    while stub.last_prefill_tokens or stub.last_decode_tokens != n or steps < 3:
        stub.engine.step()
        steps += 1
        if steps > 10 * n + 100:
            raise RuntimeError(f"size {n}: still prefilling after {steps} steps")
    return stub, steps


# Interleaving: each engine in turn runs WARM_STEPS untimed steps (its data back in the caches,
# as for an engine that steps without pause), then up to BLOCK_STEPS timed ones.
WARM_STEPS, BLOCK_STEPS = 2, 5


def _steps_per_window(window: int) -> int:
    """Steps an engine takes in one of ``_windows``' windows, warm-up steps included."""
    return window + WARM_STEPS * -(-window // BLOCK_STEPS)


def _windows(stubs: list, n: int, window: int) -> list[tuple[list[float], dict]]:
    """Times ``window`` steps of each engine in ``stubs``, interleaved in blocks (module docs),
    so that the machine's drift falls on all of them alike."""
    from ferrokv.step_profile import StepProfile

    gc.collect()
    times: list[list[float]] = [[] for _ in stubs]
    profiles: list[list] = [[] for _ in stubs]
    while len(times[0]) < window:
        block = min(BLOCK_STEPS, window - len(times[0]))
        for stub, ts, ps in zip(stubs, times, profiles):
            engine = stub.engine
            _advance(stub, WARM_STEPS)
            for _ in range(block):
                engine.profile = StepProfile()
                t0 = time.perf_counter()
                engine.step()
                ts.append(time.perf_counter() - t0)
                ps.append(engine.profile)
                engine.profile = None
                if stub.last_prefill_tokens or stub.last_decode_tokens != n:
                    raise RuntimeError(f"size {n}: a timed step was not a pure decode "
                                       f"({stub.last_prefill_tokens} prefill, {stub.last_decode_tokens} decode tokens)")
    result = []
    for ts, ps in zip(times, profiles):
        stages = {s: statistics.median(getattr(p, s) for p in ps) * 1e6 for s in STAGES}
        stages["forward"] = statistics.median(p.forward for p in ps) * 1e6
        stages["sampling"] = statistics.median(p.sampling for p in ps) * 1e6
        result.append((ts, stages))
    return result


def _summary(times: list[float], stages: dict, n: int) -> dict:
    total = statistics.median(times) * 1e6
    # The work that overlaps a forward pass in flight: the previous step's text and outputs.
    critical = total - stages["overlap"]
    return {
        "p50_us": round(total, 1), "per_seq_step_us": round(total / n, 3),
        "critical_us": round(critical, 1), "critical_per_seq_step_us": round(critical / n, 3),
        "stages_us": {k: round(v, 1) for k, v in stages.items()},
        "stages_per_seq_step_us": {k: round(v / n, 4) for k, v in stages.items()},
        "steps": len(times),
    }


def _advance(stub, steps: int) -> None:
    for _ in range(steps):
        stub.engine.step()


def core_alone(n: int, steps: int) -> float:
    """µs per sequence-step of the Rust scheduler alone in steady decode (schedule + update)."""
    import numpy as np
    from ferrokv._core import Scheduler

    sched = Scheduler(n * 40 + 1, block_size=engine_step.BLOCK_SIZE, max_num_seqs=n,
                      max_num_batched_tokens=n + 2048, max_model_len=4096, enable_prefix_caching=False)
    rng = np.random.default_rng(0)
    for i in range(n):
        sched.add_request(i, rng.integers(0, engine_step.VOCAB, engine_step.PROMPT_LEN).astype(np.int64), 500,
                          ignore_eos=True)
    tokens = np.full(n, 7, dtype=np.int32)
    for _ in range(40):  # prefill
        out = sched.schedule()
        sched.update(out, tokens[: out.num_rows])
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        sched.update(out, tokens[: out.num_rows])
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6 / n


def run_size(model_dir: Path, n: int, kind: str, long_len: int, window: int, seed: int, sleep_ms: float,
             device: str = "cpu") -> dict:
    # Two engines side by side, one at the short output length and one at the long, timed
    # interleaved; then the sleeping forward pass beside a zero-time one, also interleaved.
    long_stub, prefill_steps = _setup(model_dir, n, kind, long_len, window, seed, overlap=True, device=device)
    _advance(long_stub, max(0, long_len - prefill_steps))
    short_stub, prefill_steps = _setup(model_dir, n, kind, long_len, window, seed, overlap=True, device=device)
    _advance(short_stub, max(0, engine_step.SHORT_START - prefill_steps))
    serial_stub, prefill_steps = _setup(model_dir, n, kind, long_len, window, seed, overlap=False,
                                  device=device)
    _advance(serial_stub, max(0, engine_step.SHORT_START - prefill_steps))
    (short_t, short_st), (long_t, long_st), (serial_t, serial_st) = _windows(
        [short_stub, long_stub, serial_stub], n, window)
    short, long_, serial = (_summary(t, st, n) for t, st in ((short_t, short_st), (long_t, long_st),
                                                             (serial_t, serial_st)))
    del long_stub, serial_stub
    gc.collect()

    slept, _ = _setup(model_dir, n, kind, engine_step.SHORT_START + 2 * _steps_per_window(window) + 1, window, seed,
                      overlap=True, sleep_s=sleep_ms / 1000, device=device)
    (ov_t, ov_st), (host_t, _) = _windows([slept, short_stub], n, window)
    del slept, short_stub
    gc.collect()
    step = statistics.median(ov_t) * 1e6
    host = statistics.median(host_t) * 1e6
    bound = max(sleep_ms * 1000, host)
    # What the sleeping forward pass took, timed in the step job: the timer's overshoot and the
    # thread's wake-up are the machine's, not host work (both ratios are reported). On a GPU the
    # job only queues the spinning kernel, so its own length stands.
    forward_measured = ov_st["forward"] if device == "cpu" else sleep_ms * 1000
    return {
        "size": n, "kind": kind, "short": short, "long": long_, "serial": serial,
        "host_cpu_per_seq_step_us": serial["per_seq_step_us"],
        "long_over_short": round(long_["p50_us"] / short["p50_us"], 3),
        "core_per_seq_step_us": round(core_alone(n, window), 4),
        "overlap": {"forward_us": sleep_ms * 1000, "host_us": round(host, 1), "step_us": round(step, 1),
                    "ratio": round(step / bound, 3), "forward_measured_us": round(forward_measured, 1),
                    "ratio_measured_forward": round(step / max(forward_measured, host), 3)},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="64,256,1024")
    ap.add_argument("--kind", choices=engine_step.KINDS, default="final_only")
    ap.add_argument("--long", type=int, default=None, help="output length of the long window (2000; 200 with --quick)")
    ap.add_argument("--window", type=int, default=None, help="timed steps per window (30; 10 with --quick)")
    ap.add_argument("--sleep-ms", type=float, default=5.0, help="the sleeping forward pass of the overlap variant")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--device", default="cpu", help="the engine's device (cuda: the stub's logits and the sleeping "
                    "forward pass are on the GPU)")
    ap.add_argument("--tokenizer", default=None, help="a tokenizer folder (default: the embedded SmolLM2's)")
    add_threads_option(ap)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    long_len = args.long if args.long is not None else (200 if args.quick else 2000)
    window = args.window if args.window is not None else (10 if args.quick else 30)
    if long_len < engine_step.SHORT_START + window:
        ap.error(f"--long must be >= {engine_step.SHORT_START + window}")

    import transformers

    set_threads(args.threads)
    logging.getLogger("ferrokv").setLevel(logging.WARNING)
    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="ferrokv-engine-overhead-") as tmp:
        model_dir = Path(tmp)
        max_tokens = max(engine_step.max_tokens_for(n, long_len, _steps_per_window(window)) for n in sizes)
        max_positions = max(4096, engine_step.PROMPT_LEN + max_tokens)
        tokenizer = engine_step.build_model_dir(model_dir, max_positions, args.tokenizer)
        for n in sizes:
            row = run_size(model_dir, n, args.kind, long_len, window, args.seed, args.sleep_ms, args.device)
            row["device"] = args.device
            row["tokenizer"] = tokenizer
            if args.json:
                print(json.dumps(row), flush=True)
                continue
            s, ov = row["short"], row["overlap"]
            print(f"N={n} kind={args.kind}: step {s['p50_us']:.0f} us ({s['per_seq_step_us']:.3f} us/seq-step), "
                  f"critical {s['critical_per_seq_step_us']:.3f}, host CPU {row['host_cpu_per_seq_step_us']:.3f} us/seq-step; long/short {row['long_over_short']:.2f}; "
                  f"core alone {row['core_per_seq_step_us']:.3f} us/seq-step", flush=True)
            print("   stages us/seq-step: " + ", ".join(f"{k} {v:.3f}" for k, v in s["stages_per_seq_step_us"].items()))
            print(f"   overlap: forward {ov['forward_us']:.0f} us (measured {ov['forward_measured_us']:.0f}), host "
                  f"{ov['host_us']:.0f} us -> step {ov['step_us']:.0f} us (ratio {ov['ratio']:.2f}; "
                  f"{ov['ratio_measured_forward']:.2f} against the measured forward)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
