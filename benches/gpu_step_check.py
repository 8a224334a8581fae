#!/usr/bin/env python
"""GPU step check: how long the GPU waits for the host between decode steps, with a real model.

A random-weight Llama shaped as SmolLM2-135M (30 layers, hidden 576, 9 heads / 3 KV heads, vocab
49152; the weights do not change the work) runs steady greedy decode on CUDA through
``LLMEngine`` (Triton attention, bfloat16) at each ``--sizes`` N running sequences (distinct random
128-token prompts, ``ignore_eos``, output kind ``--kind``), with its decode CUDA graphs and
eagerly (``enforce_eager``; graphs serve batches of up to 512). The step job is instrumented with
two CUDA events per step, recorded on the stream before the forward pass and after sampling, so
the GPU's own timeline gives, per step:

- ``device_span_us``: from the step's first kernel to its sampled tokens (the kernels and any
  launch gaps inside the forward pass);
- ``gap_us``: from one step's sampled tokens to the next step's first kernel: the GPU idles
  there while the host reads the tokens, runs ``update`` and plans and stages the next step (what
  staging step N+1 during step N's forward pass would shrink);
- ``gap_share``: gap / (span + gap), the share of the step the GPU waits for the host between steps;
- ``step_us``: the host's wall time per ``step()``, and ``tokens_per_s`` = N / step.

Needs CUDA and transformers; the tokenizer comes from ``--tokenizer`` (a folder; default: the
embedded SmolLM2's, as ``engine_step.build_model_dir`` finds it). Prints one JSON object per line
and writes them to ``$OUT/gpu_step_check.json`` when ``OUT`` is set.
Usage: ``PYTHONPATH=python:tests python benches/gpu_step_check.py --sizes 64,256,512``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine_step  # noqa: E402  (benches/ is not a package)

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
                    rms_norm_eps=1e-5, rope_theta=100000.0, bos_token_id=1, eos_token_id=2)
PROMPT_LEN, MAX_MODEL_LEN = 128, 512


def build_model(directory: Path, tokenizer_dir: str | None) -> str:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(max_position_embeddings=MAX_MODEL_LEN, **SMOLLM2_135M))
    model.to(torch.bfloat16).save_pretrained(str(directory))
    if tokenizer_dir is not None:
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(str(directory))
        return tokenizer_dir
    found = engine_step._smollm2_tokenizer()
    if found is None:
        raise SystemExit("gpu_step_check: no SmolLM2 tokenizer here: pass --tokenizer DIR")
    found[0].save_pretrained(str(directory))
    return found[1]


class EventTimeline:
    """Wraps the engine's step job so that each records a CUDA event before its forward pass and
    one after its sampling, on the engine's stream."""

    def __init__(self, engine) -> None:
        import torch

        self.marks: list[tuple] = []
        job = engine._forward_and_sample

        def timed_job(*args, **kwargs):
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            result = job(*args, **kwargs)
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.marks.append((start, end))
            return result

        engine._forward_and_sample = timed_job

    def spans_and_gaps(self) -> tuple[list[float], list[float]]:
        self.marks[-1][1].synchronize()
        spans = [s.elapsed_time(e) * 1000 for s, e in self.marks]
        gaps = [self.marks[i][1].elapsed_time(self.marks[i + 1][0]) * 1000 for i in range(len(self.marks) - 1)]
        return spans, gaps


def run(model_dir: Path, n: int, graphs: bool, steps: int, seed: int, kind: str) -> dict:
    import numpy as np
    import torch
    from ferrokv.engine import LLMEngine
    from ferrokv.engine_args import EngineArgs
    from ferrokv.outputs import RequestOutputKind
    from ferrokv.sampling_params import SamplingParams

    budget = max(2048, n)
    engine = LLMEngine(EngineArgs(model=str(model_dir), device="cuda", dtype="bfloat16", attention_backend="triton",
                                  max_num_seqs=n, max_num_batched_tokens=budget, max_model_len=MAX_MODEL_LEN,
                                  enable_prefix_caching=False, enforce_eager=not graphs, seed=seed,
                                  kv_cache_memory_bytes=16 << 30))
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_MODEL_LEN - PROMPT_LEN, ignore_eos=True,
                            output_kind=RequestOutputKind[kind.upper()])
    for i in range(n):
        prompt = rng.integers(3, SMOLLM2_135M["vocab_size"], PROMPT_LEN).tolist()
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    # Until every prompt is prefilled (the running decodes take budget first), then a few decodes.
    for _ in range(4 * -(-n * PROMPT_LEN // budget)):
        engine.step()
        if engine.stats()["num_running_seqs"] == n and engine.stats()["prompt_tokens_computed"] == n * PROMPT_LEN:
            break
    else:
        raise RuntimeError(f"size {n}: still prefilling: {engine.stats()}")
    for _ in range(8):
        engine.step()
    timeline = EventTimeline(engine)
    wall = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        wall.append((time.perf_counter() - t0) * 1e6)
    spans, gaps = timeline.spans_and_gaps()
    if engine.stats()["num_running_seqs"] != n:
        raise RuntimeError(f"size {n}: a sequence ended inside the timed window")
    del engine
    torch.cuda.empty_cache()
    step, span, gap = statistics.median(wall), statistics.median(spans), statistics.median(gaps)
    return {"size": n, "kind": kind, "cuda_graphs": graphs, "step_us": round(step, 1),
            "tokens_per_s": round(n / step * 1e6), "device_span_us": round(span, 1), "gap_us": round(gap, 1),
            "gap_share": round(gap / (span + gap), 3), "gap_per_seq_us": round(gap / n, 3), "steps": steps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="64,256,512")
    ap.add_argument("--steps", type=int, default=40, help="timed decode steps per run")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--kind", choices=("final_only", "delta", "cumulative"), default="final_only",
                    help="the requests' output kind (final_only: what LLM.generate asks for; delta: a stream)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_step_check: needs CUDA")
    rows = []
    with tempfile.TemporaryDirectory(prefix="ferrokv-gpu-step-") as tmp:
        tokenizer = build_model(Path(tmp), args.tokenizer)
        for n in (int(s) for s in args.sizes.split(",") if s.strip()):
            for graphs in (True, False):
                row = run(Path(tmp), n, graphs, args.steps, args.seed, args.kind)
                row["tokenizer"] = tokenizer
                print(json.dumps(row), flush=True)
                rows.append(row)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_step_check.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
