"""``HeldOutputs``: the one home of outputs made and not handed out (``ferrokv.held_outputs``)."""

from __future__ import annotations

import threading
import types

from ferrokv.held_outputs import HeldOutputs


def _out(rid: str, n: int):
    return types.SimpleNamespace(request_id=rid, n=n)


def test_take_gets_each_output_once_in_order_from_the_returning_list_then_the_kept():
    held = HeldOutputs()
    held.kept += [_out("a", 1), _out("b", 1)]
    returning = held.hand_out()
    held.kept += [_out("a", 2)]  # made since (a pending step's)
    assert [(o.request_id, o.n) for o in held.take({"a"}, from_returning=True)] == [("a", 1), ("a", 2)]
    assert [o.request_id for o in returning] == ["b"] and held.kept == []  # taken out, in place
    assert held.take({"b"}, from_returning=False) == [] and len(returning) == 1  # no reporter: it is returned


def test_a_list_kept_back_is_no_longer_the_returning_one():
    """A step that failed keeps its outputs for the next: taking them must not find them twice."""
    held = HeldOutputs()
    held.kept += [_out("a", 1)]
    held.keep_back(held.hand_out())
    assert held.returning is None
    assert [o.n for o in held.take({"a"}, from_returning=True)] == [1]


def test_the_returning_list_is_the_stepping_threads_until_its_call_returned():
    held = HeldOutputs()
    held.kept += [_out("a", 1)]
    returning = held.hand_out()
    seen = []
    other = threading.Thread(target=lambda: seen.append((held.returning, held.take({"a"}, True))))
    other.start()
    other.join()
    assert seen == [(None, [])] and len(returning) == 1  # another thread never touches it
    held.returned()
    assert held.returning is None and held.take({"a"}, True) == [] and len(returning) == 1  # the caller's now
