"""IdIndex: request core ids, each with a non-negative value (a slot), looked up for a whole step
at once.

The engine hands out core ids in increasing order, so ids are kept sorted by appending them;
a removed id leaves a tombstone (its value -1), dropped when half the entries are dead. A step
looks up its rows' ids with one ``searchsorted``. Per-request registries (logit-bias rows,
grammar matchers) use it, so that neither adding nor ending a request, nor a step, costs time in
the number of requests registered (waiting ones included).
Invariants: ``_ids[:_n]`` is strictly increasing; a live entry's value is >= 0, a dead one's -1.
Costs: ``add`` O(1) amortized for an id above every other (else O(n)); ``remove`` O(log n)
amortized; ``lookup`` of R ids O(R log n). Not thread-safe: its owner locks.
"""

from __future__ import annotations

import numpy as np

__all__ = ["IdIndex"]

_MIN_COMPACT = 32  # dead entries below this stay (a compaction copies every entry)


class IdIndex:
    """Sorted core ids -> values (module docs)."""

    __slots__ = ("_ids", "_vals", "_n", "_dead")

    def __init__(self) -> None:
        self._ids = np.zeros(8, dtype=np.int64)
        self._vals = np.zeros(8, dtype=np.int64)
        self._n = 0  # entries in use, dead ones included
        self._dead = 0

    def __len__(self) -> int:
        return self._n - self._dead

    def add(self, key: int, value: int) -> None:
        """Registers ``key`` (not registered yet) with ``value`` >= 0."""
        if value < 0:
            raise ValueError(f"value={value} must be >= 0")
        n = self._n
        if n and key <= self._ids[n - 1]:  # not above every id: its place among them
            pos = int(np.searchsorted(self._ids[:n], key))
            if self._ids[pos] == key:
                if self._vals[pos] >= 0:
                    raise KeyError(f"id {key} is registered already")
                self._vals[pos], self._dead = value, self._dead - 1
                return
            self._ids = np.insert(self._ids[:n], pos, key)
            self._vals = np.insert(self._vals[:n], pos, value)
            self._n += 1
            return
        if n == len(self._ids):
            self._ids = np.concatenate([self._ids, np.zeros(n, dtype=np.int64)])
            self._vals = np.concatenate([self._vals, np.zeros(n, dtype=np.int64)])
        self._ids[n], self._vals[n] = key, value
        self._n += 1

    def remove(self, key: int) -> int | None:
        """Unregisters ``key``; returns its value (None: it was not registered)."""
        n = self._n
        pos = int(np.searchsorted(self._ids[:n], key))
        if pos == n or self._ids[pos] != key or self._vals[pos] < 0:
            return None
        value = int(self._vals[pos])
        self._vals[pos] = -1
        self._dead += 1
        if self._dead >= _MIN_COMPACT and 2 * self._dead >= n:
            live = self._vals[:n] >= 0
            self._ids, self._vals = self._ids[:n][live], self._vals[:n][live]
            self._n, self._dead = len(self._ids), 0
            if not self._n:
                self._ids, self._vals = np.zeros(8, dtype=np.int64), np.zeros(8, dtype=np.int64)
        return value

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """The value of each of ``keys`` (int64), -1 where it is not registered."""
        keys = np.asarray(keys, dtype=np.int64)
        n = self._n
        if n == self._dead:
            return np.full(len(keys), -1, dtype=np.int64)
        ids = self._ids[:n]
        pos = np.minimum(np.searchsorted(ids, keys), n - 1)
        return np.where(ids[pos] == keys, self._vals[pos], -1)
