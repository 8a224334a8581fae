"""Per-request sampling parameters, with vLLM's field names, defaults and semantics.

Invariants (established by ``validate``, which construction runs; every violation raises ``ValueError`` whose message
names the field and the offending value, e.g. ``temperature must be >= 0, got -1.0``):

* ``n >= 1``; ``temperature >= 0`` and finite; ``0 < top_p <= 1``; ``0 <= min_p <= 1``;
  ``-2 <= presence_penalty, frequency_penalty <= 2``; ``repetition_penalty > 0`` and finite.
* ``seed`` is ``None`` (unseeded) or an int in [-2**63, 2**64) (torch's seed range); ``-1`` is vLLM's spelling of ``None`` and becomes it.
* ``top_k`` is ``0`` when disabled: ``-1`` (vLLM's older spelling) is accepted and normalised to 0;
  any other value must be ``>= 1``.
* ``max_tokens`` is ``None`` ("up to max_model_len", resolved by the engine) or ``>= 1``;
  ``0 <= min_tokens`` and ``min_tokens <= max_tokens`` when ``max_tokens`` is set.
* ``stop`` is always a ``list[str]`` of non-empty, valid Unicode strings afterwards (a single ``str`` or ``None``
  are accepted on construction); ``stop_token_ids`` is always a ``list[int]`` of ids ``>= 0``.
* ``logprobs`` is ``None``, ``-1`` (the whole vocabulary, as vLLM) or ``>= 0`` (how many top alternatives to return *in addition to* the
  sampled token's own logprob); ``True`` (vLLM's) becomes 1, for both logprobs fields.
* ``extra_args`` is ``None`` or a dict with str keys, carried as given (vLLM's, for plugins).
* ``logits_processors`` is ``None`` or empty: vLLM's field, whose per-request callables vLLM V1
  refuses too.
* ``prompt_logprobs`` is ``None``, ``-1`` or ``>= 0``: the prompt's logprobs (each prompt token's own,
  plus that many top alternatives), computed from every prompt position, never a cache hit.
* ``detokenize`` is a bool; without it no text is made, so ``stop`` must be empty.
* ``spaces_between_special_tokens`` is a bool, read as True: ferrokv's text is the tokenizer's own
  decoder's. The byte-level and SentencePiece decoders of LLM tokenizers put no space between
  special tokens, so vLLM V1's rule for False (an added token after another is its content) gives
  the same text; a WordPiece decoder, or none, joins them with spaces either way.
* ``logit_bias`` is ``None`` or a ``dict[int, float]`` of token ids ``>= 0`` to finite biases added
  to their logits; ``allowed_token_ids`` is ``None`` or a non-empty ``list[int]`` of ids ``>= 0``
  (every other token is masked); ``bad_words`` is ``None`` or a ``list[str]`` of non-empty words
  never generated (as vLLM: each word's tokens, and those after a leading space when that
  gives as many tokens with another first one; a word whose spaced form tokenizes otherwise,
  " dog" as one token where "dog" is two, is not banned in that form). Ids are checked
  against the vocabulary when the engine takes the request.
* ``structured_outputs`` is ``None`` or a ``StructuredOutputsParams`` (a dict is converted);
  ``guided_decoding`` is its former vLLM name (``GuidedDecodingParams``), moved into it and reset
  to ``None`` (giving both is an error).
* ``skip_reading_prefix_cache`` is a bool once validated (``None`` becomes vLLM's default:
  whether ``prompt_logprobs`` are asked): True computes the whole prompt, reading no prefix-cache
  hits (its blocks are still cached for others). Prompt logprobs read none either way.
* ``truncate_prompt_tokens`` is ``None``, ``-1`` (``max_model_len``) or ``>= 1``: only the
  prompt's last that many tokens are used (left truncation, as vLLM; a text prompt keeps the
  special tokens its tokenizer adds, such as a BOS, as the tokenizer truncates).
* ``output_kind`` is a ``RequestOutputKind`` (an int 0-2 is accepted and converted): what each
  output of the request carries (``ferrokv.outputs``). ``LLM.generate`` sets ``FINAL_ONLY``.
* A temperature in (0, ``MIN_TEMPERATURE``) is raised to it, with a warning, as vLLM does (dividing
  logits by less overflows them to inf or nan).
* Greedy means ``temperature < GREEDY_EPS`` (so, after the raise, 0); for greedy requests top_p/top_k/min_p are reset to
  their neutral values (as vLLM does) because they cannot change an argmax.

Costs: construction is O(len(stop) + len(stop_token_ids)); nothing here touches torch, so building
params is cheap enough to do per request on the API thread.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import logging
import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ferrokv.beam_search_params import BeamSearchParams
from ferrokv.checks import as_float, check_finite, check_text, shown
from ferrokv.outputs import RequestOutputKind
from ferrokv.structured_outputs import StructuredOutputsParams  # stdlib-only at import

# vLLM exports BeamSearchParams, RequestOutputKind and StructuredOutputsParams here too.
__all__ = ["GREEDY_EPS", "MIN_TEMPERATURE", "BeamSearchParams", "GuidedDecodingParams", "RequestOutputKind",
           "SamplingParams", "SamplingType", "StructuredOutputsParams"]

GuidedDecodingParams = StructuredOutputsParams
"""vLLM's former name of ``StructuredOutputsParams`` (its ``backend`` options aside: llguidance)."""


class SamplingType(enum.IntEnum):
    """vLLM's kinds of sampling (``SamplingParams.sampling_type``)."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


logger = logging.getLogger("ferrokv")

# Below this temperature a request is treated as greedy: dividing logits by ~0 would overflow, and
# vLLM uses the same threshold, so requests behave the same on both engines.
GREEDY_EPS: float = 1e-5
# What one request may ask of every step: each generated token is searched for every stop string
# (its cost grows with their number and length), and under min_tokens every stop id is banned in
# each of its rows. Far above real use (OpenAI allows 4 stop strings, vLLM's server now too).
MAX_STOP_STRINGS = 256
MAX_STOP_CHARS = 65_536  # all stop strings together
MAX_STOP_TOKEN_IDS = 1024  # distinct
# vLLM's _MAX_TEMP: the smallest temperature used as given (above 0).
MIN_TEMPERATURE: float = 1e-2


def _is_int(x: object) -> bool:
    # bool is an Integral subclass, but n=True is almost certainly a bug, not "1".
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_list_like(x: object) -> bool:
    """A list, tuple or other iterable of items; not text, bytes or a mapping (whose iteration
    would quietly read characters or keys as items)."""
    return isinstance(x, Iterable) and not isinstance(x, (str, bytes, bytearray, Mapping))


@dataclass(slots=True)
class SamplingParams:
    """How to sample the completion(s) of one request (see the module docstring for invariants)."""

    # vLLM's field order, so that a positional call means the same on both engines.
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    extra_args: dict[str, Any] | None = None  # vLLM's: carried for plugins and callers, unused by the engine
    bad_words: list[str] | None = None
    skip_reading_prefix_cache: bool | None = None
    guided_decoding: StructuredOutputsParams | None = None  # vLLM's former name of structured_outputs
    logits_processors: Any = None  # vLLM's field; per-request callables are refused, as vLLM V1 does
    # Not a user knob: cached len(longest stop string), used by the detokenizer to size its search
    # window; kept in sync by validate().
    _max_stop_len: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Checks every field (and normalises ``top_k``, ``stop``, ``stop_token_ids`` and the greedy
        knobs) as the module docstring says. Runs on construction, and again when the engine takes
        a request, since fields may have been assigned since (``params.temperature = nan``)."""
        self._validate_ints()
        self._validate_floats()
        self._validate_stops()
        self._validate_flags()
        if not self.detokenize and self.stop:
            raise ValueError(f"stop strings need detokenize=True, got stop={self.stop!r} with detokenize=False")
        self._validate_token_rules()

        kind = self.output_kind
        if isinstance(kind, bool) or not isinstance(kind, (RequestOutputKind, numbers.Integral)) \
                or kind not in tuple(RequestOutputKind):
            names = ", ".join(f"{k.name} ({k.value})" for k in RequestOutputKind)
            raise ValueError(f"output_kind must be a RequestOutputKind ({names}), got {kind!r}")
        self.output_kind = RequestOutputKind(kind)

        if self.is_greedy:
            # These cannot change an argmax; neutralising them lets the sampler take fast paths.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _validate_ints(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= -1 (0 or -1 disable it), got {self.top_k!r}")
        if self.top_k == -1:
            self.top_k = 0  # one spelling for "disabled" downstream
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be None or an int >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens!r}"
            )
        # torch's manual_seed range (vLLM seeds a torch.Generator): a larger one would wrap.
        if self.seed is not None and (not _is_int(self.seed) or not -(1 << 63) <= self.seed < 1 << 64):
            raise ValueError(f"seed must be None or an int in [-2**63, 2**64), got {self.seed!r}")
        if self.seed == -1:
            self.seed = None  # vLLM's spelling of "no seed"
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is True:
                setattr(self, name, 1)  # vLLM's: True asks for the sampled token's logprob (one)
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < -1):
            raise ValueError(f"logprobs must be None, -1 (the whole vocabulary) or an int >= 0, got {self.logprobs!r}")

    def _validate_floats(self) -> None:
        """Written as ``not (lo <= x <= hi)`` so that NaN fails every check."""
        self._check_real("temperature")
        if not (0.0 <= self.temperature < math.inf):
            raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature!r}")
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            logger.warning("temperature %s is less than %s, which may cause numerical errors nan or inf in "
                           "tensors; it is raised to %s", self.temperature, MIN_TEMPERATURE, MIN_TEMPERATURE)
            self.temperature = MIN_TEMPERATURE
        self._check_real("top_p")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        self._check_real("min_p")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        self._check_real("presence_penalty")
        if not (-2.0 <= self.presence_penalty <= 2.0):
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}")
        self._check_real("frequency_penalty")
        if not (-2.0 <= self.frequency_penalty <= 2.0):
            raise ValueError(
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}"
            )
        self._check_real("repetition_penalty")
        if not (0.0 < self.repetition_penalty < math.inf):
            raise ValueError(
                f"repetition_penalty must be > 0 and finite, got {self.repetition_penalty!r}"
            )

    def _validate_flags(self) -> None:
        if self.extra_args is not None and not (isinstance(self.extra_args, dict)
                                                and all(isinstance(k, str) for k in self.extra_args)):
            raise ValueError(f"extra_args must be None or a dict with str keys, got {self.extra_args!r}")
        if self.skip_reading_prefix_cache is None:
            self.skip_reading_prefix_cache = self.prompt_logprobs is not None  # vLLM's default
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize",
                     "spaces_between_special_tokens", "skip_reading_prefix_cache"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    def _validate_stops(self) -> None:
        """``stop`` as a list of non-empty strings, ``stop_token_ids`` as a list of ids >= 0."""
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            if not _is_list_like(self.stop):
                raise ValueError(f"stop must be a str or a list of strings, got {shown(self.stop)}")
            stop = list(self.stop)
            for s in stop:
                if not isinstance(s, str):
                    raise ValueError(f"stop must contain only strings, got {s!r}")
            self.stop = list(dict.fromkeys(stop))  # a repeat stops nothing more, and costs every token
        for s in self.stop:
            check_text("stop", s)
            if s == "":
                raise ValueError(f"stop must not contain an empty string, got {self.stop!r}")
        chars = sum(map(len, self.stop))
        if len(self.stop) > MAX_STOP_STRINGS or chars > MAX_STOP_CHARS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} distinct strings of {MAX_STOP_CHARS} characters in "
                             f"all, got {len(self.stop)} of {chars}")
        self._max_stop_len = max((len(s) for s in self.stop), default=0)

        if self.stop_token_ids is not None and not _is_list_like(self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {shown(self.stop_token_ids)}")
        ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        for t in ids:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids must contain ints >= 0, got {t!r}")
        self.stop_token_ids = list(dict.fromkeys(int(t) for t in ids))  # vLLM's de-duplication
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} distinct ids, "
                             f"got {len(self.stop_token_ids)}")

    def _validate_token_rules(self) -> None:
        """``prompt_logprobs``, ``logit_bias``, ``allowed_token_ids``, ``bad_words`` and
        ``structured_outputs`` (normalised: a dict's keys and values to int and float)."""
        t = self.truncate_prompt_tokens
        if t is not None and (not _is_int(t) or not (t >= 1 or t == -1)):
            raise ValueError(f"truncate_prompt_tokens must be None, -1 or an int >= 1, got {t!r}")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs) or self.prompt_logprobs < -1):
            raise ValueError(f"prompt_logprobs must be None, -1 (the whole vocabulary) or an int >= 0, "
                             f"got {self.prompt_logprobs!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")
            bias = {}
            for tok, value in self.logit_bias.items():
                if not _is_int(tok) or tok < 0:
                    raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {tok!r}")
                bias[int(tok)] = check_finite(f"logit_bias[{tok}]", value)
            self.logit_bias = bias
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
                raise ValueError(f"allowed_token_ids must be a list of token ids, got {ids!r}")
            ids = list(ids)
            if not ids or not all(_is_int(t) and t >= 0 for t in ids):
                raise ValueError(f"allowed_token_ids must be a non-empty list of ints >= 0, got {self.allowed_token_ids!r}")
            self.allowed_token_ids = [int(t) for t in ids]
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (str, list, tuple)):
                raise ValueError(f"bad_words must be a list of strings, got {self.bad_words!r}")
            words = [self.bad_words] if isinstance(self.bad_words, str) else list(self.bad_words)
            for w in words:
                if not isinstance(w, str) or not w.strip():
                    raise ValueError(f"bad_words must contain non-empty strings, got {w!r}")
                check_text("bad_words", w)
            self.bad_words = words
        if self.logits_processors:
            raise ValueError(f"logits_processors: per-request logits processors are not supported (nor by vLLM V1), "
                             f"got {shown(self.logits_processors)}; logit_bias, allowed_token_ids, bad_words and "
                             f"structured_outputs shape the logits")
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError("give structured_outputs or guided_decoding (its former name), not both")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        so = self.structured_outputs
        if so is None:
            return
        if isinstance(so, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(so)
        elif isinstance(so, StructuredOutputsParams):
            # A copy, checked again: its fields may have been assigned since it was built.
            self.structured_outputs = dataclasses.replace(so)
        else:
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams or a dict, got {so!r}")

    def _check_real(self, name: str) -> None:
        setattr(self, name, as_float(name, getattr(self, name)))

    @property
    def is_greedy(self) -> bool:
        """True when the request samples by argmax (temperature below ``GREEDY_EPS``)."""
        return self.temperature < GREEDY_EPS

    @property
    def sampling_type(self) -> SamplingType:
        """vLLM's: greedy, seeded random or random."""
        if self.is_greedy:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def max_stop_len(self) -> int:
        """Length in characters of the longest stop string (0 when there are none)."""
        return self._max_stop_len

    @property
    def has_penalties(self) -> bool:
        """True when any of presence / frequency / repetition penalty is not neutral."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @classmethod
    def from_optional(cls, **kwargs: Any) -> SamplingParams:
        """vLLM's ``from_optional``: a None stands for the field's default where None is not
        one of the field's own values (``max_tokens=None`` stays None: no limit); ``logit_bias``
        keys become ints and biases are clamped to OpenAI's [-100, 100], as vLLM's does."""
        bias = kwargs.get("logit_bias")
        if isinstance(bias, dict):
            try:
                kwargs["logit_bias"] = {int(t): min(100.0, max(-100.0, float(b))) for t, b in bias.items()}
            except (TypeError, ValueError, OverflowError):
                raise ValueError(f"logit_bias must map token ids to numbers, got {shown(bias)}") from None
        fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
        return cls(**{k: v for k, v in kwargs.items() if v is not None or k not in fields or "None" in str(fields[k].type)})

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's ``clone``): changing the copy's lists or dicts leaves this one as it was."""
        return copy.deepcopy(self)
