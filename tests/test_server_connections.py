"""The server's HTTP connections (``ferrokv.entrypoints.openai.connections``), through a real
uvicorn server on a free port: a connection whose request head does not come in time is closed;
one whose request is answered, or being answered, is not cut."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import uvicorn

from ferrokv.entrypoints.openai.connections import HeadTimeoutH11, raise_fd_limit
from helpers.server import free_port

TIMEOUT = 0.5


class _Fast(HeadTimeoutH11):
    request_head_timeout = TIMEOUT


async def _app(scope, receive, send):  # answers after ?sleep= seconds (a long request)
    if scope["type"] != "http":
        return
    delay = float(scope["query_string"].decode().partition("sleep=")[2] or 0)
    await asyncio.sleep(delay)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(scope="module")
def port():
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(_app, host="127.0.0.1", port=port, http=_Fast, log_level="warning",
                                           lifespan="off", timeout_keep_alive=60))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    yield port
    server.should_exit = True
    thread.join(10)


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):  # a response's bytes, then EOF
            pass
        return True
    except TimeoutError:
        return False


def _request(sock: socket.socket, path: str = "/") -> bytes:
    """One whole response (its head and its 2-byte body)."""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    got = b""
    while not got.endswith(b"\r\n\r\nok"):
        chunk = sock.recv(4096)
        if not chunk:
            break
        got += chunk
    return got


def test_a_connection_that_never_sends_a_request_is_closed(port):
    with socket.create_connection(("127.0.0.1", port)) as idle, socket.create_connection(("127.0.0.1", port)) as slow:
        slow.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
        for _ in range(3):
            time.sleep(TIMEOUT / 4)
            slow.sendall(b"X-Trickle: 1\r\n")  # data keeps coming: the deadline is the head's, not idleness
        assert _closed_within(idle, 10 * TIMEOUT) and _closed_within(slow, 10 * TIMEOUT)


def test_a_keep_alive_connection_gets_a_new_deadline_after_each_response(port):
    with socket.create_connection(("127.0.0.1", port)) as sock:
        for _ in range(3):  # each request within the deadline: all answered on one connection
            time.sleep(TIMEOUT / 2)
            assert _request(sock).startswith(b"HTTP/1.1 200")
        assert _closed_within(sock, 10 * TIMEOUT)  # (keep-alive itself is 60 s here)


def test_a_request_longer_than_the_deadline_is_not_cut(port):
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(30)
        assert _request(sock, f"/?sleep={4 * TIMEOUT}").startswith(b"HTTP/1.1 200")


def test_the_open_file_limit_is_raised_toward_vllms_target():
    resource = pytest.importorskip("resource")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(256, hard) if hard != resource.RLIM_INFINITY else 256
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    try:
        raise_fd_limit()
        want = 65535 if hard == resource.RLIM_INFINITY else min(65535, hard)
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == want
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
