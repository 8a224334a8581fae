#!/usr/bin/env python
"""Reference contiguous KV allocator: the baseline the paged benchmarks compare against.

What a pre-PagedAttention server does with the same KV memory (the seeds' "one big desk per
reader"): every request gets ONE contiguous range of token slots, reserved in full when it is
admitted and held until it finishes.

* ``ContiguousAllocator``: first-fit over a sorted list of free ranges ``(start, length)``;
  ``free`` coalesces with both neighbours, so the list never holds two adjacent ranges.
* ``ContiguousServer``: the step model used by ``kv_utilization.py`` / ``block_map.py`` /
  ``block_size_sweep.py``. Requests queue FCFS; at the start of each step the queue head is
  admitted while a contiguous range fits (head-of-line blocking: nobody overtakes a blocked
  head). Reservation per request:
    - ``"max_model_len"`` (default): ``max_model_len`` slots, the classic static reservation;
    - ``"exact"``: ``prompt_len + output_len`` slots, an oracle that knows the output length
      (best case for a contiguous allocator; with variable sizes external fragmentation appears).
  Every running request computes one token per step (its prompt in its admission step), so in
  step ``k`` of its life (``k = 1`` at admission) it holds ``prompt_len + k - 1`` token slots
  of KV, and it finishes after ``output_len`` steps (the KV of the last sampled token is never
  written). This is exactly the accounting of the real core measured right after
  ``schedule()``.

Metrics per step (``StepState``): running requests, reserved slots (= allocated), used slots,
free slots, largest free range, and the external fragmentation: free slots stranded while the
queue head is blocked (it exists, but no single free range can hold the head's reservation),
with a flag for steps where the total free memory would have been enough.

Self-check: ``python benches/contiguous_allocator.py --selftest`` (plain asserts, not pytest).
"""

from __future__ import annotations

import argparse
import bisect
from collections import deque
from dataclasses import dataclass, field


class ContiguousAllocator:
    """First-fit allocator of contiguous token-slot ranges over ``[0, capacity)``."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        self.capacity = capacity
        self._starts: list[int] = [0]  # free ranges, sorted by start, never adjacent
        self._lens: list[int] = [capacity]
        self._alloc: dict[int, int] = {}  # start -> length of allocated ranges

    def allocate(self, size: int) -> int | None:
        """Start of a new range of ``size`` slots at the lowest address that fits, or None."""
        if size <= 0:
            raise ValueError(f"size must be > 0, got {size}")
        for i, n in enumerate(self._lens):
            if n >= size:
                start = self._starts[i]
                if n == size:
                    del self._starts[i]
                    del self._lens[i]
                else:
                    self._starts[i] = start + size
                    self._lens[i] = n - size
                self._alloc[start] = size
                return start
        return None

    def free(self, start: int) -> None:
        """Returns the range that begins at ``start``, merging it with free neighbours."""
        size = self._alloc.pop(start)
        i = bisect.bisect_left(self._starts, start)
        merge_prev = i > 0 and self._starts[i - 1] + self._lens[i - 1] == start
        merge_next = i < len(self._starts) and start + size == self._starts[i]
        if merge_prev and merge_next:
            self._lens[i - 1] += size + self._lens[i]
            del self._starts[i]
            del self._lens[i]
        elif merge_prev:
            self._lens[i - 1] += size
        elif merge_next:
            self._starts[i] = start
            self._lens[i] += size
        else:
            self._starts.insert(i, start)
            self._lens.insert(i, size)

    @property
    def free_ranges(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._lens))

    @property
    def allocated_ranges(self) -> dict[int, int]:
        return dict(self._alloc)

    def total_free(self) -> int:
        return sum(self._lens)

    def largest_free(self) -> int:
        return max(self._lens, default=0)

    def check(self) -> None:
        """Invariants: sorted, disjoint, coalesced free list; free + allocated tile the memory."""
        spans = sorted([(s, n, "free") for s, n in self.free_ranges] + [(s, n, "alloc") for s, n in self._alloc.items()])
        pos = 0
        prev_kind = None
        for s, n, kind in spans:
            assert n > 0, (s, n)
            assert s == pos, f"gap or overlap at {pos}: next range starts at {s}"
            assert not (kind == "free" and prev_kind == "free"), f"adjacent free ranges at {s}"
            pos, prev_kind = s + n, kind
        assert pos == self.capacity, (pos, self.capacity)


@dataclass
class _Req:
    req_id: int
    prompt_len: int
    output_len: int
    reserve: int
    start: int = -1
    admitted_step: int = -1
    generated: int = 0  # tokens sampled so far (the first one in the admission step)


@dataclass
class StepState:
    step: int
    running: int
    waiting: int
    reserved: int  # allocated = reserved token slots of running requests
    used: int  # token slots holding KV during this step
    free: int
    largest_free: int
    stranded: int  # free slots while the head is blocked: no range can hold its reservation
    frag_blocked: bool  # the head is blocked although total free >= its reservation
    admitted: list[int] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)


class ContiguousServer:
    """FCFS, head-of-line blocking, one contiguous reservation per request (see module doc)."""

    def __init__(self, capacity: int, max_model_len: int, reserve: str = "max_model_len") -> None:
        if reserve not in ("max_model_len", "exact"):
            raise ValueError(f"reserve must be 'max_model_len' or 'exact', got {reserve!r}")
        self.alloc = ContiguousAllocator(capacity)
        self.capacity = capacity
        self.max_model_len = max_model_len
        self.reserve = reserve
        self.waiting: deque[_Req] = deque()
        self.running: dict[int, _Req] = {}
        self.step_id = 0
        self.completed = 0

    def add_request(self, req_id: int, prompt_len: int, output_len: int) -> None:
        if prompt_len < 1 or output_len < 1 or prompt_len + output_len > self.max_model_len:
            raise ValueError(f"request {req_id}: prompt {prompt_len} + output {output_len} must fit max_model_len")
        size = self.max_model_len if self.reserve == "max_model_len" else prompt_len + output_len
        if size > self.capacity:
            raise ValueError(f"request {req_id}: reservation {size} exceeds capacity {self.capacity}")
        self.waiting.append(_Req(req_id, prompt_len, output_len, size))

    def step(self, observe=None) -> StepState:
        """Admits (FCFS, HOL), computes one token per running request, frees finished ones.

        ``observe(self)`` is called during the step's forward pass (after admission, before
        anything finishes), the point at which every metric of ``StepState`` is taken.
        """
        self.step_id += 1
        admitted = []
        while self.waiting:
            head = self.waiting[0]
            start = self.alloc.allocate(head.reserve)
            if start is None:
                break
            self.waiting.popleft()
            head.start, head.admitted_step = start, self.step_id
            self.running[head.req_id] = head
            admitted.append(head.req_id)
        free, largest = self.alloc.total_free(), self.alloc.largest_free()
        blocked = bool(self.waiting)  # the loop above only stops early on a head that does not fit
        stranded = free if blocked else 0
        frag_blocked = blocked and free >= self.waiting[0].reserve
        # This step's forward pass: request r computes positions [0, prompt) at admission, then
        # one position per step, so it holds prompt + generated KV slots (generated before this step).
        used = sum(r.prompt_len + r.generated for r in self.running.values())
        reserved = sum(r.reserve for r in self.running.values())
        state = StepState(self.step_id, len(self.running), len(self.waiting), reserved, used, free, largest,
                          stranded, frag_blocked, admitted)
        if observe is not None:
            observe(self)
        for r in list(self.running.values()):
            r.generated += 1
            if r.generated == r.output_len:
                self.alloc.free(r.start)
                del self.running[r.req_id]
                state.finished.append(r.req_id)
                self.completed += 1
        return state

    def owner_map(self) -> list[tuple[int, int, int, int]]:
        """``(start, reserved, used, req_id)`` of every running request; ``used`` as in the
        current step's forward pass when called from ``step(observe=...)``."""
        return [(r.start, r.reserve, r.prompt_len + r.generated, r.req_id) for r in self.running.values()]


def selftest() -> None:
    # First fit, carving, coalescing on both sides.
    a = ContiguousAllocator(10)
    assert a.allocate(3) == 0 and a.allocate(3) == 3 and a.allocate(3) == 6
    assert a.allocate(2) is None and a.total_free() == 1 and a.largest_free() == 1
    a.check()
    a.free(0)
    a.free(6)  # free: [0,3) and [6,10): 7 slots, largest 4
    a.check()
    assert a.free_ranges == [(0, 3), (6, 4)] and a.total_free() == 7
    assert a.allocate(5) is None, "external fragmentation: 7 free but no range of 5"
    assert a.allocate(2) == 0, "first fit takes the lowest address"
    a.free(0)
    a.free(3)  # coalesces [0,3) + [3,6) + [6,10)
    assert a.free_ranges == [(0, 10)], a.free_ranges
    a.check()
    # Random churn against a brute-force slot map.
    import random

    rnd = random.Random(0)
    a = ContiguousAllocator(257)
    owner = [None] * 257
    live = []
    for i in range(5000):
        if live and (rnd.random() < 0.45 or len(live) > 30):
            s = live.pop(rnd.randrange(len(live)))
            n = a.allocated_ranges[s]
            a.free(s)
            owner[s:s + n] = [None] * n
        else:
            n = rnd.randint(1, 40)
            s = a.allocate(n)
            # brute force: the lowest start of n free slots
            want = next((p for p in range(257 - n + 1) if all(o is None for o in owner[p:p + n])), None)
            assert s == want, (i, s, want)
            if s is not None:
                owner[s:s + n] = [i] * n
                live.append(s)
        a.check()
        assert a.total_free() == owner.count(None)
    # Step model: prompt 4, output 3 -> holds 4, 5, 6 slots in steps 1..3, finishes in step 3.
    srv = ContiguousServer(capacity=16, max_model_len=8)
    srv.add_request(1, 4, 3)
    states = [srv.step() for _ in range(4)]
    assert [s.used for s in states] == [4, 5, 6, 0], [s.used for s in states]
    assert [s.reserved for s in states] == [8, 8, 8, 0]
    assert states[0].admitted == [1] and states[2].finished == [1] and srv.completed == 1
    # Head-of-line blocking: capacity for 2 reservations of 8; the third waits, and so does a
    # fourth behind it even though nothing could ever overtake a blocked head.
    srv = ContiguousServer(capacity=16, max_model_len=8)
    srv.add_request(1, 2, 5)
    srv.add_request(2, 2, 2)
    srv.add_request(3, 2, 2)
    srv.add_request(4, 1, 1)
    s1 = srv.step()
    assert s1.admitted == [1, 2] and s1.waiting == 2 and s1.stranded == 0 and not s1.frag_blocked
    s2 = srv.step()  # request 2 finishes at the end of step 2
    assert s2.finished == [2] and s2.running == 2
    s3 = srv.step()
    assert s3.admitted == [3], s3.admitted
    # External fragmentation with exact reservations: A, B, C take 4 slots each of 12; A and C
    # end after step 1, B after step 3. The head D needs 6: 8 slots are free in two ranges of 4,
    # so it is blocked by fragmentation until B ends and the free list coalesces.
    srv = ContiguousServer(capacity=12, max_model_len=8, reserve="exact")
    for rid, (p, o) in enumerate([(3, 1), (1, 3), (3, 1), (3, 3)], start=1):
        srv.add_request(rid, p, o)
    s = srv.step()
    assert s.admitted == [1, 2, 3] and s.free == 0 and s.stranded == 0 and not s.frag_blocked
    assert s.finished == [1, 3]
    for _ in range(2):
        s = srv.step()
        assert s.admitted == [] and s.free == 8 and s.largest_free == 4 and s.stranded == 8 and s.frag_blocked
    assert s.finished == [2] and srv.alloc.free_ranges == [(0, 12)]
    seen = []
    s = srv.step(observe=lambda srv: seen.append(srv.owner_map()))
    assert s.admitted == [4] and seen == [[(0, 6, 3, 4)]], seen
    print("contiguous_allocator selftest: OK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--selftest", action="store_true", help="run the asserts (the default action)")
    ap.parse_args()
    selftest()


if __name__ == "__main__":
    main()
