"""IdIndex (``ferrokv.id_index``) against a dict, under random adds (mostly increasing ids, as the
engine hands them out), removes and lookups; and its costs' premise: ids above all others append."""
from __future__ import annotations

import numpy as np
import pytest

from ferrokv.id_index import IdIndex


@pytest.mark.parametrize("seed", range(5))
def test_matches_a_dict(seed):
    rng = np.random.default_rng(seed)
    index, model = IdIndex(), {}
    next_id = 0
    for _ in range(3000):
        op = rng.random()
        if op < 0.45:
            key = next_id if rng.random() < 0.9 else int(rng.integers(0, next_id + 5))
            next_id = max(next_id, key) + 1
            if key in model:
                with pytest.raises(KeyError):
                    index.add(key, 1)
                continue
            model[key] = int(rng.integers(0, 1000))
            index.add(key, model[key])
        elif op < 0.85:
            key = int(rng.integers(0, next_id + 3))
            assert index.remove(key) == model.pop(key, None)
        keys = rng.integers(-2, next_id + 3, size=int(rng.integers(0, 40)))
        assert index.lookup(keys).tolist() == [model.get(int(k), -1) for k in keys]
        assert len(index) == len(model)
        assert np.all(np.diff(index._ids[:index._n]) > 0)


def test_dead_entries_are_compacted_and_an_id_can_come_back():
    index = IdIndex()
    for i in range(100):
        index.add(i, i)
    for i in range(60):
        assert index.remove(i) == i
    assert index._n < 100 and len(index) == 40  # compacted once half were dead
    assert index.remove(5) is None
    index.add(5, 7)  # below the others: inserted in place
    assert index.lookup(np.array([5, 60, 99, 100])).tolist() == [7, 60, 99, -1]
    with pytest.raises(ValueError):
        index.add(200, -1)
