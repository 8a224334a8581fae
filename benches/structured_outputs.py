#!/usr/bin/env python
"""Structured outputs on the embedded SmolLM2-135M (CPU, fp32): what a grammar costs and what it
buys, against the same requests without one in the same run.

Reported:

- ``compile``: a bounded JSON schema compiled cold (ms), then a cache hit (µs); wrapping the
  tokenizer for llguidance once (s);
- ``mask``: per step at R grammar rows over the 49,152-token vocabulary, the bitmask fill
  (llguidance's threads, no GIL) and its application to the logits, µs per row;
- ``e2e``: 16 chat requests asking for a person as JSON, sampled (temperature 0.7, ``--seed`` 1,
  up to 96 tokens), without and with the schema: output tokens/s, how many ended with ``stop``,
  and how many outputs parse as JSON.

torch runs with ``--threads`` (default 1, see ``_threads.py``): the mask's application and the
model are torch ops, and 2 threads on a shared 2-core machine made them vary several-fold.
``--quick`` is a smoke run: rows 1 and 8, 4 requests. It prints; it writes no file.

Usage::

    python benches/structured_outputs.py [--json] [--quick] [--threads 1] [--rows 1,8,32,128] [--requests 16]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _threads import add_threads_option, set_threads  # noqa: E402  (benches/ is not a package)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
    },
    "required": ["name", "age", "hobbies"],
}


def _timed(fn, repeat: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat


def compile_and_mask(llm, rows: list[int]) -> dict:
    import numpy as np
    import torch

    from ferrokv.structured_outputs import GrammarCompiler, GrammarRows, StructuredOutputsParams, grammar_key

    engine = llm.llm_engine
    t0 = time.perf_counter()
    compiler = GrammarCompiler(engine.tokenizer, engine.vocab_size, engine.eos_token_ids[0])
    wrap_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = compiler.compile(StructuredOutputsParams(json=SCHEMA))
    cold_ms = (time.perf_counter() - t0) * 1e3
    hit_us = _timed(lambda: compiler.compile(StructuredOutputsParams(json=SCHEMA)), 20) * 1e6
    mask = {}
    state = GrammarRows(compiler.vocab_size)
    for r in rows:
        for i in range(r):
            state.register(i, grammar)
        matchers = state.matchers_of(grammar_key(np.arange(r), np.zeros(r, dtype=np.int64)))
        logits = torch.randn(r, engine.vocab_size)
        bitmask = state.fill(matchers)
        fill = _timed(lambda: state.fill(matchers), 10)
        apply = _timed(lambda: GrammarRows.apply(logits, torch.arange(r), bitmask), 10)
        mask[r] = {"fill_us_per_row": round(fill / r * 1e6, 1), "apply_us_per_row": round(apply / r * 1e6, 1)}
        for i in range(r):
            state.release(i)
    return {"wrap_tokenizer_s": round(wrap_s, 3), "compile_cold_ms": round(cold_ms, 2),
            "compile_cached_us": round(hit_us, 1), "mask": mask}


def end_to_end(llm, num_requests: int, seed: int = 1) -> dict:
    from ferrokv import SamplingParams, StructuredOutputsParams

    msgs = [[{"role": "user", "content": f"Describe person number {i} as JSON with name, age and hobbies."}]
            for i in range(num_requests)]
    out = {}
    for label, so in (("plain", None), ("schema", StructuredOutputsParams(json=SCHEMA))):
        params = SamplingParams(temperature=0.7, seed=seed, max_tokens=96, structured_outputs=so)
        llm.chat(msgs[:2], params, use_tqdm=False)  # warm-up (and the compile)
        t0 = time.perf_counter()
        outs = llm.chat(msgs, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        valid = 0
        for o in outs:
            try:
                json.loads(o.outputs[0].text)
                valid += 1
            except ValueError:
                pass
        out[label] = {"tokens_per_s": round(tokens / dt, 1), "tokens": tokens, "seconds": round(dt, 2),
                      "stopped": sum(o.outputs[0].finish_reason == "stop" for o in outs), "valid_json": valid,
                      "requests": num_requests}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=None, help="grammar rows per mask measurement (default 1,8,32,128; quick 1,8)")
    ap.add_argument("--requests", type=int, default=None, help="end-to-end requests (default 16; quick 4)")
    ap.add_argument("--seed", type=int, default=1, help="the sampling seed of the end-to-end requests")
    ap.add_argument("--quick", action="store_true", help="smoke run: rows 1,8 and 4 requests")
    add_threads_option(ap)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = args.rows or ("1,8" if args.quick else "1,8,32,128")
    requests = args.requests or (4 if args.quick else 16)
    logging.getLogger("ferrokv").setLevel(logging.WARNING)
    set_threads(args.threads)
    from ferrokv import LLM

    llm = LLM(dtype="float32", device="cpu", max_model_len=512, num_kv_blocks=512, block_size=16)
    result = {"compile": compile_and_mask(llm, [int(r) for r in rows.split(",")]),
              "e2e": end_to_end(llm, requests, args.seed), "torch_threads": args.threads}
    if args.json:
        print(json.dumps(result))
        return 0
    c = result["compile"]
    print(f"tokenizer wrap {c['wrap_tokenizer_s']} s; compile cold {c['compile_cold_ms']} ms, cached {c['compile_cached_us']} us")
    for r, m in c["mask"].items():
        print(f"  R={r}: fill {m['fill_us_per_row']} us/row, apply {m['apply_us_per_row']} us/row")
    for label, e in result["e2e"].items():
        print(f"{label}: {e['tokens_per_s']} tok/s ({e['tokens']} tokens), stop {e['stopped']}/{e['requests']}, "
              f"valid JSON {e['valid_json']}/{e['requests']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
