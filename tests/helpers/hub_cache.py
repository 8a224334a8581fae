"""A Hugging Face Hub cache folder, laid out as ``huggingface_hub`` writes it, for offline tests.

``add_to_hub_cache(cache, "org/name", folder)`` copies the files of ``folder`` into
``cache/models--org--name/blobs/<sha256>`` and links them from ``snapshots/<commit>/<file>``, with
``refs/<branch>`` holding the commit: what ``hf download`` leaves behind, so ``snapshot_download``
(and ferrokv's loading by id) finds it with ``HF_HUB_OFFLINE=1`` and no network.
Invariants: the commit is 40 hex digits derived from the files and the ref name, so two refs (or
two versions) of one repo get distinct snapshots. Cost: one copy of the files (tiny models: KB).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

__all__ = ["add_to_hub_cache", "repo_folder"]


def repo_folder(cache: Path, repo_id: str) -> Path:
    return Path(cache) / ("models--" + repo_id.replace("/", "--"))


def add_to_hub_cache(cache: Path, repo_id: str, folder: Path, *, ref: str = "main") -> str:
    """Adds every file of ``folder`` as one snapshot of ``repo_id`` at ``ref``; returns its commit hash."""
    files = sorted(p for p in Path(folder).iterdir() if p.is_file())
    digest = hashlib.sha1(ref.encode())
    for p in files:
        digest.update(p.name.encode() + hashlib.sha256(p.read_bytes()).digest())
    commit = digest.hexdigest()
    root = repo_folder(cache, repo_id)
    snap = root / "snapshots" / commit
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True, exist_ok=True)
    for p in files:
        blob = root / "blobs" / hashlib.sha256(p.read_bytes()).hexdigest()
        if not blob.exists():
            shutil.copyfile(p, blob)
        link = snap / p.name
        if not link.exists():
            os.symlink(os.path.relpath(blob, snap), link)  # relative links, as huggingface_hub makes them
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / ref).write_text(commit)
    return commit
