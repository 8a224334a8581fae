"""Models and tokenizers by Hugging Face Hub id (``org/name``), through ``huggingface_hub``.

Invariants:
- The local Hugging Face cache comes first: a snapshot already there is used without any network
  request, so a cached model loads the same online and offline. Only then, and only when
  ``HF_HUB_OFFLINE`` is unset, is the snapshot downloaded (``snapshot_download``).
- The cache is ``download_dir`` when given, else what ``huggingface_hub`` reads from the environment
  (``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``); ``revision`` is a
  branch, tag or commit hash (default: ``main``).
- Only the files ferrokv reads are fetched (``ALLOW_PATTERNS``: configs, safetensors, tokenizer
  files), never ``.gguf``/``.onnx`` duplicates of the weights; PyTorch ``.bin`` weights only for
  a model that has no safetensors (``PT_PATTERNS``, vLLM's fallback).
- Every failure is a ``ValueError`` naming the field (``model``/``tokenizer``) and the id, and, when
  nothing is cached offline, the command that fetches it.
Costs: a cache hit is a few ``stat`` calls; a download is the size of the allowed files.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger("ferrokv")

__all__ = ["ALLOW_PATTERNS", "PT_PATTERNS", "hub_offline", "looks_like_hub_id", "snapshot"]

ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken"]
PT_PATTERNS = ["*.bin"]
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


def _cached(repo_id: str, revision: str | None, download_dir: str | os.PathLike[str] | None) -> Path | None:
    """The cached snapshot, or None when it is missing or incomplete."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = Path(snapshot_download(repo_id, revision=revision, cache_dir=download_dir,
                                      allow_patterns=ALLOW_PATTERNS, local_files_only=True))
    except LocalEntryNotFoundError:  # IncompleteSnapshotError included
        return None
    return path


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
                                      allow_patterns=patterns))
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
    path = _cached(repo_id, revision, download_dir)
    # A snapshot folder without config.json is a download that stopped before it, or no model.
    if path is not None and (required is None or (path / required).is_file()):
        logger.debug("%s %s: cached snapshot %s", what, repo_id, path)
        return _with_pt_weights(path, repo_id, revision, download_dir, what)
    if hub_offline():
        at = f" at revision {revision!r}" if revision is not None else ""
        if path is not None:
            raise ValueError(
                f"{what}: {repo_id!r}{at} is in the Hugging Face cache ({path}) but has no {required} (a download "
                f"that did not finish, or a repository with no {what}), and HF_HUB_OFFLINE is set, so it cannot "
                f"be downloaded; download it again ({_how_to_get(repo_id, revision, download_dir)}), "
                f"unset HF_HUB_OFFLINE{hint}, or pass a local folder")
        raise ValueError(
            f"{what}: {repo_id!r}{at} is not a local directory and is not in the Hugging Face cache "
            f"({_cache_dir(download_dir)}), and HF_HUB_OFFLINE is set, so it cannot be downloaded; "
            f"download it once with network access ({_how_to_get(repo_id, revision, download_dir)}), "
            f"unset HF_HUB_OFFLINE{hint}, or pass a local folder")
    return _with_pt_weights(_download(repo_id, revision, download_dir, what), repo_id, revision, download_dir, what)


def _with_pt_weights(path: Path, repo_id: str, revision: str | None, download_dir: str | os.PathLike[str] | None,
                     what: str) -> Path:
    """A model snapshot with no safetensors (and no .bin yet): its PyTorch weights, fetched."""
    if what != "model" or hub_offline() or any(path.glob("*.safetensors")) or any(path.glob("*.bin")):
        return path
    logger.info("model %s has no safetensors weights: fetching its PyTorch .bin files", repo_id)
    return _download(repo_id, revision, download_dir, what, PT_PATTERNS)
