"""Fault injection and leak checks shared by tests/test_faults.py and tests/test_engine_loop.py.

``RunnerHook`` replaces an engine's ``runner.forward`` with a wrapper that runs an action before
each forward pass (raise on the k-th call, wait for another thread, ...), so a test can place a
failure, an abort or a poll exactly in the middle of a chosen step, with events rather than sleeps.
Engines are the tiny random llama on the CPU in fp32: a few hundred KiB, built per test.
"""
from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from ferrokv import LLM, SamplingParams
from ferrokv.engine import EngineArgs, LLMEngine
from helpers.tiny_models import TINY_VOCAB

MAX_MODEL_LEN = 128
MAX_STEPS = 2000  # drive() fails rather than hangs: the tests' runs take a few hundred steps at most


def engine_kwargs(path: Any, **kw: Any) -> dict[str, Any]:
    args = dict(device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, block_size=4, num_kv_blocks=128)
    args.update(kw)
    return dict(model=str(path), **args)


def tiny_llm(path: Any, **kw: Any) -> LLM:
    args = engine_kwargs(path, **kw)
    return LLM(args.pop("model"), **args)


def tiny_engine(path: Any, **kw: Any) -> LLMEngine:
    return LLMEngine(EngineArgs(**engine_kwargs(path, **kw)))


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def rand_prompts(seed: int, lengths: list[int]) -> list[dict[str, list[int]]]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, TINY_VOCAB) for _ in range(n)]} for n in lengths]


def token_ids(outputs: list[Any]) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


def assert_idle(engine: LLMEngine) -> None:
    """No request left anywhere and every block free (cached prefix blocks count as free).
    Call only while no other thread steps the engine."""
    sch = engine.scheduler
    assert not engine.has_unfinished_requests()
    assert sch.num_unfinished == 0 and sch.num_running_seqs == 0, sch.stats()
    assert sch.num_free_blocks == sch.num_blocks - 1, sch.stats()
    assert engine.num_free_blocks == sch.num_blocks - 1
    sch.check_invariants()
    # No per-request state left behind: bias slots, grammar matchers, prompt-logprob requests.
    assert len(engine.step_sampler.bias) == 0 and not engine.grammar_rows.has_any()
    assert len(engine._plp_wanted) == 0 and not engine._requests


def drive(engine: LLMEngine, fails: type[BaseException] | None = None) -> dict[str, Any]:
    """Steps until nothing is unfinished; returns each request's last output. ``fails``: exactly
    one step is expected to raise that exception (the driver goes on, as a vLLM caller may)."""
    last: dict[str, Any] = {}
    raised = steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        assert steps <= MAX_STEPS, f"still unfinished after {MAX_STEPS} steps: {engine.stats()}"
        try:
            outputs = engine.step()
        except BaseException as e:
            if fails is None or not isinstance(e, fails) or raised:
                raise
            raised += 1
            continue
        for o in outputs:
            last[o.request_id] = o
    assert raised == (fails is not None), f"expected one {fails} from step()"
    return last


def run_requests(engine: LLMEngine, requests: list[tuple[str, Any, SamplingParams]],
                 record: Callable[[Any], Any] = lambda o: o) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """Adds the ``(request_id, prompt, params)`` requests and steps until none is unfinished;
    returns (final output by id, ``record(output)`` of every output by id, in order)."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    final: dict[str, Any] = {}
    every: dict[str, list[Any]] = {rid: [] for rid, _, _ in requests}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        assert steps <= MAX_STEPS, f"still unfinished after {MAX_STEPS} steps: {engine.stats()}"
        for o in engine.step():
            every.setdefault(o.request_id, []).append(record(o))
            if o.finished:
                final[o.request_id] = o
    return final, every


class RunnerHook:
    """Wraps ``engine.runner.forward``: ``action(call_number, step_inputs)`` runs before each
    forward pass (numbered from 1; ``step_inputs`` is the runner's ``StepInputs``, with the step's
    block ops); ``calls`` counts them. With overlap on a CPU it runs on the step worker's thread."""

    def __init__(self, engine: LLMEngine, action: Callable[[int, Any], None]) -> None:
        self.calls = 0
        self._action = action
        self._forward = engine.runner.forward
        engine.runner.forward = self

    def __call__(self, inputs: Any) -> Any:
        self.calls += 1
        self._action(self.calls, inputs)
        return self._forward(inputs)


def raise_on(call: int, error: BaseException) -> Callable[[int, Any], None]:
    def action(n: int, out: Any) -> None:
        if n == call:
            raise error

    return action
