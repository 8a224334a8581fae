"""What the engine hands back to users: vLLM-shaped request and completion outputs.

Invariants:

* ``CompletionOutput.finish_reason`` is ``None`` while the sequence runs, else one of ``"stop"``
  (EOS, a stop token id or a stop string), ``"length"`` (max_tokens / max_model_len) or
  ``"abort"``. ``stop_reason`` is the matched stop string (``str``) or stop token id (``int``);
  ``None`` for EOS, length and abort -- as in vLLM.
* ``logprobs``, when requested, holds one ``dict[token_id, Logprob]`` per generated token, the
  sampled token first, then the top alternatives by rank (the sampled token appears once even if
  it is also among the top). ``cumulative_logprob`` is the sum of the sampled tokens' logprobs,
  ``None`` when logprobs were not computed.
* ``RequestOutput.request_id`` is a ``str``; ``finished`` is True once every completion has a
  ``finish_reason``.
* What an output holds depends on its request's ``SamplingParams.output_kind``, as in vLLM:
  ``CUMULATIVE`` every text, token and logprob so far (each output's ``token_ids`` and ``logprobs``
  keep what they had when it was made: O(1) snapshots, copied when first read; vLLM's share one
  growing list), ``DELTA`` only what is new since the
  request's previous output (the pieces concatenate to the cumulative ones), ``FINAL_ONLY`` one
  output, when the request has finished.
* ``RequestOutput.metrics`` holds the request's timestamps (``RequestStateStats``): ``*_ts`` on
  ``time.monotonic()``'s clock, recorded once by the scheduler core; ``arrival_time`` is
  ``time.time()`` when the engine took the request.

Costs: plain containers; ``__repr__`` is O(1) in the sequence length (long lists are elided).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "CompletionOutput",
    "ListPrefix",
    "FinishReason",
    "Logprob",
    "PromptLogprobs",
    "RequestOutput",
    "RequestOutputKind",
    "RequestStateStats",
    "SampleLogprobs",
    "TextSoFar",
    "make_logprobs_entry",
]


class RequestOutputKind(enum.IntEnum):
    """What each ``RequestOutput`` of a request carries (vLLM's names and values)."""

    CUMULATIVE = 0  # everything so far, every step
    DELTA = 1  # only what is new since the previous output, every step
    FINAL_ONLY = 2  # one output, when the request has finished


@dataclass(slots=True)
class RequestStateStats:
    """A request's timestamps, in the shape of vLLM's ``RequestStateStats``.

    ``arrival_time`` is wall-clock (``time.time()``) when the engine took the request; the
    ``*_ts`` fields are ``time.monotonic()`` seconds recorded once by the scheduler core (0.0 =
    not yet): queued (``add_request``), first scheduled, first and latest generated token, and
    finished. ``first_token_latency`` is ``first_token_ts - queued_ts`` (0.0 before the first
    token). ``num_generation_tokens`` counts the tokens generated for the request so far (all
    its samples)."""

    num_generation_tokens: int = 0
    arrival_time: float = 0.0
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0
    first_token_ts: float = 0.0
    last_token_ts: float = 0.0
    finished_ts: float = 0.0
    first_token_latency: float = 0.0

FinishReason = Literal["stop", "length", "abort"]

# Long lists in reprs are cut to this many items: a 4k-token completion should still print as a line.
_REPR_ITEMS = 8


def _short(seq: Sequence[object] | None) -> str:
    if seq is None:
        return "None"
    if len(seq) <= _REPR_ITEMS:
        return repr(list(seq))
    head = ", ".join(repr(x) for x in seq[:_REPR_ITEMS])
    return f"[{head}, ... ({len(seq)} total)]"


@dataclass(slots=True)
class Logprob:
    """Log probability of one token; ``rank`` 1 = most likely; ``decoded_token`` its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]  # first prompt token has no logprob -> None


def make_logprobs_entry(
    token_id: int,
    logprob: float,
    rank: int,
    top_ids: Sequence[int] = (),
    top_logprobs: Sequence[float] = (),
    decode: Callable[[int], str] | None = None,
) -> dict[int, Logprob]:
    """Builds one position's ``{token_id: Logprob}`` dict: sampled token first, then top-k (a
    sampled token that is among them takes its top-k position as its rank, as in vLLM, so ranks
    of one entry never repeat even when logprobs tie).

    Feed it one row of :class:`ferrokv.sampler.LogprobsResult` (sliced to ``num_top``); ``decode``
    (e.g. :func:`ferrokv.detokenizer.decode_token` bound to a tokenizer) fills ``decoded_token``.
    """
    token_id = int(token_id)
    entry = {
        token_id: Logprob(float(logprob), int(rank), decode(token_id) if decode else None)
    }
    for i, (tid, lp) in enumerate(zip(top_ids, top_logprobs)):
        tid = int(tid)
        if tid == token_id:
            entry[tid] = Logprob(entry[tid].logprob, i + 1, entry[tid].decoded_token)
        else:
            entry[tid] = Logprob(float(lp), i + 1, decode(tid) if decode else None)
    return entry


class TextSoFar:
    """A sequence's text as it grows, for CUMULATIVE outputs: appended pieces, joined only when
    an output's ``text`` is read, so that building an output per step costs O(1) however long
    the text is. Every 32 pieces are joined into a chunk, and chunks merge as a binary counter
    does (two of 2^k batches make one of 2^(k+1)): at most 31 + log2(pieces / 32) + 1 entries, and
    each character is copied O(log pieces) times in all, so appending costs amortized O(1) for a
    short text and O(log) for a very long one (a plain periodic join of everything was O(length)).
    Snapshots stay valid as it grows: a list is only appended to, and a merge makes a new one."""

    __slots__ = ("_pieces", "_levels")

    def __init__(self) -> None:
        self._pieces: list[str] = []  # the merged chunks, then up to 31 pieces as appended
        self._levels: list[int] = []  # chunk i holds 2^levels[i] batches of 32; levels strictly decrease

    def append(self, piece: str) -> None:
        if not piece:
            return
        pieces, levels = self._pieces, self._levels
        pieces.append(piece)
        k = len(levels)
        if len(pieces) - k < 32:
            return
        chunk, level = "".join(pieces[k:]), 0
        while k and levels[k - 1] == level:
            k, level, chunk = k - 1, level + 1, pieces[k - 1] + chunk
        self._pieces, self._levels = [*pieces[:k], chunk], [*levels[:k], level]

    def snapshot(self) -> _TextSnapshot:
        return _TextSnapshot(self._pieces, len(self._pieces))


class _TextSnapshot:
    __slots__ = ("pieces", "n")

    def __init__(self, pieces: list[str], n: int) -> None:
        self.pieces, self.n = pieces, n

    def join(self) -> str:
        return "".join(self.pieces[: self.n])


class ListPrefix:
    """The first ``n`` items of a list that is only appended to (a CUMULATIVE sequence's token ids
    or logprobs): an output built per step holds one in O(1) and copies it when first read, so
    the output stays as it was built while the engine appends, also from the engine's thread (a
    slice is one step under the GIL)."""

    __slots__ = ("items", "n")

    def __init__(self, items: list[Any], n: int) -> None:
        self.items, self.n = items, n

    def take(self) -> list[Any]:
        return self.items[: self.n]

    def __reduce__(self) -> tuple[Any, ...]:  # pickled, deep-copied: the prefix alone, as a list
        return list, (self.take(),)


class CompletionOutput:
    """One of the ``n`` completions of a request (cumulative: text/token_ids so far).

    A plain attribute class with vLLM's fields (``index``, ``text``, ``token_ids``,
    ``cumulative_logprob``, ``logprobs``, ``finish_reason``, ``stop_reason``, ``lora_request``:
    None, as no adapter is supported); ``text`` may be given as a ``TextSoFar`` snapshot, joined
    the first time it is read, and ``token_ids``/``logprobs`` as ``ListPrefix``es, copied then."""

    __slots__ = ("index", "_text", "_token_ids", "cumulative_logprob", "_logprobs", "finish_reason", "stop_reason",
                 "lora_request")

    def __init__(self, index: int, text: str | _TextSnapshot, token_ids: list[int] | ListPrefix,
                 cumulative_logprob: float | None = None, logprobs: SampleLogprobs | ListPrefix | None = None,
                 finish_reason: FinishReason | None = None, stop_reason: int | str | None = None,
                 lora_request: Any = None) -> None:
        self.lora_request = lora_request
        self.index = index
        self._text = text
        self._token_ids = token_ids
        self.cumulative_logprob = cumulative_logprob
        self._logprobs = logprobs
        self.finish_reason = finish_reason
        self.stop_reason = stop_reason

    @property
    def text(self) -> str:
        t = self._text
        if t.__class__ is not str:
            t = self._text = t.join()
        return t

    @text.setter
    def text(self, value: str) -> None:
        self._text = value

    @property
    def token_ids(self) -> list[int]:
        t = self._token_ids
        if t.__class__ is ListPrefix:
            t = self._token_ids = t.take()
        return t

    @token_ids.setter
    def token_ids(self, value: list[int]) -> None:
        self._token_ids = value

    @property
    def logprobs(self) -> SampleLogprobs | None:
        lp = self._logprobs
        if lp.__class__ is ListPrefix:
            lp = self._logprobs = lp.take()
        return lp

    @logprobs.setter
    def logprobs(self, value: SampleLogprobs | None) -> None:
        self._logprobs = value

    def _key(self) -> tuple:
        return (self.index, self.text, self.token_ids, self.cumulative_logprob, self.logprobs,
                self.finish_reason, self.stop_reason)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._key() == other._key()  # type: ignore[attr-defined]

    __hash__ = None  # type: ignore[assignment]  # mutable, like the dataclass it replaces

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        lp = "None" if self.logprobs is None else f"<{len(self.logprobs)} positions>"
        return (
            f"CompletionOutput(index={self.index}, text={self.text!r}, "
            f"token_ids={_short(self.token_ids)}, cumulative_logprob={self.cumulative_logprob}, "
            f"logprobs={lp}, finish_reason={self.finish_reason!r}, "
            f"stop_reason={self.stop_reason!r})"
        )


@dataclass
class _CompletionOutputFields:
    """vLLM's ``CompletionOutput`` fields, in its order: ``CompletionOutput`` (a slots class, for
    its lazily joined text) presents them as its dataclass fields, so ``dataclasses.fields``,
    ``asdict`` and ``replace`` work on it as on vLLM's."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    lora_request: Any = None


CompletionOutput.__dataclass_fields__ = _CompletionOutputFields.__dataclass_fields__  # type: ignore[attr-defined]
CompletionOutput.__dataclass_params__ = _CompletionOutputFields.__dataclass_params__  # type: ignore[attr-defined]


@dataclass(slots=True)
class RequestOutput:
    """Everything produced so far for one request. vLLM's fields in vLLM's order, so positional
    construction means the same (``lora_request``, the encoder prompt and ``kv_transfer_params``
    are None here: no adapters, encoder-decoder models or KV transfer)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: RequestStateStats | None = None
    lora_request: Any = None
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """vLLM's merge of a later output of the same request into this one: per completion
        index, ``aggregate`` (DELTA outputs) concatenates text, tokens and logprobs, else the
        later completion replaces this one's; the later state (finish, stop reason, cumulative
        logprob, cache hits, metrics) wins. Completions stay in index order."""
        by_index = {c.index: c for c in self.outputs}
        for c in next_output.outputs:
            old = by_index.get(c.index)
            if old is None:
                self.outputs.append(c)
                by_index[c.index] = c
            elif not aggregate:
                self.outputs[self.outputs.index(old)] = by_index[c.index] = c
            else:
                old.text = old.text + c.text
                old.token_ids = old.token_ids + c.token_ids
                if old.logprobs is not None and c.logprobs is not None:
                    old.logprobs = old.logprobs + c.logprobs
                old.cumulative_logprob, old.finish_reason, old.stop_reason = \
                    c.cumulative_logprob, c.finish_reason, c.stop_reason
        self.outputs.sort(key=lambda c: c.index)
        self.finished = self.finished or next_output.finished
        self.num_cached_tokens, self.metrics = next_output.num_cached_tokens, next_output.metrics

    def __repr__(self) -> str:
        plp = "None" if self.prompt_logprobs is None else f"<{len(self.prompt_logprobs)} positions>"
        outs = ", ".join(repr(o) for o in self.outputs)
        return (
            f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
            f"prompt_token_ids={_short(self.prompt_token_ids)}, outputs=[{outs}], "
            f"finished={self.finished}, num_cached_tokens={self.num_cached_tokens}, "
            f"prompt_logprobs={plp}, metrics={self.metrics!r})"
        )
