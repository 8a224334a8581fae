"""Our Llama-family models on a paged KV cache vs transformers' own forward (fp32 logits).

Each case drives a small hand-written "engine": sequences get blocks from a shuffled free list,
steps mix prefills, prefill chunks and decodes, and every step's logits are compared with
transformers fed the same chunks one sequence at a time through its DynamicCache.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from ferrokv.attention.metadata import AttentionMetadata
from ferrokv.model_loader import load_model
from helpers.kv_caches import paged_kv_caches
from helpers.tiny_models import make_tiny_hf_model

ATOL = 1e-4
BLOCK_SIZE = 4
NUM_BLOCKS = 64

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}

CASES = {
    "llama-gqa": ("llama", dict(num_key_value_heads=2)),
    "llama-mqa-tied": ("llama", dict(num_key_value_heads=1, tie_word_embeddings=True)),
    "llama-head_dim32": ("llama", dict(head_dim=32, num_key_value_heads=2, attention_bias=True)),
    "llama-llama3-rope": ("llama", dict(rope_scaling=LLAMA3, rope_theta=500000.0)),
    "llama-linear-rope": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "llama-dynamic-rope": ("llama", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=16)),
    "llama-yarn-rope": ("llama", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                    "original_max_position_embeddings": 16},
                                      max_position_embeddings=64)),
    "qwen2-yarn-mscale": ("qwen2", dict(rope_scaling={"rope_type": "yarn", "factor": 2.0, "mscale": 1.0,
                                                      "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2,
                                                      "truncate": False}, rope_theta=5e4)),
    "qwen2": ("qwen2", dict(num_key_value_heads=2)),
    "qwen2-window": ("qwen2", dict(num_key_value_heads=1, sliding_window=8, max_window_layers=1)),
    "qwen3": ("qwen3", dict(num_key_value_heads=2, head_dim=32, tie_word_embeddings=True)),
    "qwen3-bias": ("qwen3", dict(num_key_value_heads=4, attention_bias=True)),
    "mistral-window": ("mistral", dict(num_key_value_heads=2, sliding_window=8)),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (transformers model, our model loaded from its save_pretrained folder); built once."""
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            arch, kw = CASES[name]
            hf = make_tiny_hf_model(arch, **kw)
            path = tmp_path_factory.mktemp(name)
            hf.save_pretrained(path)
            cache[name] = (hf, load_model(path, attn_backend="torch"))
        return cache[name]

    return get


def _reset_hf_rope(hf) -> None:
    """transformers' dynamic RoPE keeps state across calls; start every sequence from scratch."""
    rot = hf.model.rotary_emb
    if hasattr(rot, "original_inv_freq"):
        rot.inv_freq = rot.original_inv_freq.clone()
        rot.max_seq_len_cached = rot.original_max_seq_len


def hf_chunk_logits(hf, chunks: list[list[int]]) -> list[torch.Tensor]:
    """transformers' logits for one sequence fed chunk by chunk through a DynamicCache."""
    from transformers import DynamicCache

    _reset_hf_rope(hf)
    cache = DynamicCache(config=hf.config)
    out, past = [], 0
    with torch.no_grad():
        for chunk in chunks:
            ids = torch.tensor([chunk])
            pos = torch.arange(past, past + len(chunk))[None]
            res = hf(input_ids=ids, position_ids=pos, cache=cache, use_cache=True)
            out.append(res.logits[0].float())
            past += len(chunk)
    return out


@dataclass
class _Seq:
    tokens: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)


class PagedEngine:
    """Minimal test driver: block allocation from a shuffled free list + metadata per step."""

    def __init__(self, model, seed: int = 0, num_blocks: int = NUM_BLOCKS, block_size: int = BLOCK_SIZE):
        self.model = model
        self.block_size = block_size
        self.kv = paged_kv_caches(model, num_blocks, block_size)
        self.free = list(range(1, num_blocks))  # block 0 is the null block
        random.Random(seed).shuffle(self.free)
        self.seqs: dict[int, _Seq] = {}

    def step(self, work: list[tuple[int, list[int]]], pad: int = 0) -> list[torch.Tensor]:
        """work = [(seq_id, new tokens)]; returns the logits rows [len(new), vocab] per entry."""
        q_lens, s_lens, tables, ids = [], [], [], []
        for sid, new in work:
            s = self.seqs.setdefault(sid, _Seq())
            s.tokens += new
            while len(s.blocks) * self.block_size < len(s.tokens):
                s.blocks.append(self.free.pop())
            q_lens.append(len(new))
            s_lens.append(len(s.tokens))
            tables.append(s.blocks)
            ids += new
        meta = AttentionMetadata.build(q_lens, s_lens, tables, self.block_size, num_tokens=len(ids) + pad)
        input_ids = torch.tensor(ids + [0] * pad, dtype=torch.long)
        hidden = self.model(input_ids, meta.positions(), self.kv, meta)
        assert hidden.shape == (len(ids) + pad, self.model.config.hidden_size)
        logits = self.model.compute_logits(hidden)
        assert logits.dtype == torch.float32
        out, start = [], 0
        for q in q_lens:
            out.append(logits[start : start + q])
            start += q
        return out


def _prompts(n_list: list[int], seed: int) -> list[list[int]]:
    g = random.Random(seed)
    return [[g.randrange(3, 400) for _ in range(n)] for n in n_list]


@pytest.mark.parametrize("name", list(CASES))
def test_prefill_then_decode_matches_transformers(models, name):
    hf, ours = models(name)
    prompts = _prompts([5, 13, 21], seed=1)  # 21 > window 8 and > dynamic max_position 16
    eng = PagedEngine(ours, seed=2)
    # (a) one batched prefill of ragged prompts (plus 3 padding rows, which must be ignored)
    got = eng.step(list(enumerate(prompts)), pad=3)
    steps = 4
    refs, generated = [], []
    for i, p in enumerate(prompts):
        # greedy continuation according to transformers, then its logits chunk by chunk
        chunks, toks = [p], []
        logits = hf_chunk_logits(hf, chunks)
        for _ in range(steps):
            toks.append(int(logits[-1][-1].argmax()))
            chunks.append([toks[-1]])
            logits = hf_chunk_logits(hf, chunks)
        refs.append(logits)
        generated.append(toks)
    for i in range(3):
        torch.testing.assert_close(got[i], refs[i][0], atol=ATOL, rtol=0)
        assert int(got[i][-1].argmax()) == generated[i][0]
    # (b) decode steps, all sequences batched
    for step in range(steps):
        got = eng.step([(i, [generated[i][step]]) for i in range(3)])
        for i in range(3):
            torch.testing.assert_close(got[i], refs[i][step + 1], atol=ATOL, rtol=0)
            if step + 1 < steps:
                assert int(got[i][-1].argmax()) == generated[i][step + 1]


@pytest.mark.parametrize("name", list(CASES))
def test_chunked_prefill_mixed_with_decode(models, name):
    """(c) a 22-token prompt fed in 3 chunks while another sequence prefills and then decodes."""
    hf, ours = models(name)
    long, short = _prompts([22, 6], seed=3)
    chunks = [long[:9], long[9:15], long[15:]]
    ref_long = hf_chunk_logits(hf, chunks)
    ref_short_prefill = hf_chunk_logits(hf, [short])
    t1 = int(ref_short_prefill[0][-1].argmax())
    ref_short = hf_chunk_logits(hf, [short, [t1], [7]])
    eng = PagedEngine(ours, seed=4)
    got = eng.step([(0, chunks[0]), (1, short)])
    torch.testing.assert_close(got[0], ref_long[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(got[1], ref_short[0], atol=ATOL, rtol=0)
    got = eng.step([(1, [t1]), (0, chunks[1])])  # decode first, chunk second: order must not matter
    torch.testing.assert_close(got[0], ref_short[1], atol=ATOL, rtol=0)
    torch.testing.assert_close(got[1], ref_long[1], atol=ATOL, rtol=0)
    got = eng.step([(0, chunks[2]), (1, [7])], pad=2)
    torch.testing.assert_close(got[0], ref_long[2], atol=ATOL, rtol=0)
    torch.testing.assert_close(got[1], ref_short[2], atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["mistral-window", "qwen2-window"])
def test_sliding_window_is_exercised(models, name):
    """Guard against a vacuous window test: without the window the logits must differ."""
    hf, ours = models(name)
    (p,) = _prompts([21], seed=5)
    with_window = PagedEngine(ours).step([(0, p)])[0]
    saved = [layer.self_attn.sliding_window for layer in ours.model.layers]
    try:
        for layer in ours.model.layers:
            layer.self_attn.sliding_window = None
        without = PagedEngine(ours).step([(0, p)])[0]
    finally:
        for layer, w in zip(ours.model.layers, saved):
            layer.self_attn.sliding_window = w
    assert (with_window[:8] - without[:8]).abs().max() < ATOL  # inside the window: identical
    assert (with_window[8:] - without[8:]).abs().max() > 1e-3


@pytest.mark.parametrize("arch, key", [
    *((arch, "tie_word_embeddings") for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                                  "MistralForCausalLM")),
    ("LlamaForCausalLM", "attention_bias"), ("LlamaForCausalLM", "mlp_bias"), ("Qwen3ForCausalLM", "attention_bias"),
    ("Qwen2ForCausalLM", "use_sliding_window"), ("Qwen3ForCausalLM", "use_sliding_window"),
])
def test_a_flag_that_is_not_a_bool_is_refused_naming_it(arch, key):
    """The string "false" would be truthy: a flag the architecture reads must be true, false or
    null (its default)."""
    from ferrokv.models import MODEL_REGISTRY

    base = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2)
    cls = MODEL_REGISTRY[arch]
    with pytest.raises(ValueError, match=f"{key} must be true or false, got 'false'"):
        cls.parse_config({**base, key: "false"})
    assert cls.parse_config({**base, key: None}) == cls.parse_config({**base, key: False})
    assert cls.parse_config({**base, "tie_word_embeddings": True}).tie_word_embeddings is True


def test_swish_is_silu():
    from ferrokv.models import MODEL_REGISTRY

    base = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2)
    assert MODEL_REGISTRY["LlamaForCausalLM"].parse_config({**base, "hidden_act": "swish"}).hidden_act == "swish"
    with pytest.raises(ValueError, match="hidden_act 'gelu_new' is not supported"):
        MODEL_REGISTRY["LlamaForCausalLM"].parse_config({**base, "hidden_act": "gelu_new"})


def test_window_config_resolution():
    """Which layers get a window, as transformers resolves it."""
    from ferrokv.models import MODEL_REGISTRY

    base = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=3, num_attention_heads=2)
    qwen2 = MODEL_REGISTRY["Qwen2ForCausalLM"]
    assert qwen2.parse_config({**base, "sliding_window": 4, "use_sliding_window": False}).sliding_windows == (None,) * 3
    cfg = qwen2.parse_config({**base, "sliding_window": 4, "use_sliding_window": True, "max_window_layers": 1})
    assert cfg.sliding_windows == (None, 4, 4)
    # No sliding_window key: Qwen2Config's and Qwen3Config's default 4096; null: none.
    assert qwen2.parse_config({**base, "use_sliding_window": True, "max_window_layers": 1}).sliding_windows == \
        (None, 4096, 4096)
    assert qwen2.parse_config({**base, "use_sliding_window": True, "sliding_window": None}).sliding_windows == \
        (None,) * 3
    qwen3 = MODEL_REGISTRY["Qwen3ForCausalLM"]
    assert qwen3.parse_config({**base, "use_sliding_window": True, "max_window_layers": 2}).sliding_windows == \
        (None, None, 4096)
    cfg = qwen3.parse_config({**base, "sliding_window": 4, "use_sliding_window": True,
                              "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]})
    assert cfg.sliding_windows == (4, None, 4)
    assert cfg.head_dim == 128  # Qwen3Config's default when config.json has no head_dim
    mistral = MODEL_REGISTRY["MistralForCausalLM"]
    assert mistral.parse_config({**base, "sliding_window": None}).sliding_windows == (None,) * 3
    assert mistral.parse_config({**base, "sliding_window": 5}).sliding_windows == (5,) * 3
    assert mistral.parse_config(base).sliding_windows == (4096,) * 3  # MistralConfig's default when absent
    cfg = mistral.parse_config({**base, "sliding_window": 5,
                                "layer_types": ["full_attention", "sliding_attention", "full_attention"]})
    assert cfg.sliding_windows == (None, 5, None)  # Ministral's alternating layers
    for bad in (["full_attention"], ["full_attention", "chunked_attention", "full_attention"]):
        with pytest.raises(ValueError, match="layer_types"):
            mistral.parse_config({**base, "sliding_window": 5, "layer_types": bad})
    llama = MODEL_REGISTRY["LlamaForCausalLM"]
    # transformers 4.x layout: rope_theta at the top level, rope_scaling with "type"
    cfg = llama.parse_config({**base, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert (cfg.rope.rope_type, cfg.rope.theta, cfg.rope.factor) == ("linear", 5e5, 2.0)
    with pytest.raises(ValueError, match="longrope"):
        llama.parse_config({**base, "rope_parameters": {"rope_type": "longrope", "factor": 2.0}})
    # vLLM's default max_model_len: the positions times a linear/dynamic/yarn factor, and the rule
    # its refusal names.
    for rope, want, rule in (
            ({"rope_type": "linear", "factor": 4.0}, 64, "config.json's max_position_embeddings times its RoPE factor 4"),
            ({"rope_type": "dynamic", "factor": 2.0}, 32, "max_position_embeddings times its RoPE factor 2"),
            ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}, 32,
             "the RoPE's original_max_position_embeddings times its factor 4"),
            (LLAMA3, 16, "config.json's max_position_embeddings"), ({}, 16, "config.json's max_position_embeddings")):
        cfg = llama.parse_config({**base, "max_position_embeddings": 16, "rope_scaling": rope})
        assert cfg.default_max_model_len == want and cfg.rope.max_position_embeddings == 16, rope
        assert rule in cfg.default_max_model_len_rule and (rule.endswith("embeddings") or "factor" in rule), rope
    # vLLM's other context keys: the smallest one wins (the RoPE keeps max_position_embeddings), a
    # model_max_length overrides them; bad values are named.
    for extra, want, key in (({"max_sequence_length": 12, "seq_length": 14}, 12, "max_sequence_length"),
                             ({"n_positions": 40}, 16, "max_position_embeddings"),
                             ({"seq_len": 12, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, 24, "seq_len"),
                             ({"max_seq_len": 8, "model_max_length": 20}, 20, "model_max_length")):
        cfg = llama.parse_config({**base, "max_position_embeddings": 16, **extra})
        assert (cfg.default_max_model_len, cfg.rope.max_position_embeddings) == (want, 16), extra
        assert f"config.json's {key}" in cfg.default_max_model_len_rule, extra
    with pytest.raises(ValueError, match="config.json: seq_length must be a positive integer, got 0"):
        llama.parse_config({**base, "seq_length": 0})
    for rope, kind in (({"rope_type": "yarn", "original_max_position_embeddings": 8}, "yarn"),
                       ({"type": "dynamic"}, "dynamic")):
        # transformers refuses these too (and would fail loading the tokenizer, which reads config.json)
        with pytest.raises(ValueError, match=f"config.json: rope_type '{kind}' needs a 'factor'"):
            llama.parse_config({**base, "rope_scaling": rope})
    # llama3 and yarn: a top-level original_max_position_embeddings wins (transformers'
    # standardize_rope_params); none anywhere: the model's positions.
    for rope in (LLAMA3, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}):
        cfg = llama.parse_config({**base, "rope_scaling": rope, "original_max_position_embeddings": 4})
        assert cfg.rope.original_max_position_embeddings == 4, rope
    for bad, name in (({"rope_type": "yarn", "factor": 0}, "rope factor"), ({**LLAMA3, "factor": -1}, "rope factor"),
                      ({"rope_type": "linear", "factor": "x"}, "rope factor"),
                      ({"rope_type": "default", "rope_theta": -5}, "rope_theta")):
        with pytest.raises(ValueError, match=f"config.json: {name} must be a number > 0"):
            llama.parse_config({**base, "rope_scaling": bad})
    no_orig = {k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"}
    cfg = llama.parse_config({**base, "max_position_embeddings": 16, "rope_scaling": no_orig})
    assert cfg.rope.original_max_position_embeddings == 16


def test_rope_scaling_beside_a_5x_rope_theta_keeps_it_and_warns(caplog):
    """A 4.x-style rope_scaling added to a config saved by transformers 5 (its rope_theta inside
    rope_parameters): the theta stays, with a warning that transformers would drop it."""
    from ferrokv.models import MODEL_REGISTRY

    base = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
            "vocab_size": 100, "max_position_embeddings": 64}
    llama = MODEL_REGISTRY["LlamaForCausalLM"]
    both = {**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
            "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    with caplog.at_level("WARNING", logger="ferrokv"):
        cfg = llama.parse_config(both)
    assert (cfg.rope.rope_type, cfg.rope.theta, cfg.rope.factor) == ("linear", 1e6, 2.0)
    assert "keeps rope_parameters' rope_theta=1000000.0" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="ferrokv"):  # the 4.x layout, or a theta in the scaling: no doubt
        llama.parse_config({**base, "rope_theta": 1e6, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
        llama.parse_config({**both, "rope_scaling": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5.0}})
    assert "rope_theta" not in caplog.text


def test_malformed_config_fields_are_refused_by_name():
    """Values transformers refuses (or that would fail only at the first step, or silently change
    attention) are a ValueError naming the field at load; mlp_bias is a Llama-only key."""
    from ferrokv.models import MODEL_REGISTRY

    base = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=3, num_attention_heads=2)
    llama, qwen2, mistral = (MODEL_REGISTRY[a] for a in ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"))
    qwen_window = {**base, "sliding_window": 4, "use_sliding_window": True}
    for cls, bad, field in (
        (llama, {"head_dim": 15}, "head_dim must be even"),
        (llama, {"head_dim": -4}, "head_dim must be a positive integer"),
        (llama, {"num_key_value_heads": 0}, "num_key_value_heads must be a positive integer"),
        (llama, {"rms_norm_eps": -1}, "rms_norm_eps must be a number > 0"),
        (llama, {"rms_norm_eps": None}, "rms_norm_eps must be a number > 0"),
        (mistral, {"sliding_window": 0}, "sliding_window must be a positive integer"),
        (mistral, {"sliding_window": -4}, "sliding_window must be a positive integer"),
        (mistral, {"sliding_window": 8.5}, "sliding_window must be a positive integer"),
        (qwen2, {**qwen_window, "sliding_window": 0}, "sliding_window must be a positive integer"),
        (qwen2, {**qwen_window, "use_sliding_window": "false"}, "use_sliding_window must be true or false"),
        (qwen2, {**qwen_window, "max_window_layers": None}, "max_window_layers must be a positive integer"),
    ):
        with pytest.raises(ValueError, match=f"config.json: {field}"):
            cls.parse_config({**base, **bad})
    assert llama.parse_config({**base, "num_key_value_heads": None}).num_key_value_heads == 2
    assert qwen2.parse_config({**qwen_window, "max_window_layers": 0}).sliding_windows == (4,) * 3
    assert qwen2.parse_config({**qwen_window, "use_sliding_window": None}).sliding_windows == (None,) * 3
    assert llama.parse_config({**base, "mlp_bias": True}).mlp_bias
    for cls in (qwen2, mistral, MODEL_REGISTRY["Qwen3ForCausalLM"]):
        assert not cls.parse_config({**base, "mlp_bias": True}).mlp_bias, cls


def test_absent_max_position_embeddings_takes_the_transformers_class_default():
    """vLLM's default context comes from the transformers config, whose class fills in what
    config.json leaves out."""
    import transformers

    from ferrokv.models import MODEL_REGISTRY

    base = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=3, num_attention_heads=2)
    for name, cls in MODEL_REGISTRY.items():
        want = getattr(transformers, name.replace("ForCausalLM", "Config"))().max_position_embeddings
        cfg = cls.parse_config(base)
        assert cfg.max_position_embeddings == cfg.rope.max_position_embeddings == want, name
        assert cls.parse_config({**base, "max_position_embeddings": 64}).max_position_embeddings == 64


def test_mistral_layer_types_matches_transformers(tmp_path):
    """A Mistral config.json with Ministral's layer_types: the window on the marked layers only,
    as transformers computes it (it loads such a checkpoint as Ministral)."""
    import json

    from transformers import AutoModelForCausalLM

    make_tiny_hf_model("mistral", num_key_value_heads=2, sliding_window=4).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "layer_types": ["full_attention", "sliding_attention"]}))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    # transformers saves it back as MinistralForCausalLM (model_type "ministral"): the same model.
    hf.save_pretrained(tmp_path / "resaved")
    assert json.loads((tmp_path / "resaved" / "config.json").read_text())["architectures"] == ["MinistralForCausalLM"]
    (p,) = _prompts([21], seed=3)
    for folder in (tmp_path, tmp_path / "resaved"):
        ours = load_model(folder, attn_backend="torch")
        assert [layer.self_attn.sliding_window for layer in ours.model.layers] == [None, 4]
        torch.testing.assert_close(PagedEngine(ours).step([(0, p)])[0], hf_chunk_logits(hf, [p])[0], atol=ATOL,
                                   rtol=0)


def test_triton_backend_end_to_end(models, tmp_path):
    """The same model through the Triton backend (interpreter on CPU) matches the torch backend."""
    from ferrokv.attention import get_attention_backend

    _, ours = models("llama-gqa")
    long, short = _prompts([11, 5], seed=6)
    results = {}
    for backend in ("torch", "triton"):
        ours.set_attn_backend(get_attention_backend(backend))
        try:
            eng = PagedEngine(ours, seed=7)
            a = eng.step([(0, long[:6]), (1, short)], pad=1)
            b = eng.step([(0, long[6:]), (1, [9])])
            c = eng.step([(0, [3]), (1, [4])])  # pure decode -> the decode kernel
            results[backend] = [t for step in (a, b, c) for t in step]
        finally:
            ours.set_attn_backend("torch")
    for x, y in zip(results["torch"], results["triton"]):
        torch.testing.assert_close(x, y, atol=ATOL, rtol=0)
