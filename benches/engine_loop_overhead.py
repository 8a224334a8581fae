#!/usr/bin/env python
"""The engine loop's step period with streaming callers, model stubbed with a forward pass that
takes time: how much of the host's work between forward passes the loop hides.

Workload per size N (``--sizes``, default 64,256): N streaming requests (``DELTA`` outputs, each
step puts an output on every caller's sink, as the OpenAI server's streams do; greedy,
``ignore_eos``, 128-token random prompts, ``--max-tokens`` 80) submitted to an ``EngineLoop``
over ``engine_step.StubbedEngine`` with overlap on and a forward pass that sleeps ``--sleep-ms``
(5) without the GIL, as a GPU would. Timed: the period between successive forward passes (p50
over the steps in which every sequence decodes), against the forward pass alone:
``ratio`` = period / forward (1.0: the host's work between steps is fully hidden), and
``route_us``: the loop's routing of one step's outputs to the sinks (p50).

Prints one JSON object per line per size with ``--json`` (``benches/compare_builds.py``'s
contract: ``--metric period_per_seq_step_us`` or ``ratio``).
Usage: ``python benches/engine_loop_overhead.py --json --sizes 64,256``.
"""

from __future__ import annotations

import argparse
import json
import logging
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine_step  # noqa: E402  (benches/ is not a package)


class StampedModel:
    """The stub model, each forward pass stamped with its start time and token count."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.starts: list[tuple[float, int]] = []

    def __call__(self, input_ids, *args):
        self.starts.append((time.perf_counter(), int(input_ids.shape[0])))
        return self.inner(input_ids, *args)

    def compute_logits(self, hidden):
        return self.inner.compute_logits(hidden)


def run_size(model_dir: Path, n: int, max_tokens: int, sleep_ms: float, seed: int) -> dict:
    import numpy as np
    from ferrokv.engine_loop import EngineLoop
    from ferrokv.outputs import RequestOutputKind
    from ferrokv.sampling_params import SamplingParams

    stub = engine_step.StubbedEngine(model_dir, n, max_tokens, 4096, seed, sleep_s=sleep_ms / 1000, overlap=True)
    stamped = StampedModel(stub.stub)
    stub.engine.runner.model = stamped
    loop = EngineLoop(stub.engine)
    routes: list[float] = []
    route = loop._route

    def timed_route(outputs):
        t0 = time.perf_counter()
        route(outputs)
        if len(outputs) >= n // 2:
            routes.append(time.perf_counter() - t0)

    loop._route = timed_route
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    sinks = [queue.SimpleQueue() for _ in range(n)]
    for i, sink in enumerate(sinks):
        loop.submit(f"r{i}", {"prompt_token_ids": rng.integers(0, engine_step.VOCAB, 128).tolist()}, params, sink=sink)
    for sink in sinks:
        while not sink.get().finished:
            pass
    loop.shutdown()
    starts = stamped.starts
    decode = [i for i, (_, tokens) in enumerate(starts) if tokens == n]
    periods = [starts[i + 1][0] - starts[i][0] for i in decode if i + 1 < len(starts) and starts[i + 1][1] == n]
    if len(periods) < 10:
        raise RuntimeError(f"size {n}: only {len(periods)} steady decode steps; raise --max-tokens")
    period = statistics.median(periods) * 1e6
    return {"size": n, "period_us": round(period, 1), "period_per_seq_step_us": round(period / n, 3),
            "forward_us": sleep_ms * 1000, "ratio": round(period / (sleep_ms * 1000), 3),
            "route_us": round(statistics.median(routes) * 1e6, 1) if routes else None, "steps": len(periods)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="64,256")
    ap.add_argument("--max-tokens", type=int, default=80)
    ap.add_argument("--sleep-ms", type=float, default=5.0)
    ap.add_argument("--quick", action="store_true", help="accepted for compare_builds (the run is short anyway)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    import transformers

    logging.getLogger("ferrokv").setLevel(logging.WARNING)
    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="ferrokv-loop-overhead-") as tmp:
        engine_step.build_model_dir(Path(tmp), 4096)
        for n in (int(s) for s in args.sizes.split(",") if s.strip()):
            row = run_size(Path(tmp), n, args.max_tokens, args.sleep_ms, args.seed)
            print(json.dumps(row) if args.json else
                  f"N={n}: step period {row['period_us']:.0f} us against a {row['forward_us']:.0f} us forward pass "
                  f"(ratio {row['ratio']:.3f}); routing {row['route_us']} us per step", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
