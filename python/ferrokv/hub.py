"""Models and tokenizers by Hugging Face Hub id (``org/name``), through ``huggingface_hub``.

Invariants:
- The local Hugging Face cache comes first: a snapshot already there that holds what ferrokv
  reads (a model's config and weights, a tokenizer's files; nothing missing from the file list
  the cache keeps) is used without any network request, so a cached model loads the same online
  and offline. Otherwise, online, ``snapshot_download`` fills in what is missing (a cache that
  transformers' ``AutoTokenizer`` or ``AutoModel`` left half filled, an interrupted download),
  and a Hub that does not answer leaves the cached snapshot in use if it holds those; offline
  (``HF_HUB_OFFLINE``), a partial snapshot with a config is used as it is.
- The cache is ``download_dir`` when given, else what ``huggingface_hub`` reads from the environment
  (``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``); ``revision`` is a
  branch, tag or commit hash (default: ``main``).
- Only the files ferrokv reads are fetched (``ALLOW_PATTERNS``: configs, safetensors, tokenizer
  files, chat templates; for a tokenizer, ``TOKENIZER_PATTERNS``: no weights), never
  ``.gguf``/``.onnx`` duplicates of the weights, nor what ``IGNORE_PATTERNS`` leaves out
  (subfolders such as Llama's ``original/`` checkpoint, Mistral's ``consolidated.safetensors``:
  vLLM skips both); PyTorch ``.bin`` weights only for a model that has no safetensors
  (``PT_PATTERNS``, vLLM's fallback).
- Every failure is a ``ValueError`` naming the field (``model``/``tokenizer``) and the id, and, when
  nothing is cached offline, the command that fetches it.
Costs: a cache hit is a few ``stat`` calls; a download is the size of the allowed files.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger("ferrokv")

__all__ = ["ALLOW_PATTERNS", "IGNORE_PATTERNS", "PT_PATTERNS", "TOKENIZER_FILES", "TOKENIZER_PATTERNS", "has_tokenizer",
           "hub_offline", "looks_like_hub_id", "snapshot"]

ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
TOKENIZER_PATTERNS = ["*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja"]  # a tokenizer's: no weights
IGNORE_PATTERNS = ["*/*", "consolidated*.safetensors"]  # ferrokv reads top-level HF-layout files only
PT_PATTERNS = ["*.bin"]
# A folder holds a tokenizer when it has one of these (AutoTokenizer reads the rest from them).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_TRUE = {"1", "ON", "YES", "TRUE"}


def looks_like_hub_id(name: str) -> bool:
    """True for ``org/name`` or ``name`` as the Hub spells them; a path the user wrote as one
    (``/x``, ``./x``, ``~/x``, ``x.gguf``) is never taken for an id."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if name.startswith(("/", ".", "~")) or name.lower().endswith(".gguf"):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` as huggingface_hub read it at import, or as the environment says now."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").upper() in _TRUE


def _cache_dir(download_dir: str | os.PathLike[str] | None) -> str:
    from huggingface_hub import constants

    return str(Path(download_dir).expanduser()) if download_dir is not None else constants.HF_HUB_CACHE


def _how_to_get(repo_id: str, revision: str | None, download_dir: str | os.PathLike[str] | None) -> str:
    cmd = f"hf download {repo_id}"
    if revision is not None:
        cmd += f" --revision {revision}"
    if download_dir is not None:
        cmd += f" --cache-dir {download_dir}"
    return f"`{cmd}`"


def _cached(repo_id: str, revision: str | None,
            download_dir: str | os.PathLike[str] | None) -> tuple[Path | None, bool]:
    """The cached snapshot folder of the revision (None: there is none) and whether it is
    complete, as far as the file list the cache keeps tells."""
    from huggingface_hub import errors, snapshot_download

    incomplete = getattr(errors, "IncompleteSnapshotError", None)  # huggingface_hub >= 2
    try:
        path = Path(snapshot_download(repo_id, revision=revision, cache_dir=download_dir, allow_patterns=ALLOW_PATTERNS,
                                      ignore_patterns=IGNORE_PATTERNS, local_files_only=True))
    except errors.LocalEntryNotFoundError as e:
        if incomplete is not None and isinstance(e, incomplete) and getattr(e, "snapshot_path", None):
            return Path(e.snapshot_path), False
        return None, False
    return path, True


def gguf_hint(folder: Path) -> str:
    """For an error about a folder with no config.json: the GGUF file it holds instead, if any
    (a GGUF repository), to be given by its path."""
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs:
        return ""
    more = f" (and {len(ggufs) - 1} more)" if len(ggufs) > 1 else ""
    return f"; it holds GGUF file {str(ggufs[0])!r}{more}: give that path as the model"


def _has_weights(path: Path) -> bool:
    return any(not p.name.startswith("consolidated") for p in path.glob("*.safetensors")) or any(path.glob("*.bin"))


def has_tokenizer(path: Path) -> bool:
    """A folder AutoTokenizer can build a tokenizer from (``TOKENIZER_FILES``, or a tiktoken file)."""
    return any((path / f).is_file() for f in TOKENIZER_FILES) or any(path.glob("*.tiktoken"))


def _holds_everything(path: Path, what: str, required: str | None) -> bool:
    """What a snapshot must hold to be used without asking the Hub: ``required``, and a model's
    weights or a tokenizer's files (a model's own tokenizer is asked for on its own, as a
    tokenizer: ``engine_setup``)."""
    if not _has_required(path, required):
        return False
    return _has_weights(path) if what == "model" else has_tokenizer(path)


def _has_required(path: Path, required: str | None) -> bool:
    return required is None or (path / required).is_file()


def _download(repo_id: str, revision: str | None, download_dir: str | os.PathLike[str] | None,
              what: str, patterns: list[str] = ALLOW_PATTERNS) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    logger.info("%s %s: downloading from the Hugging Face Hub to %s", what, repo_id, _cache_dir(download_dir))
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=download_dir,
                                      allow_patterns=patterns, ignore_patterns=IGNORE_PATTERNS))
    except RevisionNotFoundError:
        raise ValueError(f"revision: {revision!r} does not exist in {what} {repo_id!r} on the Hugging Face Hub") \
            from None
    except RepositoryNotFoundError:
        raise ValueError(
            f"{what}: {repo_id!r} is neither a local directory nor a model on the Hugging Face Hub "
            "(for a gated or private model, log in first: `hf auth login`)") from None
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as e:
        raise ValueError(
            f"{what}: could not download {repo_id!r} from the Hugging Face Hub ({type(e).__name__}: {e}); "
            f"check the network, or fetch it elsewhere with {_how_to_get(repo_id, revision, download_dir)}"
        ) from e


def snapshot(repo_id: str, *, revision: str | None = None, download_dir: str | os.PathLike[str] | None = None,
             what: str = "model", required: str | None = "config.json", hint: str = "") -> Path:
    """The local folder of ``repo_id`` at ``revision``: from the cache, else downloaded.

    ``what`` names the field in errors; ``required`` is a file a usable snapshot must hold;
    ``hint`` is appended to the offline error (another way to get the model).
    """
    path, complete = _cached(repo_id, revision, download_dir)
    if path is not None and complete and _holds_everything(path, what, required):
        logger.debug("%s %s: cached snapshot %s", what, repo_id, path)
        return _with_pt_weights(path, repo_id, revision, download_dir, what)
    if hub_offline():
        at = f" at revision {revision!r}" if revision is not None else ""
        # A snapshot folder without config.json is a download that stopped before it, or no model;
        # one missing other files may still serve (the loader names what it cannot find).
        if path is not None and _has_required(path, required):
            log = logger.debug if complete else logger.info
            log("%s %s: using the cached snapshot %s as it is (HF_HUB_OFFLINE is set%s)", what, repo_id, path,
                "" if complete else "; files the Hub lists are missing from it")
            return path
        if path is not None:
            why = (gguf_hint(path) if what == "model" else "") or (
                f" (a download that did not finish, or a repository with no {what}), and HF_HUB_OFFLINE is set, so "
                f"it cannot be downloaded; download it again ({_how_to_get(repo_id, revision, download_dir)}), "
                f"unset HF_HUB_OFFLINE{hint}, or pass a local folder")
            raise ValueError(f"{what}: {repo_id!r}{at} is in the Hugging Face cache ({path}) but has no "
                             f"{required}{why}")
        raise ValueError(
            f"{what}: {repo_id!r}{at} is not a local directory and is not in the Hugging Face cache "
            f"({_cache_dir(download_dir)}), and HF_HUB_OFFLINE is set, so it cannot be downloaded; "
            f"download it once with network access ({_how_to_get(repo_id, revision, download_dir)}), "
            f"unset HF_HUB_OFFLINE{hint}, or pass a local folder")
    try:
        patterns = ALLOW_PATTERNS if what == "model" else TOKENIZER_PATTERNS
        got = _download(repo_id, revision, download_dir, what, patterns)
    except ValueError:
        if path is None or not _holds_everything(path, what, required):
            raise
        logger.warning("%s %s: the Hugging Face Hub did not answer; using the cached snapshot %s as it is",
                       what, repo_id, path)
        return path
    return _with_pt_weights(got, repo_id, revision, download_dir, what)


def _with_pt_weights(path: Path, repo_id: str, revision: str | None, download_dir: str | os.PathLike[str] | None,
                     what: str) -> Path:
    """A model snapshot with no safetensors (and no .bin yet): its PyTorch weights, fetched."""
    if what != "model" or hub_offline() or _has_weights(path):
        return path
    logger.info("model %s has no safetensors weights: fetching its PyTorch .bin files", repo_id)
    return _download(repo_id, revision, download_dir, what, PT_PATTERNS)
