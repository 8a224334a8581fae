"""ferrokv: an LLM inference engine with a paged KV cache, copy-on-write prefix sharing and a
Rust iteration-level scheduler.

The core (``Scheduler``) and the error classes import without torch; the model-facing API
(``LLM``, ``AsyncLLM``, ``LLMEngine``) is imported on first use so that ``import ferrokv`` stays cheap.
Importing the package sets up the ``ferrokv`` logger (``ferrokv.logger``: INFO to stderr).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ferrokv._core import (
    CacheCapacityError,
    DuplicateRequestError,
    FerrokvError,
    FinishedSequence,
    InvalidArgumentError,
    PromptTooLongError,
    Scheduler,
    SchedulerOutput,
    SchedulerStateError,
    UnknownRequestError,
    UnknownSequenceError,
    __version__,
)
from ferrokv.logger import configure_logging
from ferrokv.outputs import CompletionOutput, Logprob, RequestOutput, RequestOutputKind, RequestStateStats
from ferrokv.beam_search_params import BeamSearchParams
from ferrokv.sampling_params import SamplingParams
from ferrokv.structured_outputs import StructuredOutputsParams

configure_logging()

if TYPE_CHECKING:
    from ferrokv.async_llm import AsyncLLM
    from ferrokv.engine import EngineArgs, LLMEngine
    from ferrokv.engine_args import AsyncEngineArgs
    from ferrokv.llm import LLM

_LAZY = {"LLM": "ferrokv.llm", "AsyncLLM": "ferrokv.async_llm", "LLMEngine": "ferrokv.engine",
         "EngineArgs": "ferrokv.engine_args", "AsyncEngineArgs": "ferrokv.engine_args"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ferrokv' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = [
    "AsyncEngineArgs",
    "AsyncLLM",
    "BeamSearchParams",
    "CacheCapacityError",
    "CompletionOutput",
    "DuplicateRequestError",
    "EngineArgs",
    "FerrokvError",
    "FinishedSequence",
    "InvalidArgumentError",
    "LLM",
    "LLMEngine",
    "Logprob",
    "PromptTooLongError",
    "RequestOutput",
    "RequestOutputKind",
    "RequestStateStats",
    "SamplingParams",
    "Scheduler",
    "SchedulerOutput",
    "SchedulerStateError",
    "StructuredOutputsParams",
    "UnknownRequestError",
    "UnknownSequenceError",
    "__version__",
]
