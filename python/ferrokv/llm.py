"""``LLM``: the offline generation API, with vLLM's names and semantics.

``LLM(model=None, ...)`` loads a Hugging Face Hub id (from the HF cache, else downloaded), a local
Hugging Face folder, or a ``.gguf`` file (converted once and cached); ``model=None`` is the embedded
SmolLM2-135M-Instruct. Every engine argument is a keyword with the CLI flag's name and the
``EngineArgs`` field's default; an unknown keyword is a ``TypeError``.

Threads: the engine is driven by one ``EngineLoop`` (its thread starts on the first call), so
``generate``, ``chat`` and ``beam_search`` may be called from several threads at once, each
getting its own outputs. A call that is interrupted (``KeyboardInterrupt``) or fails aborts its
requests, waits until the loop has ended them (at most one step) and re-raises; the ``LLM``
stays usable. ``llm_engine.abort_request`` from another thread ends a request of a running call,
which then returns that request's output with ``finish_reason`` "abort". Request ids are
``str`` of a counter from 1, as in vLLM (from 0 there).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ferrokv.beam_search_params import BeamSearchParams
from ferrokv.chat_content_format import with_content_format
from ferrokv.checks import PoolingUnsupportedError, check_int, check_text, shown
from ferrokv.engine import LLMEngine
from ferrokv.engine_args import EngineArgs, vllm_only_method, without_vllm_only_args
from ferrokv.engine_loop import EngineLoop, StreamItem
from ferrokv.inputs import (batch_prompts, check_documents, check_no_lora, check_tools, message_text,
                            message_tool_fields, template_kwargs, tokenization_options, tokenized_prompt,
                            with_truncation)
from ferrokv.metrics_reader import Metric, engine_metrics, engine_stats
from ferrokv.outputs import Logprob, RequestOutput, RequestOutputKind
from ferrokv.sampling_params import SamplingParams
from ferrokv.structured_outputs import StructuredOutputsParams

logger = logging.getLogger("ferrokv")
# An OpenAI chat message: role, content (a str, content parts or None), tool calls... (vLLM's
# ChatCompletionMessageParam); checked at run time by checked_messages.
ChatMessage = Mapping[str, Any]


@dataclass(slots=True)
class BeamSearchSequence:
    """One finished beam, as vLLM's: ``tokens`` are the prompt's then the generated ones (a
    stopping EOS included), ``logprobs`` one ``{token: Logprob}`` per generated token, ``text``
    the tokenizer's decode of all ``tokens`` (special tokens kept, as vLLM's)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    lora_request: Any = None
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    multi_modal_data: Any = None
    mm_processor_kwargs: dict[str, Any] | None = None


@dataclass(slots=True)
class BeamSearchOutput:
    """The best ``beam_width`` hypotheses of one prompt, best first (vLLM's ``sequences``; the
    prompt is ferrokv's addition)."""

    sequences: list[BeamSearchSequence]
    prompt: str | None = None
    prompt_token_ids: list[int] = field(default_factory=list)


def checked_messages(conversation: Any, name: str = "messages") -> list[dict[str, Any]]:
    """A conversation: a non-empty list of dicts, each with a ``role`` that is text and a
    ``content`` that is text or a list of text parts (``message_text``: joined here); a
    ``ValueError`` names the first bad one (``messages[2].content``). Returns copies with the
    content as text, tool calls' arguments as objects (``message_tool_fields``), and the
    messages' other keys kept."""
    if not isinstance(conversation, (list, tuple)) or not conversation:
        raise ValueError(f"{name} must be a non-empty list of {{'role': ..., 'content': ...}} dicts, "
                         f"got {shown(conversation)}")
    out = []
    for i, message in enumerate(conversation):
        if not isinstance(message, Mapping):
            raise ValueError(f"{name}[{i}] must be a dict with 'role' and 'content', got {shown(message)}")
        # A content left out (or null) is empty text, as vLLM reads it (a turn that only called tools).
        if "role" not in message:
            raise ValueError(f"{name}[{i}].role is missing (the message is {shown(message)})")
        check_text(f"{name}[{i}].role", message["role"])
        out.append({**message, "content": message_text(message.get("content"), f"{name}[{i}].content",
                                                        message["role"]),
                    **message_tool_fields(message, f"{name}[{i}]")})
    return out




def chat_token_ids(tokenizer: Any, conversation: Sequence[ChatMessage], add_generation_prompt: bool = True,
                   name: str = "messages", **template: Any) -> list[int]:
    """``chat_prompt``'s token ids."""
    return chat_prompt(tokenizer, conversation, add_generation_prompt, name, **template)[1]


def chat_prompt(tokenizer: Any, conversation: Sequence[ChatMessage], add_generation_prompt: bool = True,
                name: str = "messages", *, chat_template: str | None = None, continue_final_message: bool = False,
                chat_template_kwargs: Mapping[str, Any] | None = None, tools: list[Any] | None = None,
                documents: list[Mapping[str, str]] | None = None,
                content_format: str = "auto", add_special_tokens: bool = False) -> tuple[str, list[int]]:
    """One conversation (checked by ``checked_messages``) through the chat template (the
    tokenizer's, or ``chat_template``): the rendered text and its token ids (tokenized without
    special tokens of the tokenizer's own, as transformers and vLLM do: the template has them;
    ``add_special_tokens``, vLLM's chat field, adds them on top);
    ``name`` is what errors call it. A template's own refusal or syntax error is a ``ValueError``
    naming it. ``chat_template_kwargs``: extra variables for the template (vLLM's; e.g.
    ``enable_thinking``); ``tools``: OpenAI's tool definitions, for a template that shows them;
    ``documents``: vLLM's, for a retrieval-augmented template;
    ``content_format``: how the template reads a message's content (``ferrokv.chat_content_format``)."""
    from jinja2.exceptions import TemplateError  # transformers renders chat templates with jinja2

    conversation = checked_messages(conversation, name)
    extra = template_kwargs(chat_template_kwargs)
    # vLLM's: the kwargs come last, so they override the arguments of these names.
    add_generation_prompt = extra.pop("add_generation_prompt", add_generation_prompt)
    continue_final_message = extra.pop("continue_final_message", continue_final_message)
    tools = extra.pop("tools", tools)
    check_documents(documents)  # the argument's; chat_template_kwargs' values go to the template as they are
    documents = extra.pop("documents", documents)
    for flag, v in (("add_generation_prompt", add_generation_prompt), ("continue_final_message", continue_final_message)):
        if not isinstance(v, bool):
            raise ValueError(f"{flag} must be a bool, got {shown(v)}")
    if add_generation_prompt and continue_final_message:
        raise ValueError("continue_final_message=True continues the last message: add_generation_prompt must be False")
    if chat_template is not None:
        check_text("chat_template", chat_template)
        if not chat_template.strip():
            raise ValueError("chat_template must be a non-empty Jinja template string")
    elif not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{name}: the tokenizer has no chat template; give one (chat_template=, or the server's "
                         f"--chat-template)")
    check_tools(tools)
    which = "chat_template" if chat_template is not None else f"{name}: the model's chat template"
    template = _one_template(tokenizer, chat_template, tools, which)
    conversation = with_content_format(conversation, content_format, template)
    try:
        text = tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False, tools=tools,
                                             documents=documents, add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, **extra)
    except TemplateError as e:
        raise ValueError(f"{which} refused this conversation ({_escaped(e)})") from None
    except Exception as e:  # noqa: BLE001  the template's code failed on what the caller gave it
        raise ValueError(f"{which} failed on this conversation{' and chat_template_kwargs' if extra else ''} "
                         f"({type(e).__name__}: {_escaped(e)})") from None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{which} rendered text with a lone surrogate (from chat_template_kwargs?), "
                         "which is not valid Unicode") from None
    return text, list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def _one_template(tokenizer: Any, chat_template: str | None, tools: Any, which: str) -> str:
    """The one template string that renders, as vLLM resolves it (transformers'
    ``get_chat_template``): ``chat_template`` itself or the entry of the tokenizer's named set it
    names; none given, the set's "tool_use" entry when there are tools, else its "default"."""
    get = getattr(tokenizer, "get_chat_template", None)
    if get is None:
        return chat_template if chat_template is not None else tokenizer.chat_template
    try:
        return get(chat_template, tools=tools)
    except ValueError as e:  # a named set without a default entry
        raise ValueError(f"{which}: {e}") from None


def _escaped(e: BaseException) -> str:
    """An exception's message, with characters that cannot be UTF-8 (lone surrogates) escaped."""
    return str(e).encode("utf-8", "backslashreplace").decode("utf-8")




def _final_only(params: Any) -> Any:
    """``params`` asking for one output, when the request ends: no step builds the others
    (anything else is passed on for the engine to reject)."""
    if isinstance(params, SamplingParams):
        return dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
    return params


_ABANDON_POLL = 0.05  # seconds between checks that an abandoned request is still the loop's


def _name_prompt(error: BaseException, index: int) -> None:
    """Prefixes a refused prompt's error message, in place, with ``prompts[index]: ``; the
    exception keeps its type and attributes."""
    if error.args and isinstance(error.args[0], str):
        error.args = (f"prompts[{index}]: {error.args[0]}", *error.args[1:])


def _abandon(loop: EngineLoop, ids: list[str], done: dict[str, StreamItem], sink: queue.SimpleQueue[StreamItem]) -> None:
    """Aborts the requests of an interrupted or failed call and waits for the loop to end each
    (one step at most), so that their blocks are free when the call raises. An id the loop no
    longer holds has had its terminal item (the interrupt may have taken it from the sink before
    it was recorded): it is not waited for. Another interrupt stops the wait; the aborts are
    queued anyway."""
    waiting = {rid for rid in ids if rid not in done}
    loop.abort(sorted(waiting))
    while waiting:
        try:
            item = sink.get(timeout=_ABANDON_POLL)
        except queue.Empty:
            waiting &= loop.holding(waiting)
            continue
        done[item.request_id] = item
        waiting.discard(item.request_id)


class LLM:
    """vLLM's offline engine: ``generate``, ``chat`` and ``beam_search`` over one engine, from
    any number of threads (module docs)."""

    def __init__(self, model: str | None = None, **engine_kwargs: Any) -> None:
        """``model``: a Hub id, a local folder or a ``.gguf`` file (None: the embedded default).
        Every other keyword is an ``EngineArgs`` field, with that field's default when left out,
        or one of vLLM's that ferrokv has no use for, at a value that means what ferrokv does
        (``VLLM_ONLY_ARGS``)."""
        engine_kwargs = without_vllm_only_args(engine_kwargs)
        unknown = sorted(set(engine_kwargs) - set(EngineArgs.field_names()))
        if unknown:
            raise TypeError(
                f"LLM() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; "
                f"engine arguments are: {', '.join(EngineArgs.field_names())}"
            )
        args = EngineArgs(model=model, **engine_kwargs)
        self.llm_engine = LLMEngine(args)
        self.engine_loop = EngineLoop(self.llm_engine)
        # Joined (not only told to stop): a loop thread still ending while the interpreter
        # finalizes aborts the process (torch's threads are torn down under it).
        weakref.finalize(self, self.engine_loop.shutdown, True)
        self._request_counter = itertools.count()  # vLLM's first id is "0"
        self.supported_tasks = self.llm_engine.get_supported_tasks()

    def get_tokenizer(self, lora_request: Any = None) -> Any:
        check_no_lora(lora_request)  # vLLM's older signature
        return self.llm_engine.tokenizer

    def _pooling(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's pooling calls (encode, embed, classify, score, reward) run pooling models;
        ferrokv serves generative models only."""
        raise PoolingUnsupportedError("LLM.encode/embed/classify/score/reward run pooling models, which ferrokv "
                                      "does not serve (use generate or chat)")

    encode = embed = classify = score = reward = _pooling

    # vLLM's LLM methods for what ferrokv has none of: the true answer, or a refusal that says so.
    def reset_mm_cache(self) -> None:
        """Nothing to reset: ferrokv takes text only."""

    def sleep(self, level: int = 1) -> None:
        raise vllm_only_method("LLM", "sleep")

    def wake_up(self, tags: list[str] | None = None) -> None:
        raise vllm_only_method("LLM", "wake_up")

    def start_profile(self, *args: Any, **kwargs: Any) -> None:
        raise vllm_only_method("LLM", "start_profile")

    def stop_profile(self) -> None:
        raise vllm_only_method("LLM", "stop_profile")

    def collective_rpc(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        raise vllm_only_method("LLM", "collective_rpc")

    def apply_model(self, func: Any) -> Any:
        raise vllm_only_method("LLM", "apply_model")

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling parameters of a call that gives none: the model's generation config's
        recommendations (``EngineArgs.generation_config``), else ``SamplingParams()``."""
        return self.llm_engine.get_default_sampling_params()

    @property
    def model_config(self) -> Any:
        return self.llm_engine.model_config

    def get_metrics(self) -> list[Metric]:
        """vLLM's: a snapshot of the engine's counters and gauges (``ferrokv.metrics_reader``:
        tokens, prefix-cache lookups and hits, preemptions, running and waiting requests, KV-cache
        blocks and usage) and its histogram of tokens per step, named as ``/metrics`` names them;
        safe from any thread."""
        return engine_metrics(engine_stats(self.llm_engine), self.llm_engine.model_config.model)

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Empties the prefix cache (``LLMEngine.reset_prefix_cache``): True when done, False while
        another thread's requests are running. Safe between and during calls (it takes the engine
        lock). vLLM's ``reset_running_requests=True`` (preempting them) is not supported, nor
        ``reset_connector=True`` (there is no KV connector)."""
        if reset_connector is not False:
            raise ValueError(f"reset_connector={reset_connector!r} is not supported: ferrokv has no KV connector")
        if reset_running_requests is not False:
            raise ValueError(f"reset_running_requests={reset_running_requests!r} is not supported: the prefix cache "
                             "is reset only while no request runs")
        return self.llm_engine.reset_prefix_cache()

    def _next_id(self) -> str:
        return str(next(self._request_counter))  # atomic under the GIL: safe from any thread

    def _run(self, prompts: Sequence[Any], params: Sequence[SamplingParams] | None, use_tqdm: bool | Callable[..., Any],
             beam: dict[str, Any] | None = None, priority: Sequence[int] | None = None,
             first: int = 0, total: int | None = None) -> list[RequestOutput]:
        """Submits every prompt to the engine loop and returns their finished outputs in order. A
        prompt refused in a batch of ``total`` (``first``: the index of ``prompts[0]`` in it) has
        its error message name it (``prompts[i]: ...``)."""
        loop = self.engine_loop
        sink: queue.SimpleQueue[StreamItem] = queue.SimpleQueue()
        ids: list[str] = []
        done: dict[str, StreamItem] = {}
        bar = None
        if use_tqdm:
            # vLLM's use_tqdm: True, or a callable that makes the bar (e.g. partial(tqdm, leave=False)),
            # called and used as vLLM does (a bar class written for vLLM's works here).
            if callable(use_tqdm):
                make_bar = use_tqdm
            else:
                from tqdm.auto import tqdm as make_bar
            bar = make_bar(total=len(prompts), desc="Processed prompts", dynamic_ncols=True,
                           postfix=_SPEED.format(0.0, 0.0))
        t0, prompt_tokens, generated = time.perf_counter(), 0, 0
        grammars = self._start_grammars(params)  # held until the call ends
        try:
            for i, p in enumerate(prompts):
                rid = self._next_id()
                ids.append(rid)  # first: an interrupt during the submit still aborts it
                if beam is not None:
                    loop.submit_beam(rid, p, sink=sink, **beam)
                else:
                    loop.submit(rid, p, _final_only(params[i]), sink=sink,
                                priority=0 if priority is None else priority[i])
            while len(done) < len(ids):
                item = sink.get()
                done[item.request_id] = item
                if item.error is not None:  # a bad prompt or a failed step: the others are aborted below
                    if item.refused and (total or len(prompts)) > 1:
                        _name_prompt(item.error, first + ids.index(item.request_id))
                    raise item.error
                if bar is not None:
                    outs = item.output.outputs
                    prompt_tokens += len(item.output.prompt_token_ids or ()) * len(outs)
                    generated += sum(len(c.token_ids) for c in outs)
                    elapsed = time.perf_counter() - t0
                    bar.postfix = _SPEED.format(prompt_tokens / elapsed, generated / elapsed)
                    bar.update(1)
        except BaseException:
            _abandon(loop, ids, done, sink)
            raise
        finally:
            grammars.clear()
            if bar is not None:
                bar.close()
        return [done[rid].output for rid in ids]

    def _start_grammars(self, params: Sequence[Any] | None) -> list[Any]:
        """Starts the compile of every distinct grammar of the call at once, so that they share
        the compile threads (each submit then waits for its own); their futures. An error is
        left for the request's submit, which reports it."""
        started: list[Any] = []
        seen: set[int] = set()
        for p in params or ():
            so = getattr(p, "structured_outputs", None)
            if isinstance(so, StructuredOutputsParams) and id(so) not in seen:
                seen.add(id(so))
                try:
                    started.append(self.llm_engine.grammars.entry(so))
                except Exception:
                    pass
        return started

    def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | Callable[..., Any] = True, lora_request: Any = None, *,
                 priority: Sequence[int] | None = None,
                 tokenization_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Generates for every prompt (vLLM's forms, ``ferrokv.inputs``: a str, a ``TextPrompt`` or
        ``TokensPrompt`` dict, a list of ints, or a list of these); returns one finished
        ``RequestOutput`` per prompt, in order. A dict's ``cache_salt`` isolates its prefix cache.
        ``priority``: one per prompt (lower runs first), under ``scheduling_policy="priority"``
        only, as in vLLM. An empty list of prompts gives an empty list (vLLM's).
        ``tokenization_kwargs``: vLLM's, ``add_special_tokens`` (False: text prompts are tokenized
        without the tokenizer's own special tokens) and ``truncate_prompt_tokens`` (each prompt's
        last tokens kept, over the ``SamplingParams``' own)."""
        check_no_lora(lora_request)
        if isinstance(prompts, (list, tuple)) and not prompts:
            return []
        prompts = batch_prompts(prompts)
        add_special_tokens, truncate = tokenization_options(tokenization_kwargs)
        if not add_special_tokens:
            prompts = [tokenized_prompt(self.get_tokenizer(), p, False) for p in prompts]
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            if not isinstance(sampling_params, (list, tuple)):
                raise ValueError(f"sampling_params must be a SamplingParams or a list of them (one per prompt), "
                                f"got {shown(sampling_params)}")
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"sampling_params: got {len(params)} for {len(prompts)} prompts (give one, or one per prompt)"
                )
            for i, p in enumerate(params):
                if not isinstance(p, SamplingParams):
                    raise ValueError(f"sampling_params[{i}] must be a SamplingParams, got {shown(p)}")
        if truncate is not None:
            params = [with_truncation(p, truncate) for p in params]
        if priority is not None:
            if isinstance(priority, (str, bytes)) or not isinstance(priority, Sequence):
                raise ValueError(f"priority must be a list with one int per prompt, got {shown(priority)}")
            priority = list(priority)
            if len(priority) != len(prompts):
                raise ValueError(f"priority: got {len(priority)} for {len(prompts)} prompts (give one per prompt)")
        return self._run(prompts, params, use_tqdm, priority=priority)

    def chat(self, messages: Sequence[ChatMessage] | Sequence[Sequence[ChatMessage]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | Callable[..., Any] = True,
             lora_request: Any = None, chat_template: str | None = None,
             chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None, mm_processor_kwargs: Any = None,
             tokenization_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Applies the chat template (the tokenizer's, or ``chat_template``, a Jinja string) to one
        conversation (or a list of them); the arguments are vLLM's, in its order.
        ``continue_final_message`` leaves the last message open for the model to continue (vLLM's
        semantics: then ``add_generation_prompt`` must be False); ``tools`` (OpenAI's tool
        definitions) and ``chat_template_kwargs`` (extra variables) are given to the template.
        ``chat_template_content_format``: "string" (a message's text), "openai" (a list of text
        parts) or "auto" (what the template reads, ``ferrokv.chat_content_format``).
        vLLM's ``tokenization_kwargs`` are checked (the template writes the special tokens; a
        ``truncate_prompt_tokens`` applies) and ``mm_processor_kwargs`` must be empty (text only)."""
        truncate = tokenization_options(tokenization_kwargs)[1]
        if mm_processor_kwargs:
            raise ValueError(f"mm_processor_kwargs={shown(mm_processor_kwargs)} is not supported: "
                             "ferrokv takes text only")
        if isinstance(messages, (list, tuple)) and all(isinstance(c, (list, tuple)) for c in messages):
            named = [(f"messages[{i}]", conv) for i, conv in enumerate(messages)]
        else:
            named = [("messages", messages)]
        tok = self.get_tokenizer()
        prompts = []
        for name, conv in named:
            text, ids = chat_prompt(tok, conv, add_generation_prompt, name, chat_template=chat_template,
                                    continue_final_message=continue_final_message,
                                    chat_template_kwargs=chat_template_kwargs, tools=tools,
                                    content_format=chat_template_content_format)
            prompts.append({"prompt": text, "prompt_token_ids": ids})  # vLLM's output.prompt: the rendered text
        return self.generate(prompts, sampling_params, use_tqdm, lora_request,
                             tokenization_kwargs=None if truncate is None else {"truncate_prompt_tokens": truncate})

    def beam_search(self, prompts: Any, params: BeamSearchParams | int | None = None, *args: Any,
                    beam_width: int | None = None, **kwargs: Any) -> list[BeamSearchOutput]:
        """Beam search built on the core's fork and copy-on-write (transformers' semantics).

        vLLM's form is ``beam_search(prompts, BeamSearchParams(beam_width=..., max_tokens=...),
        lora_request, use_tqdm, concurrency_limit)``; ferrokv's earlier ``beam_search(prompts,
        beam_width, max_tokens, length_penalty, ignore_eos, use_tqdm)`` (``beam_width`` positionally
        or by keyword) builds the same ``BeamSearchParams``. Either form takes every name by keyword.
        ``concurrency_limit`` (vLLM's): at most that many prompts are searched at once."""
        kw = _beam_search_args(isinstance(params, BeamSearchParams), args, kwargs)
        max_tokens, length_penalty, ignore_eos, use_tqdm, lora_request, concurrency_limit = kw.values()
        check_no_lora(lora_request)
        if concurrency_limit is not None:
            check_int("concurrency_limit", concurrency_limit, 1, 1 << 31)
        if isinstance(params, BeamSearchParams):
            if beam_width is not None or max_tokens is not None:
                raise ValueError("beam_search: give a BeamSearchParams or beam_width and max_tokens, not both")
            p = params
            p.validate()  # its fields may have been assigned since construction
        else:
            if params is not None and beam_width is not None:
                raise ValueError(f"beam_search: beam_width given twice ({params!r} and beam_width={beam_width!r})")
            p = BeamSearchParams(beam_width=beam_width if params is None else params, max_tokens=max_tokens,
                                 length_penalty=length_penalty, ignore_eos=ignore_eos)
        if isinstance(prompts, (list, tuple)) and not prompts:
            return []  # (vLLM's), once the parameters were checked
        prompts = batch_prompts(prompts)
        beam = dict(beam_width=p.beam_width, max_tokens=p.max_tokens, length_penalty=p.length_penalty,
                    ignore_eos=p.ignore_eos)
        chunk = concurrency_limit or max(len(prompts), 1)
        outs = [o for i in range(0, len(prompts), chunk)
                for o in self._run(prompts[i:i + chunk], None, use_tqdm, beam=beam, first=i, total=len(prompts))]
        return [BeamSearchOutput([self._beam_sequence(o.prompt_token_ids, c) for c in o.outputs], o.prompt,
                                 o.prompt_token_ids) for o in outs]

    def _beam_sequence(self, prompt_token_ids: list[int], c: Any) -> BeamSearchSequence:
        """One hypothesis as vLLM's: the prompt's tokens first, the text their whole decode."""
        tokens = prompt_token_ids + c.token_ids
        return BeamSearchSequence(tokens, c.logprobs or [], cum_logprob=c.cumulative_logprob or 0.0,
                                  text=self.llm_engine.tokenizer.decode(tokens), finish_reason=c.finish_reason)


# vLLM's progress bar postfix.
_SPEED = "est. speed input: {:.2f} toks/s, output: {:.2f} toks/s"

_BEAM_DEFAULTS = {"max_tokens": None, "length_penalty": 1.0, "ignore_eos": False, "use_tqdm": False,
                  "lora_request": None, "concurrency_limit": None}
# What beam_search's positional arguments after ``params`` are, in vLLM's form and in ferrokv's earlier one.
_BEAM_POSITIONAL = {True: ("lora_request", "use_tqdm", "concurrency_limit"),
                    False: ("max_tokens", "length_penalty", "ignore_eos", "use_tqdm")}


def _beam_search_args(vllm_form: bool, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``beam_search``'s arguments after ``params`` by name (``_BEAM_DEFAULTS``' order); a TypeError,
    as Python's own, for too many, unknown or repeated ones."""
    names = _BEAM_POSITIONAL[vllm_form]
    if len(args) > len(names):
        raise TypeError(f"beam_search takes at most {2 + len(names)} positional arguments in this form "
                        f"(prompts, params, {', '.join(names)}), got {2 + len(args)}")
    unknown = sorted(set(kwargs) - set(_BEAM_DEFAULTS))
    if unknown:
        raise TypeError(f"beam_search got an unexpected keyword argument {unknown[0]!r}")
    given = dict(zip(names, args))
    twice = sorted(set(given) & set(kwargs))
    if twice:
        raise TypeError(f"beam_search got multiple values for argument {twice[0]!r}")
    return {**_BEAM_DEFAULTS, **given, **kwargs}
