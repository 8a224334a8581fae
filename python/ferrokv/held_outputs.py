"""The engine's outputs made and not yet handed out, the one home of their order.

``kept``: outputs the next ``step()`` returns (made by a step that failed, by an abort's report
without a reporter, or during this step); ``hand_out()`` empties it into the list the running
``step()`` returns, which stays reachable (``returning``) on the stepping thread until the engine
call returns (``returned()``, run by the engine lock). An abort applied meanwhile, the step's own
lock release included, takes its request's outputs out of both (``take``), so that with a
reporter they reach it before the request's final output, never out of ``step()`` after it.

Invariants: called with the engine lock held (``returned`` just after it is released, on the
calling thread); ``returning`` is never touched from another thread, nor once the call returned
(the caller owns that list then). Costs: ``take`` is O(outputs held); the rest O(1).
"""

from __future__ import annotations

import threading
from typing import Any

from ferrokv.output_processor import split_outputs

__all__ = ["HeldOutputs"]


class HeldOutputs:
    __slots__ = ("kept", "_returning", "_thread")

    def __init__(self) -> None:
        self.kept: list[Any] = []
        self._returning: list[Any] | None = None
        self._thread: int | None = None

    def hand_out(self) -> list[Any]:
        """Everything kept, as the list the running step() returns (module docs)."""
        outputs, self.kept = self.kept, []
        self._returning, self._thread = outputs, threading.get_ident()
        return outputs

    def keep_back(self, outputs: list[Any]) -> None:
        """``hand_out``'s list, kept again ahead of the rest (the step failed before returning it)."""
        self.kept[:0] = outputs
        self._returning = self._thread = None

    @property
    def returning(self) -> list[Any] | None:
        """The list the running step() returns, on its thread (else None)."""
        return self._returning if self._thread == threading.get_ident() else None

    def returned(self) -> None:
        """An engine call returned on this thread: the list step() returned is its caller's now."""
        if self._thread == threading.get_ident():
            self._returning = self._thread = None

    def take(self, request_ids: set[str], from_returning: bool) -> list[Any]:
        """These requests' outputs, in order, taken out: those being returned (``from_returning``:
        a reporter will have them) then those kept."""
        taken: list[Any] = []
        returning = self.returning
        if returning and from_returning:
            taken, returning[:] = split_outputs(returning, request_ids)
        if self.kept:
            more, self.kept = split_outputs(self.kept, request_ids)
            taken += more
        return taken
