"""The server's HTTP connections: uvicorn's h11 protocol with a deadline for each request's head,
and the process's file-descriptor limit raised as vLLM's ``set_ulimit`` does.

uvicorn closes an idle keep-alive connection only once it answered a request
(``timeout_keep_alive``): a connection that never completes a request head (an idle socket, headers
trickled a byte at a time) holds its file descriptor for good, and enough of them exhaust the
process's, shutting every client out (and, on asyncio's loop, flooding the log with accept errors).
``HeadTimeoutH11`` closes a connection whose next request head has not come
``request_head_timeout`` seconds after it opened or after its last response. A request being read
or answered is never cut.

Costs: one timer per connection and per request.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["HeadTimeoutH11", "REQUEST_HEAD_TIMEOUT_S", "raise_fd_limit"]

logger = logging.getLogger("ferrokv.serve")

REQUEST_HEAD_TIMEOUT_S = 30.0  # a client sends its request head as soon as it connects
_FD_LIMIT = 65535  # vLLM's target for the soft limit


class HeadTimeoutH11(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request head is late (module docs)."""

    request_head_timeout = REQUEST_HEAD_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_deadline: asyncio.TimerHandle | None = None
        self._cycle_seen: Any = None
        super().connection_made(transport)
        self._arm()

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and self.cycle is not self._cycle_seen:  # a request head came
            self._cycle_seen = self.cycle
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._head_deadline = self.loop.call_later(self.request_head_timeout, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        idle = self.cycle is None or self.cycle.response_complete
        if idle and not self.transport.is_closing():
            self.transport.close()


def raise_fd_limit() -> None:
    """The soft limit of open files up to 65535 (at most the hard limit), as vLLM's server does:
    each connection holds one."""
    try:
        import resource
    except ImportError:  # not on this platform
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _FD_LIMIT if hard == resource.RLIM_INFINITY else min(_FD_LIMIT, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as e:
            logger.warning("could not raise the open-file limit from %d to %d (%s): fewer connections fit", soft,
                           target, e)
