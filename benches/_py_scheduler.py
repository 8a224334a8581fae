"""The pure-Python scheduler that ``scheduler_sweep.py`` (and ``latency.py``) time against the
Rust core: a minimal, straightforward scheduler in the nano-vllm style with the core's semantics
for single-sample requests (see ``scheduler_sweep.py``'s docstring for what it models and what
it does not). A helper module, not a benchmark (``run_all`` skips ``benches/_*.py``).

Prefix caching follows the core's rule since 0a0072a: a full block is registered as soon as the
step that computes it is planned, in plan order, so a request admitted later in the same step
takes it as a hit (the forward pass writes every K/V of the step before attention reads any).
``scheduler_sweep.check_case`` compares every step of both schedulers.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque

import numpy as np


class PyOutput:
    """What ``schedule()`` hands to a model runner (numpy arrays, as the core's output)."""

    __slots__ = ("sched", "rows", "array_ns", "num_seqs", "num_tokens", "num_rows", "num_prefill_tokens", "req_ids",
                 "query_start_loc", "seq_lens", "block_tables", "input_ids", "positions", "slot_mapping",
                 "logits_indices", "row_req_ids")


class _Req:
    __slots__ = ("rid", "tokens", "prompt_len", "max_tokens", "num_computed", "blocks", "keys", "key_hashes",
                 "num_registered")

    def __init__(self, rid: int, tokens: list[int], max_tokens: int) -> None:
        self.rid = rid
        self.tokens = tokens
        self.prompt_len = len(tokens)
        self.max_tokens = max_tokens
        self.num_computed = 0
        self.blocks: list[int] = []
        self.keys: list[tuple] = []  # chained block keys known so far (valid while tokens only grow)
        self.key_hashes: list[int] = []
        self.num_registered = 0


class PyScheduler:
    """Minimal pure-Python scheduler with the core's semantics for n=1 requests (see the module
    docstring). ``ref`` and the free list mirror ``block_pool.rs``; the cache maps an exact
    block key ``(hash(parent key), *tokens)`` to its block, so a hit needs no re-check."""

    def __init__(self, num_blocks: int, block_size: int = 16, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 8192, max_model_len: int = 8192, enable_prefix_caching: bool = True,
                 watermark: float = 0.01, admission_headroom: float = 0.5) -> None:
        self.bs = block_size
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.caching = enable_prefix_caching
        self.watermark_blocks = int((num_blocks - 1) * watermark)
        self.headroom = admission_headroom
        self.ref = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))  # head = next allocated
        self.cache: dict[tuple, int] = {}
        self.block_key: dict[int, tuple] = {}
        self.waiting: deque[_Req] = deque()
        self.running: list[_Req] = []
        self.stats = {"prompt_tokens": 0, "prompt_tokens_computed": 0, "cached_prompt_tokens": 0,
                      "generated_tokens": 0, "requests_finished": 0}
        self._in_flight: PyOutput | None = None

    # ---- block pool / KV manager ---------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def _pop_block(self) -> int:
        b, _ = self.free.popitem(last=False)
        self.ref[b] = 1
        if self.caching:
            key = self.block_key.pop(b, None)
            if key is not None:  # evict the cached content it held
                del self.cache[key]
        return b

    def _incref(self, b: int) -> None:
        if self.ref[b] == 0:
            del self.free[b]  # revived out of the free list (cache hit)
        self.ref[b] += 1

    def _decref(self, b: int, keep_cached: bool) -> None:
        self.ref[b] -= 1
        if self.ref[b] == 0:
            self.free[b] = None  # cached blocks at the tail (evicted last, LRU) ...
            if not keep_cached:
                self.free.move_to_end(b, last=False)  # ... empty ones at the head (reused first)

    def _free(self, r: _Req) -> None:
        for b in reversed(r.blocks):
            self._decref(b, b in self.block_key)
        r.blocks = []
        r.num_registered = 0

    def _key(self, r: _Req, i: int) -> tuple:
        if len(r.keys) == i:
            parent = r.key_hashes[i - 1] if i else 0
            k = (parent, *r.tokens[i * self.bs:(i + 1) * self.bs])
            r.keys.append(k)
            r.key_hashes.append(hash(k))
        return r.keys[i]

    def _find_cached_prefix(self, r: _Req) -> list[int]:
        if not self.caching:
            return []
        hits = []
        cache = self.cache
        for i in range((len(r.tokens) - 1) // self.bs):  # the last token is always computed
            b = cache.get(self._key(r, i))
            if b is None:
                break
            hits.append(b)
        return hits

    def _register(self, r: _Req, upto: int) -> None:
        full = min(upto // self.bs, len(r.blocks), len(r.tokens) // self.bs)
        while r.num_registered < full:
            i = r.num_registered
            k = self._key(r, i)
            if k not in self.cache:  # else an identical block is cached already: chain on from it
                b = r.blocks[i]
                self.cache[k] = b
                self.block_key[b] = k
            r.num_registered += 1

    def _blocks_needed(self, r: _Req, start: int, chunk: int, hits: list[int]) -> int:
        revived = sum(1 for b in hits if self.ref[b] == 0)
        have = len(r.blocks) + len(hits)
        fresh = max(0, -(-(start + chunk) // self.bs) - have)
        cow = sum(1 for b in r.blocks[start // self.bs:] if self.ref[b] > 1)
        return fresh + cow + revived

    def _allocate(self, r: _Req, start: int, chunk: int, hits: list[int]) -> None:
        for b in hits:
            self._incref(b)
        if hits:
            r.blocks = list(hits)
            r.num_registered = len(hits)
        target = -(-(start + chunk) // self.bs)
        blocks = r.blocks
        while len(blocks) < target:
            blocks.append(self._pop_block())

    # ---- scheduling ----------------------------------------------------------------------------
    def add_request(self, rid: int, prompt: list[int], max_tokens: int) -> None:
        self.waiting.append(_Req(rid, list(prompt), max_tokens))
        self.stats["prompt_tokens"] += len(prompt)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def _try(self, r: _Req, budget: int, watermark: int):
        """(start, chunk, full) planned and allocated, or None when it does not fit."""
        bs = self.bs
        c = r.num_computed
        if budget > 0 and c + 1 == len(r.tokens) and c % bs and self.ref[r.blocks[c // bs]] == 1:
            r.num_computed = c + 1  # decode fast path: one token inside its own last block
            return c, 1, True
        hits = self._find_cached_prefix(r) if c == 0 and not r.blocks else []
        start = max(c, len(hits) * bs)
        remaining = len(r.tokens) - start
        full = remaining <= budget
        chunk = remaining if full else min(remaining - 1, budget)
        if chunk == 0:
            return None
        if len(self.free) < self._blocks_needed(r, start, chunk, hits) + watermark:
            return None
        self._allocate(r, start, chunk, hits)
        if hits:
            self.stats["cached_prompt_tokens"] += min(len(hits) * bs, r.prompt_len)
        r.num_computed = start + chunk
        return start, chunk, full

    def _register_planned(self, r: _Req, plan: tuple[int, int, bool]) -> None:
        """Registers the full blocks a plan completes right away (the core's rule): the forward
        pass writes every K/V of the step before attention reads any, so a request admitted
        later in this step may take them as hits. Nothing here cancels a step, so no undo."""
        start, chunk, _ = plan
        if self.caching and (start + chunk) // self.bs != start // self.bs:
            self._register(r, start + chunk)

    def schedule(self) -> PyOutput:
        assert self._in_flight is None, "schedule() twice without update()"
        budget = self.budget
        sched: list[tuple[_Req, int, int]] = []
        rows: list[tuple[_Req, int]] = []
        planned: list[tuple[_Req, tuple[int, int, bool]]] = []
        for r in self.running:
            plan = self._try(r, budget, 0)
            if plan is None:
                if budget and len(r.tokens) > r.num_computed:
                    raise RuntimeError("out of KV blocks: preemption is not modelled by the baseline")
                break
            planned.append((r, plan))
            self._register_planned(r, plan)
            budget -= plan[1]
        while self.waiting and budget and len(self.running) < self.max_num_seqs:
            wm = self.watermark_blocks + math.ceil(len(self.running) * self.headroom) if self.running else 0
            r = self.waiting[0]
            plan = self._try(r, budget, wm)
            if plan is None:
                break
            self.waiting.popleft()
            self.running.append(r)
            planned.append((r, plan))
            self._register_planned(r, plan)
            budget -= plan[1]
        num_tokens = 0
        for r, (start, chunk, full) in planned:
            sched.append((r, start, start + chunk))
            num_tokens += chunk
            if full:
                rows.append((r, num_tokens - 1))
        out = self._build(sched, rows, num_tokens)
        self._in_flight = out
        return out

    def _build(self, sched, rows, num_tokens) -> PyOutput:
        bs = self.bs
        width = max((-(-after // bs) for _, _, after in sched), default=0)
        req_ids, seq_lens, input_ids, positions, slots, qsl, bt = [], [], [], [], [], [0], []
        prefill = 0
        for r, before, after in sched:
            req_ids.append(r.rid)
            seq_lens.append(after)
            blocks = r.blocks
            if after - before == 1:
                input_ids.append(r.tokens[before])
                positions.append(before)
                slots.append(blocks[before // bs] * bs + before % bs)
                if after <= r.prompt_len:
                    prefill += 1
            else:
                input_ids.extend(r.tokens[before:after])
                positions.extend(range(before, after))
                slots.extend([blocks[p // bs] * bs + p % bs for p in range(before, after)])
                prefill += after - before
            qsl.append(len(input_ids))
            bt.extend(blocks)
            if len(blocks) < width:
                bt.extend([0] * (width - len(blocks)))
        t0 = time.perf_counter_ns()
        o = PyOutput()
        o.sched, o.rows = sched, rows
        o.num_seqs, o.num_tokens, o.num_rows, o.num_prefill_tokens = len(sched), num_tokens, len(rows), prefill
        o.req_ids = np.array(req_ids, dtype=np.int64)
        o.query_start_loc = np.array(qsl, dtype=np.int32)
        o.seq_lens = np.array(seq_lens, dtype=np.int32)
        o.block_tables = np.array(bt, dtype=np.int32).reshape(len(sched), width)
        o.input_ids = np.array(input_ids, dtype=np.int64)
        o.positions = np.array(positions, dtype=np.int64)
        o.slot_mapping = np.array(slots, dtype=np.int64)
        o.logits_indices = np.array([i for _, i in rows], dtype=np.int64)
        o.row_req_ids = np.array([r.rid for r, _ in rows], dtype=np.int64)
        o.array_ns = time.perf_counter_ns() - t0  # the share spent turning lists into numpy arrays
        return o

    def update(self, out: PyOutput, sampled) -> list[int]:
        assert out is self._in_flight
        self._in_flight = None
        finished = []
        for (r, _), tok in zip(out.rows, sampled.tolist() if hasattr(sampled, "tolist") else sampled):
            r.tokens.append(tok)
            if len(r.tokens) - r.prompt_len >= r.max_tokens or len(r.tokens) >= self.max_model_len:
                finished.append(r)
        self.stats["generated_tokens"] += len(out.rows)
        if finished:
            for r in finished:
                self._free(r)
            done = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in done]
            self.stats["requests_finished"] += len(finished)
        return [r.rid for r in finished]
