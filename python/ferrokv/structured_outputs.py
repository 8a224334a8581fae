"""Structured outputs: decoding under a JSON schema, regex, choice list or grammar (llguidance).

``StructuredOutputsParams`` (vLLM's names) says what a request's output must match;
``GrammarCompiler`` (``ferrokv.grammar_compiler``, re-exported here) turns it into an llguidance
grammar once per distinct params;
``GrammarRows`` is the engine's per-step state: one matcher per generation, the bitmask of each
grammar row's allowed next tokens, the masking of logits, and the advance by the sampled token.

Invariants:

* A params object sets exactly one of ``json``/``regex``/``choice``/``grammar``/``json_object``;
  ``validate`` (run on construction) raises ``ValueError`` naming ``structured_outputs.<field>``.
  ``cache_key()`` is canonical: a schema's keyword order, and dict vs JSON text, do not matter;
  the order of its ``properties`` does (llguidance generates properties in that order), as does
  the key order of the data in ``enum``/``const``.
* A ``CompiledGrammar`` is immutable and shared by every request with the same key; each
  generation (``key = request_core_id * 65536 + sample_index``) gets its own matcher, a deep copy
  of the grammar's template matcher, made the first time the key is seen.
* Masks are ``ceil(n_vocab / 32)`` int32 words per row, bit ``t % 32`` of word ``t // 32`` set
  when token ``t`` is allowed, ``n_vocab = max(vocab_size, len(tokenizer))``. Ids the tokenizer
  lacks (logits padding) are never allowed, nor are special tokens other than EOS (llguidance
  matches no text to them; its one exception, which vLLM shares: a literal whose text is a special
  token's is forced as that token, which its matcher then rejects); columns of the logits beyond
  the mask are masked too.
* A stopped matcher (the grammar is complete and admits nothing more) allows only EOS, and so does
  a matcher in error: the sequence ends. Its output then need not match the grammar. An error
  comes from a token the matcher rejects (a bug upstream) or from a limit of llguidance's lexer or
  parser that a pathological grammar hits only while decoding (``(a{1000}){1000}``; a schema of
  thousands of optional properties, past ``MAX_ITEMS_IN_ROW`` of the compiler); ``accept`` never
  raises, and logs a warning with llguidance's message when a matcher falls into error (as vLLM).
  Matchers share their template's lexer, so such a grammar is dropped from the compiler's cache
  (``GrammarRows.on_failed_grammar``): the next request with it starts from a fresh template.

Threading: ``GrammarRows`` guards its bookkeeping with a lock, but a matcher's state is not: the
engine orders, per key, ``fill`` (step t) -> ``apply`` -> sample -> ``accept`` (step t) -> ``fill`` (step t+1), and may run
``fill``/``apply`` on a worker thread as long as nothing else touches those keys meanwhile.

Costs: a matcher ~µs (a deep copy of the grammar's template); ``fill``
~10-100 µs per row, with several rows in parallel on llguidance's threads without the GIL;
``apply`` O(R * V) torch ops plus one host-to-device copy of R * V / 8 bytes; ``rows_of`` one
``searchsorted`` over the registered ids (``ferrokv.id_index``: registering is O(1) amortized).
Importing this module costs only the standard library (params are built per request on API threads): numpy, torch and llguidance are imported by the compiler and the rows.
"""

from __future__ import annotations

import json as _json
import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from ferrokv.grammar_compiler import _MAX_ERROR, CompiledGrammar, GrammarCompiler, LazyGrammarCompiler

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    import llguidance
    import numpy as np
    import torch

__all__ = ["KEY_STRIDE", "CompiledGrammar", "GrammarCompiler", "GrammarRows", "GrammarStep", "LazyGrammarCompiler",
           "StructuredOutputsParams", "grammar_key"]

KEY_STRIDE = 65536  # key = request_core_id * KEY_STRIDE + sample_index
_KINDS = ("json", "regex", "choice", "grammar", "json_object")
logger = logging.getLogger("ferrokv")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


def _canonical(node: Any, in_properties: bool = False) -> Any:
    """A schema with its keywords sorted, but not the order llguidance generates in: the property
    names of ``properties`` and the values of ``enum``/``const``/``default``/``examples`` (data)."""
    if isinstance(node, list):
        return [_canonical(x) for x in node]
    if not isinstance(node, dict):
        return node
    items = node.items() if in_properties else sorted(node.items())
    return {k: v if not in_properties and k in ("enum", "const", "default", "examples")
            else _canonical(v, in_properties=not in_properties and k == "properties") for k, v in items}


@dataclass(slots=True)
class StructuredOutputsParams:
    """What a request's output must match: exactly one of ``json`` (a JSON schema, dict or JSON
    text), ``regex``, ``choice`` (one of these strings), ``grammar`` (Lark as llguidance takes it,
    or GBNF when it has ``::=``), ``json_object=True`` (any JSON object). The other three options
    shape JSON output only: ``disable_any_whitespace`` (no whitespace between tokens),
    ``disable_additional_properties`` (every object with ``properties`` takes no others unless it
    says so; left False, objects are still strict as vLLM's default backend compiles them, except
    where that would forbid a valid object: in a schema with ``allOf``, or an object that requires
    a key it does not list), ``whitespace_pattern`` (the regex of whitespace between tokens; it wins over
    ``disable_any_whitespace``). vLLM's ``disable_fallback`` is accepted: there is one backend, so
    no request ever falls back to another; its ``structural_tag`` is refused (not supported)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    disable_fallback: bool = False
    structural_tag: str | None = None
    # The schema as canonical JSON text (keywords sorted, see _canonical), set by validate().
    _schema: str | None = field(default=None, init=False, repr=False, compare=False)

    KINDS: ClassVar[tuple[str, ...]] = _KINDS  # the constraint fields; the others are options
    FIELDS: ClassVar[tuple[str, ...]] = (*_KINDS, "disable_any_whitespace", "disable_additional_properties",
                                         "whitespace_pattern", "disable_fallback", "structural_tag")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Checks every field's type and the exactly-one rule; raises ``ValueError``."""
        self._schema = None if self.json is None else self._canonical_schema(self.json)
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError(f"structured_outputs.regex must be a string, got {_show(self.regex)}")
        c = self.choice
        if c is not None and (not isinstance(c, list) or not c or not all(isinstance(s, str) for s in c)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {_show(c)}")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError(f"structured_outputs.grammar must be a non-empty string, got {_show(self.grammar)}")
        if self.structural_tag is not None:
            raise ValueError(f"structured_outputs.structural_tag is not supported (got {_show(self.structural_tag)}): "
                             f"give json, regex, choice, grammar or json_object")
        for name in ("json_object", "disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
            value = getattr(self, name)
            if not (type(value) is bool or (value is None and name == "json_object")):
                raise ValueError(f"structured_outputs.{name} must be a bool, got {_show(value)}")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise ValueError(f"structured_outputs.whitespace_pattern must be a string, got "
                             f"{_show(self.whitespace_pattern)}")
        chosen = self._chosen()
        if len(chosen) != 1:
            names = ", ".join(f"structured_outputs.{k}" for k in _KINDS)
            got = ", ".join(chosen) if chosen else "none"
            raise ValueError(f"exactly one of {names} (=True) must be set, got {got}")

    @property
    def schema_json(self) -> str | None:
        """``json`` as canonical JSON text (keyword order normalized, ``properties`` order kept)."""
        return self._schema

    @staticmethod
    def _canonical_schema(schema: Any) -> str:
        if isinstance(schema, str):
            try:
                schema = _json.loads(schema)
            except (ValueError, RecursionError) as e:
                raise ValueError(f"structured_outputs.json is not valid JSON ({e}), got {_show(schema)}") from None
        if not isinstance(schema, dict):
            raise ValueError(f"structured_outputs.json must be a JSON schema object (a dict or JSON text), "
                             f"got {_show(schema)}")
        try:
            return _json.dumps(_canonical(schema), allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"structured_outputs.json is not JSON-serializable: {e}") from None
        except RecursionError:  # not shown: its repr would recurse as deep
            raise ValueError("structured_outputs.json is nested too deeply") from None

    @property
    def kind(self) -> str:
        """The field that holds the constraint: ``json``, ``regex``, ``choice``, ``grammar`` or
        ``json_object``."""
        return self._chosen()[0]

    def _chosen(self) -> list[str]:
        return [k for k in _KINDS if (self.json_object is True if k == "json_object" else getattr(self, k) is not None)]

    def cache_key(self) -> tuple:
        """A hashable key, equal for params that compile to the same grammar."""
        kind = self.kind
        if kind in ("json", "json_object"):
            return (kind, self._schema, self.disable_any_whitespace, self.disable_additional_properties,
                    self.whitespace_pattern)
        return (kind, tuple(self.choice) if kind == "choice" else getattr(self, kind))

    @classmethod
    def from_dict(cls, d: dict) -> StructuredOutputsParams:
        """From the server's JSON body (vLLM's field names); an unknown key raises ``ValueError``."""
        if not isinstance(d, dict):
            raise ValueError(f"structured_outputs must be an object, got {_show(d)}")
        for key in d:
            if key not in cls.FIELDS:
                raise ValueError(f"unknown field structured_outputs.{key} (known: {', '.join(cls.FIELDS)})")
        return cls(**d)


_BIT_BIAS: dict[Any, Any] = {}


def _bit_bias(device: Any) -> torch.Tensor:
    """``[256, 8]`` float32: entry ``[b, i]`` is 0 when bit ``i`` of byte ``b`` is set, else -inf."""
    import torch

    t = _BIT_BIAS.get(device)
    if t is None:
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
        t = _BIT_BIAS[device] = torch.where(bits == 1, 0.0, float("-inf")).to(device=device, dtype=torch.float32)
    return t


def grammar_key(req_ids: np.ndarray, sample_idx: np.ndarray) -> np.ndarray:
    """The int64 generation keys ``req_id * 65536 + sample_index`` (``0 <= sample_index < 65536``)."""
    import numpy as np

    s = np.asarray(sample_idx, dtype=np.int64)
    if s.size and (s.min() < 0 or s.max() >= KEY_STRIDE):
        raise ValueError(f"sample indices must be in [0, {KEY_STRIDE}), got {s.min()}..{s.max()}")
    return np.asarray(req_ids, dtype=np.int64) * KEY_STRIDE + s


@dataclass(slots=True)
class _Request:
    compiled: CompiledGrammar
    matchers: dict[int, Any] = field(default_factory=dict)  # sample index -> LLMatcher
    thinks: bool = False  # reasons first (GrammarRows' reasoning tags): the grammar starts after </think>
    done_thinking: set[int] = field(default_factory=set)  # the samples whose </think> came


class GrammarRows:
    """The matchers of the requests decoding under a grammar, by generation key (module docs)."""

    __slots__ = ("vocab_size", "words", "pin_memory", "num_threads", "on_failed_grammar", "reasoning_tags",
                 "_requests", "_ids", "_lock", "_executor")

    def __init__(self, vocab_size: int, *, num_threads: int | None = None, pin_memory: bool = False,
                 on_failed_grammar: Callable[[CompiledGrammar], None] | None = None,
                 reasoning_tags: tuple[int, int] | None = None) -> None:
        """``vocab_size``: the compiler's ``vocab_size`` (n_vocab); ``num_threads``: llguidance's
        mask threads (None: its default, 80% of the CPUs up to 32); ``pin_memory``: pinned masks,
        for an asynchronous copy to the GPU; ``on_failed_grammar``: told the grammar of a matcher
        that fell into error (the engine drops it from the compiler's cache); ``reasoning_tags``:
        the ``<think>``/``</think>`` ids of the engine's reasoning parser, whose models reason
        before they answer: a generation's grammar then starts after its ``</think>`` token
        (``ferrokv.reasoning_parsers``; vLLM's reasoning-aware structured outputs)."""
        from ferrokv.id_index import IdIndex

        self.vocab_size = int(vocab_size)
        self.words = (self.vocab_size + 31) // 32
        self.pin_memory = pin_memory
        self.num_threads = num_threads
        self.on_failed_grammar = on_failed_grammar
        self.reasoning_tags = reasoning_tags
        self._requests: dict[int, _Request] = {}
        self._ids = IdIndex()  # the registered request ids, for rows_of
        self._lock = threading.Lock()
        self._executor: llguidance.LLExecutor | None = None

    def register(self, request_core_id: int, compiled: CompiledGrammar, prompt_ids: Sequence[int] = ()) -> None:
        """Request ``request_core_id`` decodes under ``compiled`` (each sample its own matcher),
        after its reasoning unless its prompt (``prompt_ids``) closed it (``reasoning_tags``)."""
        from ferrokv.reasoning_parsers import reasoning_ended_in

        if compiled.vocab_size != self.vocab_size:
            raise ValueError(f"grammar compiled for vocab {compiled.vocab_size}, rows have {self.vocab_size}")
        tags = self.reasoning_tags
        thinks = tags is not None and not reasoning_ended_in(prompt_ids, tags)
        with self._lock:
            if request_core_id in self._requests:
                raise ValueError(f"request {request_core_id} already decodes under a grammar")
            self._requests[int(request_core_id)] = _Request(compiled, thinks=thinks)
            self._ids.add(int(request_core_id), 0)

    def release(self, request_core_id: int) -> None:
        """Drops the request's matchers (finished or aborted); unknown ids are ignored."""
        with self._lock:
            if self._requests.pop(int(request_core_id), None) is not None:
                self._ids.remove(int(request_core_id))

    def has_any(self) -> bool:
        return bool(self._requests)

    def failed(self, matcher: Any, token: int) -> None:
        """``matcher`` fell into error consuming ``token``: logs llguidance's reason and tells
        ``on_failed_grammar`` its grammar."""
        error = (matcher.get_error().splitlines() or [""])[0][:_MAX_ERROR]  # the message, not the state dump
        logger.warning("structured output: the grammar matcher failed after token %d, so the sequence ends "
                       "as if the grammar were complete: %s", token, error)
        with self._lock:
            compiled = next((r.compiled for r in self._requests.values()
                             if any(m is matcher for m in r.matchers.values())), None)
        if compiled is not None and self.on_failed_grammar is not None:
            self.on_failed_grammar(compiled)

    def rows_of(self, req_ids: np.ndarray, sample_idx: np.ndarray) -> np.ndarray:
        """The indices of the rows (of ``req_ids``/``sample_idx``, one per logits row) whose request
        decodes under a grammar; their keys are ``grammar_key(req_ids[rows], sample_idx[rows])``."""
        import numpy as np

        if len(req_ids) != len(sample_idx):
            raise ValueError(f"{len(req_ids)} request ids but {len(sample_idx)} sample indices")
        with self._lock:
            return np.flatnonzero(self._ids.lookup(req_ids) >= 0)

    def step(self, out: Any) -> GrammarStep | None:
        """The rows of step ``out`` (a ``SchedulerOutput``) under a grammar and their matchers,
        resolved now, on the scheduler's thread: the step job and ``GrammarStep.accept`` then
        use them even if their request is released meanwhile. None when no row has a grammar."""
        if not self._requests:
            return None
        rows = self.rows_of(out.row_req_ids, out.row_sample_index)
        if not len(rows):
            return None
        keys = grammar_key(out.row_req_ids[rows], out.row_sample_index[rows])
        thinking = None if self.reasoning_tags is None else self._thinking(keys)
        if thinking is None or not thinking.any():
            return GrammarStep(rows, self.matchers_of(keys), self)
        # Their grammar has not started: no mask, their tokens watched for </think>.
        return GrammarStep(rows[~thinking], self.matchers_of(keys[~thinking]), self, rows[thinking], keys[thinking])

    def _thinking(self, keys: np.ndarray) -> np.ndarray:
        """Which of the generations ``keys`` still reason (their grammar starts after it)."""
        import numpy as np

        with self._lock:
            return np.array([(r := self._requests[k // KEY_STRIDE]).thinks and k % KEY_STRIDE not in r.done_thinking
                             for k in keys.tolist()], dtype=bool)

    def thought(self, keys: np.ndarray) -> None:
        """The generations ``keys`` wrote their ``</think>``: their grammar starts at the next token."""
        with self._lock:
            for k in keys.tolist():
                req = self._requests.get(k // KEY_STRIDE)
                if req is not None:
                    req.done_thinking.add(k % KEY_STRIDE)

    def matchers_of(self, keys: np.ndarray | list[int]) -> list[Any]:
        """The matchers of ``keys`` (``grammar_key``), each made on its first use; KeyError for a
        key whose request decodes under no grammar."""
        import numpy as np

        out = []
        with self._lock:
            for key in np.asarray(keys, dtype=np.int64).tolist():
                req = self._requests.get(key // KEY_STRIDE)
                if req is None:
                    raise KeyError(f"key {key}: request {key // KEY_STRIDE} decodes under no grammar")
                m = req.matchers.get(key % KEY_STRIDE)
                if m is None:
                    m = req.matchers[key % KEY_STRIDE] = req.compiled.new_matcher()
                out.append(m)
        return out

    def fill(self, ms: list[Any]) -> torch.Tensor:
        """The int32 CPU bitmask ``[len(ms), words]`` of each matcher's allowed next tokens
        (matchers distinct, from ``matchers_of``). A stopped or errored matcher allows only EOS."""
        import llguidance
        import torch

        mask = torch.empty((len(ms), self.words), dtype=torch.int32, pin_memory=self.pin_memory)
        row_bytes = 4 * self.words
        if len(ms) == 1:  # what llguidance.torch.fill_next_token_bitmask does, without importing it
            ms[0].unsafe_compute_mask_ptr(mask.data_ptr(), row_bytes)
        elif ms:  # llguidance.torch.fill_next_token_bitmask_par: parallel, without the GIL
            if self._executor is None:
                self._executor = llguidance.LLExecutor(self.num_threads)
            self._executor.unsafe_compute_mask_ptr(list(zip(ms, range(len(ms)))), mask.data_ptr(), row_bytes,
                                                   len(ms))
        return mask

    @staticmethod
    def apply(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
        """In place: ``logits[rows[i], t] = -inf`` where bit ``t`` of ``bitmask[i]`` is clear, and
        for ``t >= 32 * words``. ``logits`` ``[B, V]`` on any device; ``bitmask`` from ``fill``."""
        import torch

        if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.dtype != torch.int32:
            raise ValueError(f"logits [B, V] and an int32 bitmask [R, words], got {tuple(logits.shape)}, "
                             f"{tuple(bitmask.shape)} {bitmask.dtype}")
        rows = torch.as_tensor(rows, dtype=torch.int64)
        n = rows.numel()
        if n != bitmask.shape[0]:
            raise ValueError(f"{n} rows but {bitmask.shape[0]} bitmask rows")
        if n == 0:
            return
        dev, vocab = logits.device, logits.shape[1]
        if dev.type == "cuda":  # from pageable memory the copy would wait for the stream
            rows = rows.pin_memory()
        rows = rows.to(dev, non_blocking=True)
        # Branch-free: each byte of the little-endian words (token t is bit t % 8 of byte t // 8)
        # looks up its 8 additive entries (0 or -inf) and the rows get them added in one pass. A
        # masked_fill over a bool mask runs at branch-misprediction speed on a CPU.
        idx = bitmask.contiguous().to(dev, non_blocking=True).view(torch.uint8).long()
        bias = torch.nn.functional.embedding(idx, _bit_bias(dev)).view(n, -1)
        if bias.shape[1] >= vocab:
            bias = bias[:, :vocab]
        else:
            bias = torch.cat([bias, bias.new_full((n, vocab - bias.shape[1]), float("-inf"))], dim=1)
        logits.index_add_(0, rows, bias.to(logits.dtype))


@dataclass(slots=True)
class GrammarStep:
    """One step's rows under a grammar (``GrammarRows.step``)."""

    rows: np.ndarray  # int64 [G]: logits rows
    matchers: list[Any]  # their matchers, one per row
    owner: GrammarRows
    thinking_rows: np.ndarray | None = None  # int64 [T]: rows whose generation still reasons (no mask)
    thinking_keys: np.ndarray | None = None  # int64 [T]: their generation keys

    def mask(self, logits: torch.Tensor) -> None:
        """Masks the rows' disallowed tokens to -inf, in place (the step job, before sampling)."""
        import torch

        GrammarRows.apply(logits, torch.from_numpy(self.rows), self.owner.fill(self.matchers))

    def accept(self, sampled: np.ndarray) -> None:
        """Advances each row's matcher by its token, once the step's ``update()`` committed them
        (a row ended meanwhile only advances a matcher nobody reads again). A rejected token
        leaves the matcher in error (then it allows only EOS) and never raises; the error is
        logged once, when the matcher falls into it."""
        for m, token in zip(self.matchers, sampled[self.rows].tolist()):
            if m.is_error():
                continue
            m.consume_token(int(token))
            if m.is_error():
                self.owner.failed(m, int(token))
        if self.thinking_rows is not None:
            assert self.owner.reasoning_tags is not None and self.thinking_keys is not None
            ended = sampled[self.thinking_rows] == self.owner.reasoning_tags[1]
            if ended.any():
                self.owner.thought(self.thinking_keys[ended])
