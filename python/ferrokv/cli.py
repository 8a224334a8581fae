"""The ``ferrokv`` command: ``ferrokv generate [--model DIR] PROMPT...`` and ``ferrokv chat``.

Both use the embedded SmolLM2-135M-Instruct unless ``--model`` is given, and take the engine
flags vLLM users know (``--max-num-seqs``, ``--block-size``, ...) plus the sampling flags.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for writing clear code.",
    "Explain in one paragraph what a hash table is.",
    "Write a haiku about the sea.",
    "What is the capital of France? Answer in one word.",
    "Why is the sky blue?",
    "List the planets of the solar system.",
    "What does a compiler do?",
]


def _engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="local HF folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    g.add_argument("--tokenizer", default=None)
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    g.add_argument("--device", default="auto")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV cache")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"])
    g.add_argument("--num-cpu-blocks", type=int, default=0)
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    g.add_argument("--seed", type=int, default=0)


def _sampling_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--stop", action="append", default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")


def _llm(args: argparse.Namespace) -> Any:
    from ferrokv.engine import EngineArgs
    from ferrokv.llm import LLM

    kw = {name: getattr(args, name) for name in EngineArgs.field_names() if hasattr(args, name)}
    return LLM(**kw)


def _params(args: argparse.Namespace) -> Any:
    from ferrokv.sampling_params import SamplingParams

    return SamplingParams(
        n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty, max_tokens=args.max_tokens, min_tokens=args.min_tokens,
        stop=args.stop, ignore_eos=args.ignore_eos, seed=args.sampling_seed,
    )


def _generate(args: argparse.Namespace) -> int:
    prompts = args.prompts or DEFAULT_PROMPTS
    params = _params(args)
    llm = _llm(args)
    engine = llm.llm_engine
    if args.raw:
        inputs: list[Any] = list(prompts)
    else:
        tok = llm.get_tokenizer()
        inputs = []
        for p in prompts:
            ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
            inputs.append({"prompt": p, "prompt_token_ids": list(ids["input_ids"] if hasattr(ids, "keys") else ids)})
    t0 = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=not args.quiet)
    dt = time.perf_counter() - t0
    for p, o in zip(prompts, outs):
        print(f"\n### {p}")
        for c in o.outputs:
            prefix = f"[{c.index}] " if len(o.outputs) > 1 else ""
            print(f"{prefix}{c.text.strip()}")
    st = engine.stats()
    gen = sum(len(c.token_ids) for o in outs for c in o.outputs)
    kv_total = st["num_blocks"] - 1
    hit_rate = st["cached_prompt_tokens"] / max(1, st["prompt_tokens"])
    print(
        f"\n--- {len(outs)} requests, {gen} tokens generated in {dt:.1f}s: {gen / dt:.1f} tokens/s "
        f"({(gen + st['prompt_tokens']) / dt:.1f} tokens/s with prompts)\n"
        f"--- KV cache: peak {engine.peak_used_blocks}/{kv_total} blocks "
        f"({engine.peak_used_blocks / kv_total:.1%}) of {st['block_size']} tokens, "
        f"{st['preemptions']} preemptions\n"
        f"--- prefix cache: {st['cached_prompt_tokens']} of {st['prompt_tokens']} prompt tokens "
        f"served from cache ({hit_rate:.1%})"
    )
    return 0


def _chat(args: argparse.Namespace) -> int:
    llm = _llm(args)
    params = _params(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("you> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            return 0
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return 0
        messages.append({"role": "user", "content": line})
        out = llm.chat(messages, params, use_tqdm=False)[0]
        answer = out.outputs[0].text.strip()
        messages.append({"role": "assistant", "content": answer})
        print(f"assistant> {answer}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ferrokv", description="ferrokv LLM inference engine")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate completions for prompts (default: a few examples)")
    g.add_argument("prompts", nargs="*")
    g.add_argument("--raw", action="store_true", help="send prompts as plain text, without the chat template")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    _engine_flags(g)
    _sampling_flags(g)
    c = sub.add_parser("chat", help="interactive chat (reads lines from stdin)")
    c.add_argument("--system", default=None)
    _engine_flags(c)
    _sampling_flags(c)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose or args.command == "generate" else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        return _generate(args) if args.command == "generate" else _chat(args)
    except ValueError as e:
        print(f"ferrokv: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
