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
from ferrokv.inputs import PromptType, TextPrompt, TokensPrompt
from ferrokv.sampling_params import SamplingParams
from ferrokv.structured_outputs import StructuredOutputsParams

configure_logging()

if TYPE_CHECKING:
    from ferrokv.async_llm import AsyncLLM
    from ferrokv.async_llm import AsyncLLM as AsyncLLMEngine
    from ferrokv.engine import EngineArgs, LLMEngine
    from ferrokv.engine_args import AsyncEngineArgs
    from ferrokv.llm import LLM

# name -> (module, its name there). AsyncLLMEngine is vLLM V1's alias of AsyncLLM.
_LAZY = {"LLM": ("ferrokv.llm", "LLM"), "AsyncLLM": ("ferrokv.async_llm", "AsyncLLM"),
         "AsyncLLMEngine": ("ferrokv.async_llm", "AsyncLLM"), "LLMEngine": ("ferrokv.engine", "LLMEngine"),
         "EngineArgs": ("ferrokv.engine_args", "EngineArgs"),
         "AsyncEngineArgs": ("ferrokv.engine_args", "AsyncEngineArgs")}


def __getattr__(name: str) -> Any:
    found = _LAZY.get(name)
    if found is None:
        raise AttributeError(f"module 'ferrokv' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(found[0]), found[1])


__all__ = [
    "AsyncEngineArgs",
    "AsyncLLM",
    "AsyncLLMEngine",
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
    "PromptType",
    "RequestOutput",
    "RequestOutputKind",
    "RequestStateStats",
    "SamplingParams",
    "Scheduler",
    "SchedulerOutput",
    "SchedulerStateError",
    "StructuredOutputsParams",
    "TextPrompt",
    "TokensPrompt",
    "UnknownRequestError",
    "UnknownSequenceError",
    "__version__",
]
