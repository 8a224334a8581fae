"""GPU end-to-end check: tiny random Llama/Qwen3 checkpoints through ``LLM`` on CUDA (float32
greedy equal to transformers' generate on CUDA, with prefix-cache hits; seeded n=2 sampling
independent of the batch order; chat; a bf16 run). Needs transformers on the GPU machine.
Usage: ``PYTHONPATH=python:tests python benches/gpu_e2e_check.py``."""

from __future__ import annotations

import json

import torch
from transformers import AutoModelForCausalLM

from ferrokv import LLM, SamplingParams
from helpers.tiny_models import save_tiny_model
from helpers.tiny_tokenizer import save_tiny_tokenizer


def check(arch: str) -> dict:
    p = save_tiny_model(f"/tmp/ferrokv_gpu_{arch}", arch)
    save_tiny_tokenizer(p)
    prompts = [[(7 * i + 13 * j) % 300 + 3 for j in range(n)] for i, n in enumerate((5, 40, 77, 130))]
    llm = LLM(str(p), device="cuda", dtype="float32", max_model_len=512, kv_cache_memory_bytes=1 << 28)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": x} for x in prompts + prompts], sp, use_tqdm=False)  # 2nd: cache hits
    torch.backends.cuda.matmul.allow_tf32 = False
    hf = AutoModelForCausalLM.from_pretrained(str(p), dtype=torch.float32).cuda().eval()
    hf.generation_config.eos_token_id = None  # as ignore_eos: an EOS is one more token to compare
    equal = []
    for x, o in zip(prompts + prompts, outs):
        ref = hf.generate(torch.tensor([x]).cuda(), max_new_tokens=24, do_sample=False)[0, len(x):].tolist()
        equal.append(list(o.outputs[0].token_ids) == ref)
    s = SamplingParams(temperature=1.0, seed=3, max_tokens=16, n=2, ignore_eos=True)
    a = llm.generate([{"prompt_token_ids": x} for x in prompts], s, use_tqdm=False)
    b = llm.generate([{"prompt_token_ids": x} for x in prompts[::-1]], s, use_tqdm=False)[::-1]
    seeded = [[c.token_ids for c in o.outputs] for o in a] == [[c.token_ids for c in o.outputs] for o in b]
    chat = llm.chat([{"role": "user", "content": "hi there"}], SamplingParams(max_tokens=8), use_tqdm=False)
    bf = LLM(str(p), device="cuda", max_model_len=512, kv_cache_memory_bytes=1 << 28).generate([{"prompt_token_ids": x} for x in prompts], sp,
                                                               use_tqdm=False)
    return {"arch": arch, "greedy_equal_hf": equal, "seeded_batch_independent": seeded,
            "chat_tokens": len(chat[0].outputs[0].token_ids), "bf16_ran": all(len(o.outputs[0].token_ids) == 24 for o in bf),
            "stats": llm.llm_engine.stats()}


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    for arch in ("llama", "qwen3"):
        print(json.dumps(check(arch), default=str), flush=True)
