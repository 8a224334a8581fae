"""Where a step's host time goes: an opt-in accumulator the engine fills when it is set
(``LLMEngine.profile``), read by ``benches/engine_overhead.py``.

Stages (seconds, summed over steps): ``schedule`` (``Scheduler.schedule``), ``inputs`` (the
sampling metadata and the model inputs), ``overlap`` (what runs while the forward pass may be in
flight: the previous step's text and outputs with overlap on), ``wait`` (waiting for the step
job), ``update`` (host tokens, beam search, ``Scheduler.update``), ``finish`` (text and outputs
made after ``update``, overlap off), and inside those ``detokenize`` (the text layer's results)
and ``outputs`` (``RequestOutput`` building); the step job's ``forward`` and ``sampling`` are timed
on whichever thread runs it.
Costs: a handful of ``perf_counter`` calls per step, nothing per row; nothing when unset.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["StepProfile"]


@dataclass(slots=True)
class StepProfile:
    steps: int = 0
    rows: int = 0  # logits rows, summed
    schedule: float = 0.0
    inputs: float = 0.0
    overlap: float = 0.0
    wait: float = 0.0
    update: float = 0.0
    finish: float = 0.0
    detokenize: float = 0.0
    outputs: float = 0.0
    forward: float = 0.0
    sampling: float = 0.0
    total: float = 0.0

    def add(self, rows: int, t0: float, t1: float, t2: float, t3: float, t4: float, t5: float, t6: float) -> None:
        """One step's stage boundaries (see the engine's ``step``)."""
        self.steps += 1
        self.rows += rows
        self.schedule += t1 - t0
        self.inputs += t2 - t1
        self.overlap += t3 - t2
        self.wait += t4 - t3
        self.update += t5 - t4
        self.finish += t6 - t5
        self.total += t6 - t0

    def add_job(self, forward: float, sampling: float) -> None:
        self.forward += forward
        self.sampling += sampling

    def as_dict(self) -> dict[str, float]:
        return asdict(self)
