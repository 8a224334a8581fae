"""GPU check: one prepared script for a CUDA machine (none is needed to import it).

1. Kernel correctness on the GPU: every Triton kernel against its torch reference over a grid of
   dtypes, block sizes, GQA ratios and ragged lengths (and the pytest kernel suite, which runs on
   CUDA when TRITON_INTERPRET is unset).
2. Decode-attention bandwidth: batch 64 at contexts 512, 2k and 8k; bytes = the K/V actually read;
   reported in GB/s and as % of the H200's 4.8 TB/s peak.
3. Sampling on the GPU (``sampling_check``): one batch of rows with given uniforms (the seeded
   rows, whose draws the scheduler derives), rows drawing from the sampler's generator on the
   logits' device, and greedy rows; the given-uniform and greedy rows take the same tokens on the
   device as on the CPU and never depend on the generator; the generator's seed replays the other
   rows; every token is one the row may sample. Then unseeded and seeded requests through ``LLM``
   on the GPU. Its CPU-side logic runs in the test suite (``sampling_check("cpu")``,
   tests/test_sampler.py).
4. End-to-end tokens/s with the embedded SmolLM2-135M on the GPU.

Writes JSON to ``$OUT/gpu_check.json`` when ``OUT`` is set (else benches/results/).
Usage: ``python benches/gpu_check.py [--skip-pytest] [--skip-e2e]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

PEAK_BYTES_PER_S = 4.8e12  # H200 HBM3e


def _rand_cache(num_blocks: int, bs: int, hkv: int, d: int, dtype: torch.dtype, dev: str):
    k = torch.randn(num_blocks, bs, hkv, d, device=dev, dtype=dtype)
    v = torch.randn(num_blocks, bs, hkv, d, device=dev, dtype=dtype)
    return k, v


def kernel_grid(dev: str) -> list[dict]:
    from ferrokv.kernels import (
        paged_attention_decode,
        paged_attention_decode_reference,
        paged_attention_prefill,
        paged_attention_prefill_reference,
    )

    out = []
    g = torch.Generator(device="cpu").manual_seed(0)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for bs in (8, 16, 32):
            for h, hkv in ((8, 8), (8, 4), (8, 2), (12, 2)):
                d = 64
                lens = torch.tensor([1, bs, 3 * bs, 97, 200], dtype=torch.int32)
                nb = int(sum((int(x) + bs - 1) // bs for x in lens)) + 1
                k, v = _rand_cache(nb, bs, hkv, d, dtype, dev)
                perm = torch.randperm(nb - 1, generator=g) + 1
                mb = int((lens.max() + bs - 1) // bs)
                bt = torch.zeros(len(lens), mb, dtype=torch.int32)
                c = 0
                for i, L in enumerate(lens.tolist()):
                    n = (L + bs - 1) // bs
                    bt[i, :n] = perm[c:c + n]
                    c += n
                bt, sl = bt.to(dev), lens.to(dev)
                q = torch.randn(len(lens), h, d, device=dev, dtype=dtype)
                got = paged_attention_decode(q, k, v, bt, sl, d**-0.5)
                # The reference runs on CPU copies in fp32 (it never mutates its inputs).
                kc, vc, btc, slc = k.float().cpu(), v.float().cpu(), bt.cpu(), sl.cpu()
                ref = paged_attention_decode_reference(q.float().cpu(), kc, vc, btc, slc, d**-0.5)
                tol = 2e-3 if dtype == torch.float32 else 3e-2
                err = (got.float().cpu() - ref).abs().max().item()
                out.append({"kernel": "decode", "dtype": str(dtype), "block_size": bs, "heads": h, "kv_heads": hkv,
                            "max_abs_err": err, "ok": err < tol})
                # Chunked prefill: the last 7 tokens of every sequence are new.
                ql = torch.clamp(lens, max=7)
                qsl = torch.zeros(len(lens) + 1, dtype=torch.int32)
                qsl[1:] = torch.cumsum(ql, 0)
                qp = torch.randn(int(qsl[-1]), h, d, device=dev, dtype=dtype)
                got = paged_attention_prefill(qp, k, v, bt, qsl.to(dev), sl, int(ql.max()), d**-0.5)
                ref = paged_attention_prefill_reference(qp.float().cpu(), kc, vc, btc, qsl, slc, d**-0.5)
                err = (got.float().cpu() - ref).abs().max().item()
                out.append({"kernel": "prefill", "dtype": str(dtype), "block_size": bs, "heads": h, "kv_heads": hkv,
                            "max_abs_err": err, "ok": err < tol})
    return out


def decode_bandwidth(dev: str) -> list[dict]:
    import triton.testing

    from ferrokv.kernels import paged_attention_decode

    res = []
    batch, h, hkv, d, bs, dtype = 64, 32, 8, 128, 16, torch.bfloat16
    for ctx in (512, 2048, 8192):
        nb_per = ctx // bs
        nb = batch * nb_per + 1
        k, v = _rand_cache(nb, bs, hkv, d, dtype, dev)
        bt = (torch.randperm(nb - 1, device=dev)[: batch * nb_per] + 1).view(batch, nb_per).to(torch.int32)
        sl = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        q = torch.randn(batch, h, d, device=dev, dtype=dtype)
        ms = triton.testing.do_bench(lambda: paged_attention_decode(q, k, v, bt, sl, d**-0.5), warmup=25, rep=100)
        read = 2 * batch * ctx * hkv * d * k.element_size() + q.numel() * q.element_size() * 2
        gbs = read / (ms / 1e3) / 1e9
        res.append({"context": ctx, "batch": batch, "heads": h, "kv_heads": hkv, "head_dim": d, "ms": ms,
                    "GB_per_s": gbs, "pct_of_peak": 100 * gbs * 1e9 / PEAK_BYTES_PER_S})
        print(f"decode ctx={ctx}: {ms:.3f} ms, {gbs:.0f} GB/s ({res[-1]['pct_of_peak']:.1f}% of 4.8 TB/s)", flush=True)
    return res


def sampling_check(dev: str) -> dict:
    """Rows with given uniforms, rows drawing from the sampler's generator and greedy rows in one
    batch on ``dev``, against the same batch on the CPU; ``ok`` when every check held."""
    from ferrokv.sampler import Sampler, SamplingMetadata, SamplingRow, sample_async
    from ferrokv.sampling_params import SamplingParams as SP

    rows_n, vocab = 48, 3000
    # (params, given uniform?, logits scale): flat rows with top-p take the full-sort fallback.
    kinds = [(SP(), False, 3.0), (SP(temperature=0.0), False, 3.0), (SP(top_k=5), False, 3.0),
             (SP(top_p=0.9), True, 3.0), (SP(min_p=0.1, temperature=0.7), False, 3.0),
             (SP(top_p=0.9, temperature=1.2), True, 0.1), (SP(top_k=50, top_p=0.8, min_p=0.01), True, 3.0),
             (SP(temperature=0.8, presence_penalty=0.5, repetition_penalty=1.3), True, 3.0),
             (SP(temperature=0.0, frequency_penalty=1.0), False, 3.0)]
    kind = [kinds[i % len(kinds)] for i in range(rows_n)]
    g = torch.Generator(device="cpu").manual_seed(0)
    scale = torch.tensor([k[2] for k in kind]).unsqueeze(1)
    logits_cpu = torch.randn(rows_n, vocab, generator=g) * scale
    uniforms = torch.rand(rows_n, generator=g, dtype=torch.float64).tolist()
    history = torch.randint(0, vocab, (rows_n, 6), generator=g).tolist()
    rows = [SamplingRow(p, history[i][:3], history[i][3:], uniforms[i] if given else None)
            for i, (p, given, _) in enumerate(kind)]
    given = [i for i, k in enumerate(kind) if k[1]]
    greedy = [i for i, k in enumerate(kind) if k[0].is_greedy]
    unseeded = [i for i, k in enumerate(kind) if not k[1] and not k[0].is_greedy]

    def draw(device: str, seed: int) -> list[int]:
        md = SamplingMetadata.build(rows, vocab, device=device)
        return Sampler(seed=seed, device=device)(logits_cpu.to(device), md).token_ids.tolist()

    first, again, other_seed, cpu = draw(dev, 7), draw(dev, 7), draw(dev, 8), draw("cpu", 7)
    md = SamplingMetadata.build(rows, vocab, device=dev)
    pending = sample_async(logits_cpu.to(dev), md, torch.Generator(device=dev).manual_seed(7))
    argmax = logits_cpu.argmax(-1).tolist()
    top5 = logits_cpu.topk(5, dim=-1).indices.tolist()
    mismatched = [i for i in given + greedy if first[i] != cpu[i]]
    checks = {
        "given_and_greedy_match_cpu": not mismatched,
        "given_ignore_generator": all(first[i] == other_seed[i] for i in given + greedy),
        "unseeded_replay": all(first[i] == again[i] for i in unseeded),
        "unseeded_follow_seed": any(first[i] != other_seed[i] for i in unseeded),
        "async_equals_sync": pending.token_ids.device.type == torch.device(dev).type
                             and pending.result().token_ids.tolist() == first,
        "greedy_is_argmax": all(first[i] == argmax[i] for i in greedy if not kind[i][0].has_penalties),
        "top_k_in_top5": all(first[i] in top5[i] for i, k in enumerate(kind) if k[0].top_k == 5),
        "in_vocab": all(0 <= t < vocab for t in first),
        "given_vary": len({first[i] for i in given}) > 1,
        "unseeded_vary": len({first[i] for i in unseeded}) > 1,
    }
    return {"device": dev, "checks": checks, "mismatched_rows": mismatched, "ok": all(checks.values())}


def sampling_e2e() -> dict:
    """Unseeded and seeded sampling through LLM on the GPU: runs, and a seed replays."""
    from ferrokv import LLM, SamplingParams

    llm = LLM(device="cuda", max_model_len=512)
    prompts = [{"prompt_token_ids": list(range(100 + i, 140 + i))} for i in range(8)]
    unseeded = llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True),
                            use_tqdm=False)
    seeded = [llm.generate(prompts, SamplingParams(temperature=1.0, seed=5, max_tokens=16, ignore_eos=True),
                           use_tqdm=False) for _ in range(2)]
    checks = {
        "unseeded_ran": all(len(o.outputs[0].token_ids) == 16 for o in unseeded),
        "seed_replays": [o.outputs[0].token_ids for o in seeded[0]] == [o.outputs[0].token_ids for o in seeded[1]],
    }
    return {"checks": checks, "ok": all(checks.values())}


def e2e(num_prompts: int = 64, max_tokens: int = 128) -> dict:
    from ferrokv import LLM, SamplingParams

    llm = LLM(device="cuda", max_model_len=2048)
    prompts = [{"prompt_token_ids": list(range(100 + i, 228 + i))} for i in range(num_prompts)]
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up / compile
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    return {"prompts": num_prompts, "max_tokens": max_tokens, "seconds": dt,
            "output_tokens_per_s": num_prompts * max_tokens / dt}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip-pytest", action="store_true")
    ap.add_argument("--skip-e2e", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device")
    os.environ.pop("TRITON_INTERPRET", None)
    report: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    if not args.skip_pytest:
        root = Path(__file__).resolve().parents[1]
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", str(root / "tests" / "test_kernels.py")],
                           capture_output=True, text=True)
        report["pytest_kernels"] = {"returncode": r.returncode, "tail": r.stdout[-2000:]}
        print(r.stdout[-800:], flush=True)
    grid = kernel_grid("cuda")
    report["kernel_grid"] = {"cases": len(grid), "failed": [g for g in grid if not g["ok"]]}
    print(f"kernel grid: {len(grid)} cases, {len(report['kernel_grid']['failed'])} failed", flush=True)
    report["sampling"] = sampling_check("cuda")
    print(f"sampling: {report['sampling']}", flush=True)
    report["decode_bandwidth"] = decode_bandwidth("cuda")
    if not args.skip_e2e:
        report["sampling_e2e"] = sampling_e2e()
        print(f"sampling e2e: {report['sampling_e2e']}", flush=True)
    if not args.skip_e2e:
        report["e2e"] = e2e()
        print(f"e2e: {report['e2e']['output_tokens_per_s']:.0f} output tokens/s", flush=True)
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(__file__).resolve().parent / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "kernel_grid"} | {"grid_failed": len(report["kernel_grid"]["failed"])})[:4000])


if __name__ == "__main__":
    main()
