"""``BeamSearchParams``: vLLM's parameters of ``LLM.beam_search(prompts, params)``.

Invariants: every field is checked at construction (and on assignment through ``validate``), a
``ValueError`` naming the field and the value. ferrokv's beam search is transformers'
deterministic one (``ferrokv.beam_search``), so ``temperature`` must be 0 and there are no stop
strings (``include_stop_str_in_output`` must be False): other values are refused, not ignored.
Costs: O(1).
"""

from __future__ import annotations

from dataclasses import dataclass

from ferrokv.checks import check_finite, check_int, shown

__all__ = ["BeamSearchParams"]

_INT32_MAX = (1 << 31) - 1


@dataclass(slots=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        self.beam_width = check_int("beam_width", self.beam_width, 1, _INT32_MAX)
        self.max_tokens = check_int("max_tokens", self.max_tokens, 1, _INT32_MAX)
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {shown(getattr(self, name))}")
        self.length_penalty = check_finite("length_penalty", self.length_penalty)
        if check_finite("temperature", self.temperature) != 0.0:
            raise ValueError(f"temperature={self.temperature!r}: ferrokv's beam search is deterministic "
                             "(transformers' semantics); only 0.0 is supported")
        if self.include_stop_str_in_output:
            raise ValueError("include_stop_str_in_output=True: beam search takes no stop strings here; "
                             "only False is supported")
