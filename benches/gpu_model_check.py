"""GPU model check without transformers: ferrokv's own models on CUDA, the Triton attention backend
against the torch backend (same weights, same paged caches), through chunked prefill and batched
greedy decode; float32 must pick the same tokens as the torch backend on the CPU; in bf16/fp16 the
Triton backend's logits for the first step (the same inputs for every run) must be as close to the
CPU's as the torch backend's on the GPU are (tokens then diverge at near-ties in either). Needs only torch, triton, numpy and ferrokv's extension,
so it runs on a bare GPU machine (``benches/gpu_check.py`` covers kernels, bandwidth and sampling).

Usage: ``python benches/gpu_model_check.py``; writes ``$OUT/gpu_model_check.json`` when OUT is set.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

if os.environ.get("GPU_CHECK_DEVICE") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from ferrokv.attention.metadata import AttentionMetadata  # noqa: E402
from ferrokv.kv_cache import KVCacheSpec, PagedKVCache  # noqa: E402
from ferrokv.models import resolve_model_class  # noqa: E402

BASE = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=512,
            vocab_size=1000, max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False)
CONFIGS = {
    "llama-gqa4": {"architectures": ["LlamaForCausalLM"], **BASE},
    "llama-hd128-mha": {"architectures": ["LlamaForCausalLM"], **BASE, "num_attention_heads": 2,
                        "num_key_value_heads": 2, "tie_word_embeddings": True},
    "qwen3-hd64": {"architectures": ["Qwen3ForCausalLM"], **BASE, "head_dim": 64, "num_key_value_heads": 1},
    "mistral-window24": {"architectures": ["MistralForCausalLM"], **BASE, "sliding_window": 24},
    "qwen2-bias-hd80": {"architectures": ["Qwen2ForCausalLM"], **BASE, "hidden_size": 320, "num_attention_heads": 4,
                        "num_key_value_heads": 2},
}
PROMPT_LENS = (5, 37, 64, 100)
BLOCK, CHUNK, DECODE = 16, 32, 24
DEVICE = os.environ.get("GPU_CHECK_DEVICE", "cuda")  # "cpu": a dry run of the script (Triton interpreted)


def _models(cfg: dict, dtype: torch.dtype) -> dict[str, torch.nn.Module]:
    cls = resolve_model_class(cfg)
    torch.manual_seed(0)
    ref = cls(cfg, attn_backend="torch")
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.08 if p.dim() > 1 else 0.02).add_(1.0 if p.dim() == 1 else 0.0)
    state = ref.state_dict()
    out = {"cpu-torch": ref.to(torch.float32).eval()}
    for backend in ("torch", "triton"):
        m = cls(cfg, attn_backend=backend)
        m.load_state_dict(state)
        out[f"cuda-{backend}"] = m.to(device=DEVICE, dtype=dtype).eval()
    return out


def _generate(model: torch.nn.Module, prompts: list[list[int]]) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Chunked prefill (CHUNK tokens a step, with the prior context) then batched greedy decode."""
    dev = next(model.parameters()).device
    cfg = model.config
    dtype = next(model.parameters()).dtype
    total = max(map(len, prompts)) + DECODE + 1
    per_seq = (total + BLOCK - 1) // BLOCK
    kv = PagedKVCache(KVCacheSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, BLOCK, dtype),
                      1 + per_seq * len(prompts), 0, dev).layers
    tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq))[::-1] for i in range(len(prompts))]  # scattered
    tokens = [list(p) for p in prompts]
    done = [0] * len(prompts)  # tokens whose KV is written
    out, logits_seen = [[] for _ in prompts], []
    while min(len(o) for o in out) < DECODE:
        q = [min(CHUNK, len(t) - d) for t, d in zip(tokens, done)]
        ids = [t[d:d + n] for t, d, n in zip(tokens, done, q)]
        meta = AttentionMetadata.build(q, [d + n for d, n in zip(done, q)], tables, BLOCK, device=dev)
        with torch.no_grad():
            hidden = model(torch.tensor(sum(ids, []), device=dev), meta.positions(), kv, meta)
            last = torch.tensor(meta.query_start_loc_host[1:] - 1, device=dev)
            logits = model.compute_logits(hidden[last]).float()
        logits_seen.append(logits.cpu())
        nxt = logits.argmax(-1).tolist()
        for i, n in enumerate(q):
            done[i] += n
            if done[i] == len(tokens[i]):  # the prompt (or the last token) is in: decode on
                tokens[i].append(nxt[i])
                out[i].append(nxt[i])
    return [o[:DECODE] for o in out], logits_seen


def check(name: str, cfg: dict, dtype: torch.dtype) -> dict:
    prompts = [[(7 * i + 13 * j) % cfg["vocab_size"] for j in range(n)] for i, n in enumerate(PROMPT_LENS)]
    models = _models(cfg, dtype)
    runs = {k: _generate(m, prompts) for k, m in models.items()}
    ref_tokens, ref_logits = runs["cpu-torch"]
    report: dict = {"config": name, "dtype": str(dtype).replace("torch.", "")}
    for k in ("cuda-torch", "cuda-triton"):
        toks, logits = runs[k]
        agree = sum(a == b for x, y in zip(toks, ref_tokens) for a, b in zip(x, y)) / sum(map(len, ref_tokens))
        report[k] = {"token_agreement_with_cpu": round(agree, 4), "same_tokens_as_cpu": toks == ref_tokens,
                     "first_step_logit_err": (logits[0] - ref_logits[0]).abs().max().item()}
    report["triton_equals_cuda_torch"] = runs["cuda-triton"][0] == runs["cuda-torch"][0]
    if dtype == torch.float32:
        report["ok"] = report["cuda-triton"]["same_tokens_as_cpu"] and report["cuda-torch"]["same_tokens_as_cpu"]
    else:
        err = {k: report[k]["first_step_logit_err"] for k in ("cuda-torch", "cuda-triton")}
        report["ok"] = err["cuda-triton"] <= 2 * err["cuda-torch"] + 1e-2
    return report


def main() -> int:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    results, t0 = [], time.perf_counter()
    out_dir = Path(os.environ.get("OUT", Path(__file__).parent / "results"))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for name, cfg in CONFIGS.items():
            try:
                r = check(name, cfg, dtype)
            except Exception as e:  # report and go on: one broken config must not hide the rest
                r = {"config": name, "dtype": str(dtype), "ok": False, "error": f"{type(e).__name__}: {e}"}
            results.append(r)
            print(json.dumps(r), flush=True)
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "gpu_model_check.json").write_text(json.dumps(results, indent=1))
    all_ok = all(r["ok"] for r in results)
    print(json.dumps({"all_ok": all_ok, "seconds": time.perf_counter() - t0}), flush=True)
    return 0 if all_ok else 1


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    sys.exit(main())
