"""``LLM``: the offline generation API, with vLLM's names and semantics.

``LLM(model=None, ...)`` loads a Hugging Face Hub id (from the HF cache, else downloaded), a local
Hugging Face folder, or a ``.gguf`` file (converted once and cached); ``model=None`` is the embedded
SmolLM2-135M-Instruct. Every engine argument is a keyword with the CLI flag's name and the
``EngineArgs`` field's default; an unknown keyword is a ``TypeError``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ferrokv.checks import check_text, shown
from ferrokv.engine import LLMEngine
from ferrokv.engine_args import EngineArgs
from ferrokv.outputs import RequestOutput
from ferrokv.sampling_params import SamplingParams

logger = logging.getLogger("ferrokv")


@dataclass(slots=True)
class BeamSearchSequence:
    """One finished beam: generated ``tokens`` (EOS included), their ``text`` and score."""

    tokens: list[int]
    text: str
    cum_logprob: float
    finish_reason: str


@dataclass(slots=True)
class BeamSearchOutput:
    """The best ``beam_width`` hypotheses of one prompt, best first."""

    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence]


def check_messages(conversation: Any, name: str = "messages") -> None:
    """A conversation is a non-empty list of dicts, each with a ``role`` and a ``content`` that are
    text; a ``ValueError`` names the first bad one (``messages[2].content``)."""
    if not isinstance(conversation, (list, tuple)) or not conversation:
        raise ValueError(f"{name} must be a non-empty list of {{'role': ..., 'content': ...}} dicts, "
                         f"got {shown(conversation)}")
    for i, message in enumerate(conversation):
        if not isinstance(message, Mapping):
            raise ValueError(f"{name}[{i}] must be a dict with 'role' and 'content', got {shown(message)}")
        for key in ("role", "content"):
            if key not in message:
                raise ValueError(f"{name}[{i}].{key} is missing (the message is {shown(message)})")
            check_text(f"{name}[{i}].{key}", message[key])


def chat_token_ids(tokenizer: Any, conversation: list[dict[str, str]], add_generation_prompt: bool = True,
                   name: str = "messages") -> list[int]:
    """One conversation (checked by ``check_messages``) through the tokenizer's chat template, as
    token ids; ``name`` is what errors call it."""
    check_messages(conversation, name)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{name}: the tokenizer has no chat template")
    ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=True)
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def _prompt_list(prompts: Any) -> list[Any]:
    """One prompt (a str or a dict) or an iterable of them, as a list."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    try:
        return list(prompts)
    except TypeError:
        raise ValueError(f"prompts must be a str, a dict or a list of them, got {shown(prompts)}") from None


class LLM:
    def __init__(self, model: str | None = None, **engine_kwargs: Any) -> None:
        """``model``: a Hub id, a local folder or a ``.gguf`` file (None: the embedded default).
        Every other keyword is an ``EngineArgs`` field, with that field's default when left out."""
        unknown = sorted(set(engine_kwargs) - set(EngineArgs.field_names()))
        if unknown:
            raise TypeError(
                f"LLM() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; "
                f"engine arguments are: {', '.join(EngineArgs.field_names())}"
            )
        args = EngineArgs(model=model, **engine_kwargs)
        self.llm_engine = LLMEngine(args)
        self._counter = 0

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def _next_id(self) -> str:
        self._counter += 1
        return str(self._counter)

    def _run(self, prompts: Sequence[Any], params: Sequence[SamplingParams] | None, use_tqdm: bool,
             beam: dict[str, Any] | None = None) -> list[RequestOutput]:
        engine = self.llm_engine
        ids: list[str] = []
        try:
            for i, p in enumerate(prompts):
                rid = self._next_id()
                if beam is not None:
                    engine.add_beam_request(rid, p, **beam)
                else:
                    engine.add_request(rid, p, params[i])
                ids.append(rid)
        except Exception:
            engine.abort_request(ids)  # nothing half-submitted is left behind
            raise
        order = {rid: i for i, rid in enumerate(ids)}
        results: list[RequestOutput | None] = [None] * len(ids)
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", unit="req", dynamic_ncols=True)
        t0, generated = time.perf_counter(), 0
        try:
            while engine.has_unfinished_requests():
                for o in engine.step():
                    if o.finished and o.request_id in order:
                        results[order[o.request_id]] = o
                        generated += sum(len(c.token_ids) for c in o.outputs)
                        if bar is not None:
                            bar.update(1)
                            bar.set_postfix_str(f"{generated / (time.perf_counter() - t0):.1f} tok/s")
        except BaseException:
            engine.abort_request(ids)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [r for r in results if r is not None]

    def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generates for every prompt (a str, ``{"prompt_token_ids": [...]}``, or a list of them);
        returns one finished ``RequestOutput`` per prompt, in order."""
        prompts = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"sampling_params: got {len(params)} for {len(prompts)} prompts (give one, or one per prompt)"
                )
        return self._run(prompts, params, use_tqdm)

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Applies the tokenizer's chat template to one conversation (or a list of them)."""
        if isinstance(messages, (list, tuple)) and all(isinstance(c, (list, tuple)) for c in messages):
            named = [(f"messages[{i}]", conv) for i, conv in enumerate(messages)]
        else:
            named = [("messages", messages)]
        tok = self.get_tokenizer()
        prompts = [{"prompt_token_ids": chat_token_ids(tok, conv, add_generation_prompt, name)} for name, conv in named]
        return self.generate(prompts, sampling_params, use_tqdm)

    def beam_search(self, prompts: Any, beam_width: int, max_tokens: int, length_penalty: float = 1.0,
                    ignore_eos: bool = False, use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search built on the core's fork and copy-on-write (transformers' semantics)."""
        prompts = _prompt_list(prompts)
        beam = dict(beam_width=beam_width, max_tokens=max_tokens, length_penalty=length_penalty,
                    ignore_eos=ignore_eos)
        outs = self._run(prompts, None, use_tqdm, beam=beam)
        return [
            BeamSearchOutput(o.prompt, o.prompt_token_ids,
                             [BeamSearchSequence(c.token_ids, c.text, c.cumulative_logprob, c.finish_reason)
                              for c in o.outputs])
            for o in outs
        ]
