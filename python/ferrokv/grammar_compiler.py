"""Compiling structured-output grammars (llguidance): ``GrammarCompiler`` turns a
``StructuredOutputsParams`` into a ``CompiledGrammar`` (its text: ``ferrokv.grammar_text``) on a
compile thread (``ferrokv.grammar_pool``: a chain of rules deep enough to overflow a normal
thread's stack fits there; a grammar over ``MAX_GRAMMAR_CHARS`` is refused), once per distinct
params; ``LazyGrammarCompiler`` makes the compiler on first use.

Invariants: a ``CompiledGrammar`` is immutable and shared by every request with the same key; an
invalid spec is a cached ``_Failed`` (a ``ValueError`` naming ``structured_outputs.<field>`` to
every caller), as is a build that failed for another reason. The cache is an LRU of
``GRAMMAR_CACHE_SIZE`` entries plus a weak map of every entry still held elsewhere (a live
request's matchers, or a caller between compiling and adding its request), so an entry in use is
found however many were compiled since. Callers of one spec share its build through one future,
which no holder can cancel; compile threads never wait for one another. A forked child forgets the
parent's builds in flight.
Threading: ``compile``/``entry`` may be called from any thread but a compile thread (a lock guards
the cache; the build runs unlocked, llguidance releases the GIL).
Costs: wrapping the tokenizer ~0.5 s for a 49k vocab (once per compiler); compiling a grammar
~1-100 ms (up to ~1 s for huge schemas), then a cache hit; a matcher ~µs (a deep copy of the
grammar's template).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ferrokv import grammar_pool
from ferrokv.grammar_pool import submit_compile
from ferrokv.grammar_text import grammar_text

if TYPE_CHECKING:
    import llguidance

    from ferrokv.structured_outputs import StructuredOutputsParams

__all__ = ["GRAMMAR_CACHE_SIZE", "CompiledGrammar", "GrammarCompiler", "LazyGrammarCompiler", "grammar_vocab_width"]

_MAX_ERROR = 2000  # characters of an llguidance error message kept in ours
# Compiled grammars kept: each holds its template's lexer, which grows as masks are computed (up to
# llguidance's limit of lexer states, hundreds of MB for a pathological regex), so few are kept.
# Live requests keep theirs through their matchers whether or not it is still cached.
GRAMMAR_CACHE_SIZE = 16
MAX_ITEMS_IN_ROW = 20_000  # (``_parser_limits``)


@dataclass(frozen=True)  # (no slots: the compiler keeps weak references to them)
class CompiledGrammar:
    """A validated llguidance grammar; shared (never advanced itself), so cached by the compiler."""

    kind: str
    grammar: str  # llguidance's serialized grammar
    vocab_size: int  # n_vocab: the bitmask width in bits
    template: llguidance.LLMatcher = field(repr=False)

    def new_matcher(self) -> llguidance.LLMatcher:
        """A fresh matcher at the grammar's start (a deep copy of the template: no rebuild)."""
        return self.template.deep_copy()


@dataclass(frozen=True)
class _Failed:
    """A spec that does not compile, cached with its error."""

    message: str


def _unless_failed(entry: CompiledGrammar | _Failed) -> CompiledGrammar:
    if isinstance(entry, _Failed):
        raise ValueError(entry.message)
    return entry


_COMPILERS: weakref.WeakSet[GrammarCompiler] = weakref.WeakSet()


def _forget_builds_in_child() -> None:
    """A forked child has none of the parent's compile threads: their builds never end there."""
    for compiler in list(_COMPILERS):
        compiler._building = {}
        compiler._lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_builds_in_child)


class GrammarCompiler:
    """Params -> ``CompiledGrammar`` for one tokenizer. An LRU cache of ``cache_size`` entries,
    and a weak map of every entry still referenced elsewhere (a live request's, or one a caller
    holds between compiling a grammar and adding its request: ``AsyncLLM``, ``EngineLoop``), so
    that an entry in use is found however many others were compiled since. A build runs on a
    compile thread (``ferrokv.grammar_pool``) and is shared by every caller of its key meanwhile;
    compile threads never wait for one another."""

    __slots__ = ("tokenizer", "vocab_size", "cache_size", "_cache", "_live", "_building", "_lock", "__weakref__")

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int | None,
                 cache_size: int | None = None) -> None:
        import llguidance.hf

        cache_size = GRAMMAR_CACHE_SIZE if cache_size is None else cache_size
        if cache_size < 0:
            raise ValueError(f"cache_size must be >= 0, got {cache_size}")
        n_vocab = grammar_vocab_width(tokenizer, vocab_size)
        self.tokenizer: llguidance.LLTokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=n_vocab, eos_token=eos_token_id)
        self.vocab_size = self.tokenizer.vocab_size
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple, CompiledGrammar | _Failed] = OrderedDict()
        self._live: weakref.WeakValueDictionary[tuple, CompiledGrammar | _Failed] = weakref.WeakValueDictionary()
        self._building: dict[tuple, Future[CompiledGrammar | _Failed]] = {}
        self._lock = threading.Lock()
        _COMPILERS.add(self)

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of ``params``; an invalid one raises ``ValueError`` naming its
        field. Failures are cached too: a bad spec costs one compile, however often it is sent
        and on whichever thread it is checked again (the engine's, the event loop's). Waits for
        the build on a compile thread; never call it on one."""
        return _unless_failed(self.entry(params).result())

    def entry(self, params: StructuredOutputsParams) -> Future[CompiledGrammar | _Failed]:
        """The future of ``params``' entry (done at once on a hit): a caller that holds the
        entry until its request is added keeps it findable (class docs)."""
        key = params.cache_key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
            else:
                hit = self._live.get(key)
            if hit is not None:
                done: Future[CompiledGrammar | _Failed] = Future()
                done.set_result(hit)
                return done
            building = self._building.get(key)
            if building is None:
                building = Future()
                building.set_running_or_notify_cancel()  # shared: no holder may cancel it
                self._building[key] = building
                try:
                    submit_compile(self._build_into, key, params, building)  # (it waits for the lock)
                except BaseException:
                    del self._building[key]
                    raise
            return building

    def _build_into(self, key: tuple, params: StructuredOutputsParams,
                    future: Future[CompiledGrammar | _Failed]) -> None:
        entry: CompiledGrammar | _Failed | None = None
        try:
            entry = self._build(params)
        except ValueError as e:
            entry = _Failed(str(e))
        except Exception as e:  # not the spec's fault (out of memory, a bug): cached as a failure too,
            # so that the engine's add does not build it again on its own thread
            entry = _Failed(f"structured_outputs.{params.kind} could not be compiled: {type(e).__name__}: {e}")
        finally:
            with self._lock:
                if self._building.get(key) is future:
                    del self._building[key]
                if entry is not None:
                    self._live[key] = entry
                    if self.cache_size:
                        self._cache[key] = entry
                        while len(self._cache) > self.cache_size:
                            self._cache.popitem(last=False)
            if entry is None:  # interrupted: every waiter learns it, nothing is cached
                future.set_exception(RuntimeError(f"structured_outputs.{params.kind}: the compile was interrupted"))
            else:
                future.set_result(entry)

    def forget(self, compiled: CompiledGrammar) -> None:
        """Drops ``compiled`` from the cache: its matchers share the template's lexer, so one that
        exhausted a lexer limit leaves every later copy failing at once; the next request with
        the same spec compiles afresh."""
        with self._lock:
            for key in [k for k, v in self._cache.items() if v is compiled]:
                del self._cache[key]
            for key in [k for k, v in self._live.items() if v is compiled]:
                del self._live[key]

    def _build(self, params: StructuredOutputsParams) -> CompiledGrammar:
        from llguidance import LLMatcher

        kind = params.kind
        try:
            grammar = grammar_text(params)
        except Exception as e:  # the GBNF converter raises various types (RecursionError on deep nesting too)
            raise _not_valid(kind, f"{type(e).__name__}: {e}") from None
        limit = grammar_pool.MAX_GRAMMAR_CHARS  # more could overflow a compile thread's stack
        if len(grammar) > limit:
            raise ValueError(f"structured_outputs.{kind} is too large: its grammar is {len(grammar)} characters, "
                             f"more than {limit}")
        try:
            limits = _parser_limits()
            error = LLMatcher.validate_grammar(grammar, self.tokenizer, limits=limits)
            template = None
            if not error:
                template = LLMatcher(self.tokenizer, grammar, log_level=0, limits=limits)
                error = template.get_error() if template.is_error() else ""
        except Exception as e:  # llguidance raises various types
            error = f"{type(e).__name__}: {e}"
        if error and kind in ("json", "json_object") and params.whitespace_pattern is not None:  # the field at fault
            self._check_whitespace_pattern(params.whitespace_pattern)
        if error:
            raise _not_valid(kind, error)
        return CompiledGrammar(kind, grammar, self.vocab_size, template)

    def _check_whitespace_pattern(self, pattern: str) -> None:
        from llguidance import LLMatcher

        try:
            error = LLMatcher.validate_grammar(LLMatcher.grammar_from_regex(pattern), self.tokenizer)
        except Exception as e:  # llguidance raises various types
            error = f"{type(e).__name__}: {e}"
        if error:
            raise ValueError(f"structured_outputs.whitespace_pattern is not a valid regex: "
                             f"{error[:_MAX_ERROR].rstrip()}")


def grammar_vocab_width(tokenizer: Any, vocab_size: int) -> int:
    """The width of a grammar's token mask: the logits may be wider than the tokenizer (padding
    ids) and, rarely, narrower. The one source for the compiler and the engine's mask rows."""
    return max(int(vocab_size), len(tokenizer))


def _parser_limits() -> llguidance.LLParserLimits:
    """llguidance's limits with a wider parser row: its default of 2,000 items fails a schema of a
    few hundred optional properties after its first token (items grow ~4 per property); the items of
    one mask step stay capped by ``step_max_items``, so a step's cost stays bounded."""
    from llguidance import LLParserLimits

    return LLParserLimits(max_items_in_row=MAX_ITEMS_IN_ROW)


def _not_valid(kind: str, error: str) -> ValueError:
    # A panic in llguidance's grammar builder comes with a backtrace: the first line says what failed.
    error = error.split("\n<backtrace>", 1)[0]
    error = error if len(error) <= _MAX_ERROR else error[:_MAX_ERROR] + "..."
    return ValueError(f"structured_outputs.{kind} is not a valid grammar: {error.rstrip()}")


class LazyGrammarCompiler:
    """A ``GrammarCompiler`` made on first use, once, from any thread: wrapping a large
    vocabulary's tokenizer costs, and most engines never see a grammar."""

    __slots__ = ("_args", "_compiler", "_error", "_lock")

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int | None) -> None:
        self._args = (tokenizer, vocab_size, eos_token_id)
        self._compiler: GrammarCompiler | None = None
        self._error: str | None = None  # the tokenizer llguidance cannot take: told to every request
        self._lock = threading.Lock()

    @property
    def vocab_width(self) -> int:
        """The mask width of the grammars it will compile (``grammar_vocab_width``), without
        making the compiler."""
        return grammar_vocab_width(self._args[0], self._args[1])

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        return self._made().compile(params)

    def entry(self, params: StructuredOutputsParams) -> Future[Any]:
        """``GrammarCompiler.entry``: for a caller that must not block (an event loop awaits it)
        or that holds the entry until its request is added."""
        return self._made().entry(params)

    def _made(self) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None and self._error is None:
                try:
                    self._compiler = GrammarCompiler(*self._args)
                except Exception as e:  # llguidance's own types, e.g. an unknown tokenizer decoder
                    self._error = (f"structured_outputs: the grammar backend (llguidance) cannot use this model's "
                                   f"tokenizer ({type(e).__name__}: {str(e)[:_MAX_ERROR]})")
            if self._error is not None:
                raise ValueError(self._error)
            assert self._compiler is not None
            return self._compiler

    def forget(self, compiled: CompiledGrammar) -> None:
        if self._compiler is not None:
            self._compiler.forget(compiled)
