"""A local stand-in for the Hugging Face Hub's HTTP API, enough for ``huggingface_hub.snapshot_download``
(``HF_ENDPOINT=server.url``): repo info by revision, the file tree, and ``resolve`` HEAD/GET of files.

It lets tests exercise the real download code offline. ``FakeHub({"org/name": {"main": folder}})``
serves each folder's files as that branch; a commit hash is derived from the ref name. Unknown
repos and revisions answer 404 with the error codes the real Hub sends, so ``huggingface_hub``
raises ``RepositoryNotFoundError`` / ``RevisionNotFoundError``. ``requests`` lists every
``(method, path)`` served, to check what was (not) fetched. Cost: a thread; files are read per request.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlparse

__all__ = ["FakeHub"]


class FakeHub:
    def __init__(self, repos: dict[str, dict[str, Path]]) -> None:
        self.repos = repos
        self.requests: list[tuple[str, str]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, fmt: str, *args: object) -> None:
                hub.requests.append((self.command, urlparse(self.path).path))

            def do_HEAD(self) -> None:
                hub._answer(self, head=True)

            def do_GET(self) -> None:
                hub._answer(self, head=False)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    @staticmethod
    def commit(ref: str) -> str:
        return hashlib.sha1(ref.encode()).hexdigest()

    def _ref(self, repo: str, rev: str) -> str | None:
        return next((ref for ref in self.repos[repo] if rev in (ref, self.commit(ref))), None)

    def _answer(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        path = urlparse(h.path).path
        repo = next((r for r in self.repos if f"/{r}/" in path), None)
        if repo is None:
            return _send(h, 404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"}, head)
        rest = path.split(f"/{repo}/", 1)[1]  # revision/<rev> | tree/<rev> | resolve/<rev>/<file>
        kind, rev, *name = rest.split("/", 2)
        ref = self._ref(repo, rev)
        if ref is None:
            return _send(h, 404, b'{"error": "Invalid rev id"}', {"X-Error-Code": "RevisionNotFound"}, head)
        files = {p.name: p for p in sorted(self.repos[repo][ref].iterdir()) if p.is_file()}
        if kind == "revision":
            info = {"id": repo, "sha": self.commit(ref), "siblings": [{"rfilename": f} for f in files]}
            return _send(h, 200, json.dumps(info).encode(), {"Content-Type": "application/json"}, head)
        if kind == "tree":
            tree = [{"type": "file", "path": f, "size": p.stat().st_size,
                     "oid": hashlib.sha1(p.read_bytes()).hexdigest()} for f, p in files.items()]
            return _send(h, 200, json.dumps(tree).encode(), {"Content-Type": "application/json"}, head)
        if kind == "resolve" and name and name[0] in files:
            body = files[name[0]].read_bytes()
            etag = f'"{hashlib.sha256(body).hexdigest()}"'
            return _send(h, 200, body, {"X-Repo-Commit": self.commit(ref), "ETag": etag}, head)
        _send(h, 404, b'{"error": "Entry not found"}', {"X-Error-Code": "EntryNotFound"}, head)


def _send(h: BaseHTTPRequestHandler, code: int, body: bytes, headers: dict[str, str], head: bool) -> None:
    h.send_response(code)
    for k, v in headers.items():
        h.send_header(k, v)
    h.send_header("Content-Length", str(len(body)))
    h.end_headers()
    if not head:
        h.wfile.write(body)
