"""A ``ferrokv serve`` subprocess for the server tests, plus small HTTP helpers they share.

``ServerProcess(model_dir, *flags)`` runs ``[sys.executable, -m, ferrokv, serve, model_dir,
--port, <free port>, *flags]``; ``start()`` polls ``GET /health`` until it answers 200 (the wait
between polls is ``Popen.wait``, which doubles as the check that the process is still alive) and
fails with the server's stderr if it dies or does not come up within ``startup_timeout``.
``stop()`` kills the process and waits for it; ``serve(...)`` is the context manager the tests'
module-scoped fixtures use.

Invariants: stdout/stderr go to files, not pipes, so a chatty server can never block on a full
pipe; a port lost to another process between picking and binding (the server then exits at once,
saying so) is retried with a fresh one. Cost: a start is one interpreter + torch import + tiny
model load, ~5-10 s on a loaded CPU, so tests share servers per module.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

__all__ = [
    "ServerProcess",
    "assert_openai_error",
    "free_port",
    "metric_values",
    "read_metrics",
    "serve",
    "sse_events",
    "wait_for_metrics",
]

STARTUP_TIMEOUT = 180.0  # import torch + load a model on 2 loaded cores; generous on purpose
_POLL = 0.1  # seconds between /health polls (a wait on the process, never a blind sleep)
_PORT_RETRIES = 3


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """One ``ferrokv serve`` subprocess (see the module docstring)."""

    def __init__(self, model_dir: str | Path, *flags: str, env: dict[str, str] | None = None,
                 startup_timeout: float = STARTUP_TIMEOUT, client_cert: tuple[str, str] | None = None) -> None:
        self.model_dir = str(model_dir)
        self.flags = [str(f) for f in flags]
        # A key in the caller's environment would silently turn auth on for servers meant without one.
        self.env = {k: v for k, v in os.environ.items() if k not in ("FERROKV_API_KEY", "VLLM_API_KEY")}
        self.env.update(env or {})
        self.startup_timeout = startup_timeout
        self.client_cert = client_cert  # (certificate, key) its clients show (--ssl-cert-reqs 2)
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_dir = Path(tempfile.mkdtemp(prefix="ferrokv-serve-"))

    @property
    def uds(self) -> str | None:
        """The Unix socket it listens on (``--uds``), if any."""
        return self.flags[self.flags.index("--uds") + 1] if "--uds" in self.flags else None

    @property
    def url(self) -> str:
        if self.uds is not None:
            return "http://localhost"
        return f"{'https' if '--ssl-certfile' in self.flags else 'http'}://127.0.0.1:{self.port}"

    def client(self, timeout: float = 120.0) -> httpx.Client:
        """A client of this server: over its Unix socket under ``--uds``; any certificate (a test's
        self-signed one) under ``--ssl-certfile``, showing ``client_cert``."""
        if self.uds is not None:
            return httpx.Client(base_url=self.url, transport=httpx.HTTPTransport(uds=self.uds), timeout=timeout)
        verify: Any = False
        if self.client_cert is not None:
            verify = ssl.create_default_context()
            verify.check_hostname, verify.verify_mode = False, ssl.CERT_NONE
            verify.load_cert_chain(*self.client_cert)
        return httpx.Client(base_url=self.url, timeout=timeout, verify=verify)

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "ferrokv", "serve", self.model_dir, "--port", str(self.port), *self.flags]

    def stderr(self) -> str:
        """Everything the server wrote so far (stderr, then stdout)."""
        parts = []
        for name in ("stderr.txt", "stdout.txt"):
            f = self.log_dir / name
            if f.exists():
                parts.append(f.read_text(errors="replace"))
        return "\n".join(p for p in parts if p)

    def start(self) -> "ServerProcess":
        for attempt in range(_PORT_RETRIES):
            self.port = free_port()
            with open(self.log_dir / "stdout.txt", "wb") as out, open(self.log_dir / "stderr.txt", "wb") as err:
                self.proc = subprocess.Popen(self.argv(), stdout=out, stderr=err, env=self.env)
            if self._wait_ready():
                return self
            log = self.stderr()
            port_lost = "address already in use" in log.lower() or "errno 98" in log.lower()
            if not (port_lost and attempt + 1 < _PORT_RETRIES):
                self.stop()
                raise RuntimeError(f"ferrokv serve did not come up ({self.describe_exit()}); argv {self.argv()}\n"
                                   f"--- server output ---\n{log[-20000:]}")
        raise AssertionError("unreachable")

    def _wait_ready(self) -> bool:
        """True once /health answers 200; False if the process exits first or the time runs out."""
        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout
        with self.client(timeout=5.0) as client:
            while time.monotonic() < deadline:
                try:
                    if client.get("/health").status_code == 200:
                        return True
                except httpx.TransportError:
                    pass  # not listening yet
                try:
                    self.proc.wait(timeout=_POLL)
                    return False  # it exited
                except subprocess.TimeoutExpired:
                    pass
        return False

    def describe_exit(self) -> str:
        if self.proc is None:
            return "never started"
        rc = self.proc.poll()
        return "still running (timed out)" if rc is None else f"exit status {rc}"

    def send_signal(self, sig: int = signal.SIGTERM) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        """Kills the process (if still running) and reaps it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=60)


@contextlib.contextmanager
def serve(model_dir: str | Path, *flags: str, **kw: Any) -> Iterator[ServerProcess]:
    """A started server for the ``with`` block; killed and reaped afterwards."""
    server = ServerProcess(model_dir, *flags, **kw)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(server.log_dir, ignore_errors=True)


# ------------------------------------------------------------------------------------------------
# Response checks shared by the test modules
# ------------------------------------------------------------------------------------------------

def assert_openai_error(resp: httpx.Response, status: int, *needles: str) -> dict[str, Any]:
    """``resp`` is an OpenAI-shaped error (``{"error": {message, type, param, code}}``) with
    ``status``, whose message contains every one of ``needles``; returns the inner object."""
    body_text = resp.text
    assert resp.status_code == status, f"expected {status}, got {resp.status_code}: {body_text[:2000]}"
    assert resp.headers.get("content-type", "").startswith("application/json"), (resp.headers, body_text[:500])
    body = json.loads(body_text)
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert isinstance(err, dict), body
    assert {"message", "type", "param", "code"} <= set(err), body
    assert isinstance(err["message"], str) and err["message"], body
    assert isinstance(err["type"], str) and err["type"], body
    assert err["param"] is None or isinstance(err["param"], str), body
    assert err["code"] is None or isinstance(err["code"], (int, str)), body
    for needle in needles:
        assert needle in err["message"], f"{needle!r} not in the error message {err['message']!r}"
    return err


def sse_events(lines: list[str]) -> list[str]:
    """The ``data:`` payloads of an SSE body's lines, in order."""
    return [line[len("data:"):].strip() for line in lines if line.startswith("data:")]


def metric_values(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name: value}, summed over label sets (comments skipped)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0].strip()
        values[name] = values.get(name, 0.0) + float(value)
    return values


def read_metrics(base_url: str, client: httpx.Client | None = None) -> dict[str, float]:
    owned = client is None
    client = client or httpx.Client(timeout=30.0)
    try:
        resp = client.get(base_url + "/metrics")
        assert resp.status_code == 200, resp.text[:2000]
        return metric_values(resp.text)
    finally:
        if owned:
            client.close()


def wait_for_metrics(base_url: str, predicate: Any, timeout: float = 60.0) -> dict[str, float]:
    """Polls /metrics until ``predicate(values)`` holds; fails with the last values after ``timeout``."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=30.0) as client:
        while True:
            values = read_metrics(base_url, client)
            if predicate(values):
                return values
            if time.monotonic() > deadline:
                shown = {k: v for k, v in values.items() if k.startswith("ferrokv:num") or "running" in k
                         or "waiting" in k}
                raise AssertionError(f"/metrics did not reach the expected state in {timeout}s: {shown}")
            # Poll interval only (the predicate decides); metrics change at most once per engine step.
            time.sleep(0.05)
