"""What an engine derives from its arguments and model before it serves: the device, the dtype,
the model and tokenizer, the EOS token ids, the default sampling parameters, how many KV blocks
the cache gets, and the cache and scheduler built from them (``load_engine``).

Invariants: each function reads only its arguments (and, for the KV budget on CUDA, the free
device memory); a choice the user cannot satisfy raises ``ValueError`` naming the field.
Costs: once per engine.
"""

from __future__ import annotations

import gc
import math
import os
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import logging
import time
from dataclasses import dataclass

import torch

from ferrokv._core import Scheduler
from ferrokv.cuda_graphs import DecodeGraphs, capture_sizes
from ferrokv.engine_args import AUTO_MAX_MODEL_LEN, DTYPE_ALIASES, EngineArgs
from ferrokv.generation_defaults import defaults_source, generation_config_file, load_generation_defaults
from ferrokv.kv_cache import KVCacheSpec, PagedKVCache
from ferrokv.reasoning_parsers import ReasoningParser
from ferrokv.structured_outputs import GrammarRows, LazyGrammarCompiler

logger = logging.getLogger("ferrokv")

__all__ = ["EngineParts", "activation_bytes_estimate", "eos_token_ids", "load_engine", "make_scheduler",
           "num_kv_blocks", "resolve_device", "resolve_dtype", "step_token_budget"]

_DTYPES = {name: getattr(torch, canonical) for name, canonical in DTYPE_ALIASES.items()}
_CPU_DEFAULT_KV_BYTES = 1 << 30


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return _indexed(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but no CUDA device is available")
    return _indexed(dev)


def _indexed(dev: torch.device) -> torch.device:
    """``cuda`` as the device it means now (``cuda:<current>``): the engine's calls set it as
    their thread's current device, which needs an index."""
    return torch.device("cuda", torch.cuda.current_device()) if dev.type == "cuda" and dev.index is None else dev


def resolve_dtype(name: str, config: Mapping[str, Any], device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # half precision matmuls are slow (and bf16 is inexact) on CPUs
    cfg = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16").replace("torch.", "")
    return _DTYPES.get(cfg, torch.bfloat16) if cfg in ("float16", "bfloat16") else torch.bfloat16


def eos_token_ids(tokenizer: Any, config: Mapping[str, Any], generation_config: Path | None,
                  vocab_size: int) -> tuple[int, ...]:
    """The tokenizer's EOS, then the ``generation_config`` file's (vLLM's: the one
    ``EngineArgs.generation_config`` names), or the config's when there is no such file, as
    vLLM's ``try_get_generation_config`` falls back (in the vocabulary, each once); the first is
    the core's EOS, the others stop tokens unless ``ignore_eos``."""
    ids: list[int] = []

    def add(v: Any) -> None:
        for x in v if isinstance(v, list) else [v]:
            if isinstance(x, int) and x not in ids and 0 <= x < vocab_size:
                ids.append(x)

    add(tokenizer.eos_token_id)
    if generation_config is None:
        add(config.get("eos_token_id"))
    else:
        from ferrokv.model_loader import read_json

        add(read_json(generation_config).get("eos_token_id"))
    return tuple(ids)


def num_kv_blocks(a: EngineArgs, spec: KVCacheSpec, device: torch.device, max_model_len: int,
                  activation_bytes: int = 0) -> int:
    """``num_gpu_blocks_override`` if given, else what ``kv_cache_memory_bytes`` (or, on CUDA, this
    instance's share under ``gpu_memory_utilization`` less the weights and ``activation_bytes``, a
    step's; on the CPU 1 GiB, capped at what every sequence at full length could use) holds."""
    per_block = spec.bytes_per_block
    if a.num_gpu_blocks_override is not None:
        return a.num_gpu_blocks_override
    field = "kv_cache_memory_bytes"
    if a.kv_cache_memory_bytes is not None:
        budget = a.kv_cache_memory_bytes
    elif device.type == "cuda":
        field, budget = "gpu_memory_utilization", _gpu_kv_budget(a.gpu_memory_utilization, device, activation_bytes)
    else:
        budget = _CPU_DEFAULT_KV_BYTES
    n = budget // per_block
    if device.type == "cpu" and a.kv_cache_memory_bytes is None:
        n = min(n, a.max_num_seqs * math.ceil(max_model_len / a.block_size) + 1)
    if n < 2:
        raise ValueError(f"{field}: {budget} bytes hold {n} KV blocks of {per_block} bytes; at least 2 are needed")
    return int(n)


def _gpu_kv_budget(utilization: float, device: torch.device, activation_bytes: int) -> int:
    """This instance's share of the GPU (vLLM's per-instance ``gpu_memory_utilization``: memory
    other processes hold does not count against it) less what it holds already (the weights) and
    what a step's activations take; refused when nothing is left for the KV cache, or when the GPU
    has less free memory than the share needs."""
    free, total = torch.cuda.mem_get_info(device)
    own = torch.cuda.memory_reserved(device)
    share = int(total * utilization)
    budget = share - own - activation_bytes
    split = (f"gpu_memory_utilization: {utilization} of the GPU's {total} bytes is {share}; less the {own} this "
             f"process holds and an estimated {activation_bytes} for a step's activations, {budget} are left for "
             "the KV cache")
    if budget <= 0:
        raise ValueError(f"{split}: raise it or set kv_cache_memory_bytes")
    if share - own > free:
        raise ValueError(f"{split}, but only {free} bytes are free for the cache and the activations (other "
                         "processes, or this one's CUDA context, hold the rest); lower it or set kv_cache_memory_bytes")
    return budget


# float32 ``[rows, V]`` buffers a sampling step holds at its peak beside the logits, in the worst case:
# every row top-p with its redo's sort (values and int64 indices) and a logprob table. About 10.3 on
# the CPU (tests/test_engine_setup.py measures it); the rest is for a device sort's scratch.
SAMPLER_FP32_BUFFERS = 12


def activation_bytes_estimate(mc: Any, a: EngineArgs, dtype: torch.dtype, device: torch.device,
                              graphs: bool = False) -> int:
    """A step's peak working memory beside the weights and the KV cache, estimated (vLLM measures
    it with a profiling forward pass): a full token budget through one layer (the larger of the
    attention and MLP phases, with the residual stream) and the logits rows through the sampler
    (the model's logits and ``SAMPLER_FP32_BUFFERS`` float32 ``[rows, V]`` buffers); with decode
    ``graphs``, their memory pool too (their largest batch through one layer, and every size's
    hidden states). Prompt logprobs over long chunks can need more."""
    b = torch.empty((), dtype=dtype).element_size()
    tokens = step_token_budget(a, device)
    rows = min(a.max_num_seqs, tokens)
    attention = (2 * mc.num_attention_heads + 2 * mc.num_key_value_heads) * mc.head_dim + mc.hidden_size
    per_token = b * (2 * mc.hidden_size + max(3 * mc.intermediate_size, attention))
    pool = 0
    if graphs:
        sizes = capture_sizes(a.max_num_seqs)
        pool = sizes[-1] * per_token + sum(sizes) * mc.hidden_size * b
    return tokens * per_token + rows * mc.vocab_size * (b + SAMPLER_FP32_BUFFERS * 4) + pool


def allocate_kv_cache(a: EngineArgs, spec: KVCacheSpec, num_blocks: int, device: torch.device) -> PagedKVCache:
    """The KV cache; a size this machine cannot hold is a ``ValueError`` naming the setting it came
    from, before the allocation where the memory can be known (the CPU's available memory; an
    over-committed allocation there would be killed, not refused), after it otherwise."""
    source = ("num_gpu_blocks_override" if a.num_gpu_blocks_override is not None else
              "kv_cache_memory_bytes" if a.kv_cache_memory_bytes is not None else
              "gpu_memory_utilization" if device.type == "cuda" else "max_num_seqs * max_model_len")
    need = num_blocks * spec.bytes_per_block
    swap = spec.swap_pool_bytes(a.num_cpu_blocks, device)
    detail = f"{num_blocks} KV blocks of {spec.bytes_per_block} bytes ({need} bytes, from {source})"
    if swap:
        detail += f" and {a.num_cpu_blocks} swap blocks (num_cpu_blocks, {swap} bytes of host memory)"
    on_cpu = need * (device.type == "cpu") + swap
    available = _available_cpu_memory()
    if available is not None and on_cpu > available:
        raise ValueError(f"{source}: {detail} need more memory than this machine has available ({available} bytes)")
    try:
        return PagedKVCache(spec, num_blocks, a.num_cpu_blocks, device)
    except (MemoryError, RuntimeError) as e:  # torch.OutOfMemoryError, or the CPU allocator's refusal
        if not isinstance(e, (MemoryError, torch.OutOfMemoryError)) and "alloc" not in str(e):
            raise
        raise ValueError(f"{source}: {detail} could not be allocated ({e})") from None


def _available_cpu_memory() -> int | None:
    """Bytes of memory the OS can give without swapping (Linux' MemAvailable), or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def step_token_budget(args: EngineArgs, device: torch.device) -> int:
    """``max_num_batched_tokens``, by default 8192 on a GPU and 2048 on a CPU, at least max_num_seqs."""
    return max(args.max_num_batched_tokens or (8192 if device.type == "cuda" else 2048), args.max_num_seqs)


def make_scheduler(args: EngineArgs, num_blocks: int, max_len: int, device: torch.device,
                   enable_prefix_caching: bool) -> Scheduler:
    """The engine's scheduler: its step budget (``step_token_budget``) and the sampling seed of
    unseeded requests (random unless ``args.seed``)."""
    budget = step_token_budget(args, device)
    if args.max_num_batched_tokens is not None and budget > args.max_num_batched_tokens:
        logger.warning("max_num_batched_tokens=%d is raised to max_num_seqs=%d: a step holds one token of each "
                       "running sequence (vLLM refuses a smaller budget)", args.max_num_batched_tokens, budget)
    return Scheduler(
        num_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_len,
        enable_prefix_caching=enable_prefix_caching,
        preemption_mode=args.preemption_mode,
        num_cpu_blocks=args.num_cpu_blocks,
        policy=args.scheduling_policy,
        # Unseeded requests' draws derive from it and their id: a seeded engine replays.
        sampling_seed=(random.getrandbits(64) if args.seed is None else args.seed) & ((1 << 64) - 1),
    )


@dataclass(slots=True)
class EngineParts:
    """What ``load_engine`` built."""

    model_path: Path
    device: torch.device
    dtype: torch.dtype
    model: torch.nn.Module
    tokenizer: Any
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    sampling_defaults: dict[str, Any]  # the model's recommended SamplingParams fields (ferrokv.generation_defaults)
    max_model_len: int
    num_blocks: int
    kv_cache: PagedKVCache
    scheduler: Scheduler
    decode_graphs: DecodeGraphs | None  # CUDA graphs of decode steps (ferrokv.cuda_graphs)
    grammars: LazyGrammarCompiler  # structured outputs' compiler and per-generation rows (ferrokv.structured_outputs)
    grammar_rows: GrammarRows
    reasoning: ReasoningParser | None  # the reasoning_parser: grammars start after the reasoning


# As vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN (either name): a max_model_len beyond the model's positions.
_ALLOW_LONG_ENV = ("FERROKV_ALLOW_LONG_MAX_MODEL_LEN", "VLLM_ALLOW_LONG_MAX_MODEL_LEN")


def checked_max_model_len(wanted: int | None, derived: int, rule: str) -> int:
    """``max_model_len``: the model's (``derived``, as vLLM derives it by ``rule``) unless given;
    more than that is refused, as vLLM refuses it (positions the model never saw), unless an
    ``_ALLOW_LONG_ENV`` variable is 1."""
    if wanted is None:
        return derived
    if wanted > derived and not any(os.environ.get(name) == "1" for name in _ALLOW_LONG_ENV):
        raise ValueError(f"max_model_len={wanted} is more than the model's {derived} positions ({rule}); "
                         f"set {_ALLOW_LONG_ENV[0]}=1 to run beyond them anyway")
    return wanted


def _load_tokenizer(args: EngineArgs, model_path: Path) -> Any:
    """``tokenizer`` (a folder or Hub id), else the model's; ``tokenizer_revision`` (default: the
    model's ``revision``) applies to a Hub id, also the model's own, as in vLLM. A folder without
    a tokenizer, or one that does not load, is a ValueError naming the argument and the path."""
    from transformers import AutoTokenizer

    from ferrokv.hub import TOKENIZER_FILES, has_tokenizer, looks_like_hub_id
    from ferrokv.model_loader import resolve_tokenizer_path

    tok_revision = args.tokenizer_revision if args.tokenizer_revision is not None else args.revision
    source = args.tokenizer
    if not source and args.model and not Path(args.model).expanduser().exists() and looks_like_hub_id(args.model):
        # The model's Hub id as a tokenizer (its snapshot; at tokenizer_revision when given):
        # tokenizer files a cached snapshot lacks are fetched, and no weights.
        source = args.model
    path = resolve_tokenizer_path(source, revision=tok_revision, download_dir=args.download_dir) if source \
        else model_path
    where = "tokenizer" if args.tokenizer else "model"
    if not has_tokenizer(path):
        given = args.tokenizer or args.model  # as the caller wrote it (a Hub id, a .gguf file), then where it is
        shown = repr(str(path)) if not given or str(given) == str(path) else f"{str(given)!r} (at {str(path)!r})"
        raise ValueError(f"{where}: {shown} has no tokenizer ({', '.join(TOKENIZER_FILES)}); "
                         f"give tokenizer= a folder or Hub id that has one")
    try:
        # Left: truncate_prompt_tokens keeps a text's last tokens and the specials it adds (vLLM's).
        return AutoTokenizer.from_pretrained(str(path), truncation_side="left")
    except Exception as e:  # transformers raises many types (OSError, ValueError, JSONDecodeError...)
        raise ValueError(f"{where}: the tokenizer in {str(path)!r} cannot be loaded "
                         f"({type(e).__name__}: {e})") from e


def _check_backend(backend: str, device: torch.device) -> None:
    """Before the weights load: Triton kernels launch on a CUDA device, or in Triton's CPU
    interpreter (``TRITON_INTERPRET=1``). The torch backend never imports triton (an install
    without it, such as a CPU-only one, runs)."""
    if backend != "triton":
        return
    try:
        from ferrokv.kernels._common import interpreting
    except ImportError as e:
        raise ValueError(f"attention_backend='triton' needs the triton package, which does not import ({e}); "
                         "install it, or use attention_backend='torch'") from e
    if device.type != "cuda" and not interpreting():
        raise ValueError(f"attention_backend='triton' needs a CUDA device (or TRITON_INTERPRET=1, Triton's CPU "
                         f"interpreter), got device={str(device)!r}; use 'torch' or 'auto' on a CPU")


def _free_dead_engines() -> None:
    """An engine the caller dropped (``del llm``) sits in reference cycles until the collector runs,
    and so do its weights and KV cache: they are freed before this one loads, and the CUDA caching
    allocator gives their blocks back, so they count neither against this engine's share of the
    GPU nor twice on it (vLLM collects likewise before it measures memory)."""
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def load_engine(args: EngineArgs) -> EngineParts:
    """Validates ``args``, resolves the model (a folder or a Hub id) and the tokenizer, loads the
    weights, sizes and allocates the KV cache and builds the scheduler; logs what it made."""
    from ferrokv.model_loader import load_config, load_model, resolve_model_path
    from ferrokv.models.rope import dynamic_rope_rescales

    args.validate()
    _free_dead_engines()
    t0 = time.perf_counter()
    hub = dict(revision=args.revision, download_dir=args.download_dir)
    model_path = resolve_model_path(args.model, **hub)
    config = load_config(model_path, args.hf_overrides)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, config, device)
    backend = args.attention_backend
    if backend == "auto":
        backend = "triton" if device.type == "cuda" else "torch"
    _check_backend(backend, device)
    model = load_model(model_path, dtype=dtype, device=device, attn_backend=backend, load_format=args.load_format,
                       config_overrides=args.hf_overrides)
    mc = model.config
    tokenizer = _load_tokenizer(args, model_path)  # after the model: an unsupported one is told first
    vocab_size = int(mc.vocab_size)
    eos = eos_token_ids(tokenizer, config, generation_config_file(args.generation_config, model_path), vocab_size)
    defaults = load_generation_defaults(args.generation_config, args.override_generation_config, model_path)
    if defaults:
        logger.info("default sampling parameters from %s: %s%s",
                    defaults_source(args.generation_config, args.override_generation_config, model_path), defaults,
                    "" if args.generation_config == "vllm" else " (generation_config='vllm' turns the model's off)")
    auto = args.max_model_len == AUTO_MAX_MODEL_LEN
    max_len = checked_max_model_len(None if auto else args.max_model_len, mc.default_max_model_len,
                                    mc.default_max_model_len_rule)
    spec = KVCacheSpec(num_layers=mc.num_hidden_layers, num_kv_heads=mc.num_key_value_heads,
                       head_dim=mc.head_dim, block_size=args.block_size, dtype=dtype)
    graphs = uses_decode_graphs(args, device, backend, mc.rope, max_len)
    activation = activation_bytes_estimate(mc, args, dtype, device, graphs) if device.type == "cuda" else 0
    num_blocks = num_kv_blocks(args, spec, device, max_len, activation)
    if activation and args.kv_cache_memory_bytes is None and args.num_gpu_blocks_override is None:
        logger.info("GPU memory: %.2f GiB held (weights), %.2f GiB kept for a step's activations (an estimate), the "
                    "rest of gpu_memory_utilization=%s for the KV cache", torch.cuda.memory_reserved(device) / 2**30,
                    activation / 2**30, args.gpu_memory_utilization)
    if auto and (num_blocks - 1) * args.block_size < max_len:
        max_len = (num_blocks - 1) * args.block_size  # what the cache holds (as vLLM caps it)
        logger.info("max_model_len=auto: %d tokens, what the KV cache holds", max_len)
    kv_cache = allocate_kv_cache(args, spec, num_blocks, device)
    if args.preemption_mode == "swap" and args.num_cpu_blocks == 0:
        logger.warning("preemption_mode='swap' with num_cpu_blocks=0: there is no CPU pool to swap to, so a "
                       "preempted sequence is recomputed; give num_cpu_blocks (swap_space is not read)")
    prefix_caching = args.enable_prefix_caching
    if prefix_caching and dynamic_rope_rescales(mc.rope, max_len):
        logger.warning("prefix caching is off: with dynamic RoPE and max_model_len=%d above the model's %d "
                       "positions, a prompt token's key depends on its prompt's length, so equal prefixes "
                       "of prompts of different lengths do not share KV", max_len, mc.rope.max_position_embeddings)
        prefix_caching = False
    scheduler = make_scheduler(args, num_blocks, max_len, device, prefix_caching)
    usable = num_blocks - 1  # block 0 is the null block
    tokens_capacity = usable * args.block_size
    logger.info(
        "model %s (%s, %s, %s) loaded in %.1fs; KV cache: %d blocks x %d tokens (+1 reserved), "
        "%.1f KiB per block (M_KV = 2 * %d layers * %d kv heads * %d head_dim * %d tokens * %d bytes), "
        "%d tokens in all, max concurrency %.1f at max_model_len=%d",
        args.model or model_path.name, mc.architecture, str(dtype).replace("torch.", ""),
        device, time.perf_counter() - t0, usable, args.block_size, spec.bytes_per_block / 1024,
        spec.num_layers, spec.num_kv_heads, spec.head_dim, args.block_size,
        torch.empty((), dtype=dtype).element_size(), tokens_capacity,
        usable / -(-max_len // args.block_size), max_len,  # a sequence holds whole blocks
    )
    if tokens_capacity + 1 < max_len:  # (a sequence's last token is never cached)
        logger.warning("the KV cache holds %d tokens, fewer than max_model_len=%d: a request whose prompt + "
                       "max_tokens needs more (its n samples share the prompt's full blocks) is refused (give "
                       "more KV memory or lower max_model_len)",
                       tokens_capacity, max_len)
    # Decided once, before the KV cache was sized around the graphs' memory (an auto max_model_len
    # lowered since may no longer rescale a dynamic RoPE; the estimate did not count them).
    decode_graphs = capture_decode_graphs(args, model, kv_cache, device, max_len) if graphs else None
    grammar_parts = _structured_outputs(args, tokenizer, vocab_size, eos, device)
    return EngineParts(model_path, device, dtype, model, tokenizer, vocab_size, eos, defaults, max_len, num_blocks,
                       kv_cache, scheduler, decode_graphs, *grammar_parts)


def _structured_outputs(args: EngineArgs, tokenizer: Any, vocab_size: int, eos: tuple[int, ...],
                        device: torch.device) -> tuple[LazyGrammarCompiler, GrammarRows, ReasoningParser | None]:
    """The grammar compiler, the rows that mask the logits of generations under a grammar, and the
    reasoning parser (checked against the tokenizer) after whose ``</think>`` those grammars start."""
    reasoning = ReasoningParser.of(args.reasoning_parser, tokenizer.get_vocab())
    grammars = LazyGrammarCompiler(tokenizer, vocab_size, eos[0] if eos else None)
    rows = GrammarRows(grammars.vocab_width, pin_memory=device.type == "cuda", on_failed_grammar=grammars.forget,
                       reasoning_tags=None if reasoning is None else reasoning.tags)
    return grammars, rows, reasoning


def uses_decode_graphs(args: EngineArgs, device: torch.device, backend: str, rope: Any, max_model_len: int) -> bool:
    """Whether decode steps replay CUDA graphs: on a GPU, with the Triton backend (the torch one
    reads host lengths), unless ``enforce_eager``, and not where dynamic RoPE rescales (its
    frequencies come from host lengths too)."""
    from ferrokv.models.rope import dynamic_rope_rescales

    return (device.type == "cuda" and backend == "triton" and not args.enforce_eager
            and not dynamic_rope_rescales(rope, max_model_len))


def capture_decode_graphs(args: EngineArgs, model: Any, kv_cache: PagedKVCache, device: torch.device,
                          max_model_len: int) -> DecodeGraphs | None:
    """The decode graphs, captured (where ``uses_decode_graphs``); a capture that fails is logged
    and the engine runs eagerly."""
    try:
        graphs = DecodeGraphs(model, kv_cache.layers, device, args.max_num_seqs, -(-max_model_len // args.block_size))
        seconds = graphs.capture()
    except Exception as e:  # noqa: BLE001 - any failure: the eager path serves every step
        logger.warning("CUDA graphs: capture failed (%s: %s); every step runs eagerly", type(e).__name__, e)
        logger.debug("CUDA graph capture failure", exc_info=True)
        return None
    logger.info("CUDA graphs: decode steps of up to %d sequences replay %d captured batch sizes (%.1f s to capture; "
                "enforce_eager=True runs them eagerly)", graphs.max_batch, len(graphs.sizes), seconds)
    return graphs


class ModelConfigView:
    """vLLM's ``llm_engine.model_config``: the attributes scripts read from it (``model``,
    ``tokenizer``, ``dtype``, ``max_model_len``, ``hf_config``, ``seed``, ``revision``,
    ``get_vocab_size()``, ``runner_type``, ``served_model_name``, ``get_diff_sampling_param()``), read
    from the engine when asked (a view, not a copy)."""

    __slots__ = ("_engine",)

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    @property
    def model(self) -> str:
        """The model as the caller named it (a Hub id stays an id, as in vLLM); the default
        model's folder when none was named."""
        given = self._engine.args.model
        return str(given) if given is not None else str(self._engine.model_path)

    @property
    def tokenizer(self) -> str:
        return self._engine.args.tokenizer or self.model

    @property
    def dtype(self) -> torch.dtype:
        return self._engine.dtype

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    @property
    def hf_config(self) -> Any:
        """The model's config.json (``hf_overrides`` set on top) as transformers' config class, as
        vLLM's (``architectures``, ``model_type``, ``to_dict()``...); read when asked."""
        from transformers import AutoConfig, PretrainedConfig

        from ferrokv.model_loader import load_config

        d = load_config(self._engine.model_path, self._engine.args.hf_overrides)
        try:
            return AutoConfig.for_model(**d)
        except (ValueError, KeyError, TypeError):  # a model_type transformers does not know
            return PretrainedConfig(**d)

    @property
    def seed(self) -> int | None:
        return self._engine.args.seed

    @property
    def revision(self) -> str | None:
        return self._engine.args.revision

    def get_vocab_size(self) -> int:
        return self._engine.vocab_size

    runner_type = "generate"  # vLLM's: what the model runs as (ferrokv serves generative models only)

    @property
    def served_model_name(self) -> str:
        return self.model  # vLLM's default (a server's --served-model-name is the server's own)

    def get_diff_sampling_param(self) -> dict[str, Any]:
        """vLLM's: the SamplingParams fields the model's generation config recommends."""
        return dict(self._engine.default_sampling_params)



class CacheConfigView:
    """vLLM's ``llm_engine.cache_config``: ``block_size``, ``num_gpu_blocks`` (the KV cache's
    blocks, the reserved null block included), ``num_cpu_blocks``, ``enable_prefix_caching``,
    ``gpu_memory_utilization``, ``swap_space`` and ``cache_dtype`` ("auto": the model's dtype),
    read from the engine when asked (a view, not a copy)."""

    __slots__ = ("_engine",)
    cache_dtype = "auto"

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    block_size = property(lambda self: self._engine.args.block_size)
    num_gpu_blocks = property(lambda self: self._engine.kv_cache.num_blocks)
    num_cpu_blocks = property(lambda self: self._engine.args.num_cpu_blocks)
    enable_prefix_caching = property(lambda self: self._engine.args.enable_prefix_caching)
    gpu_memory_utilization = property(lambda self: self._engine.args.gpu_memory_utilization)
    swap_space = property(lambda self: self._engine.args.swap_space)

    def metrics_info(self) -> dict[str, str]:
        """vLLM's ``CacheConfig.metrics_info()``: every field as a string (the labels of
        ``/metrics``' ``cache_config_info``)."""
        names = ("block_size", "cache_dtype", "enable_prefix_caching", "gpu_memory_utilization", "num_cpu_blocks",
                 "num_gpu_blocks", "swap_space")
        return {name: str(getattr(self, name)) for name in names}
