"""A table of bad inputs across every entry point: ``SamplingParams``, ``LLM`` (generate, chat,
beam search, the constructor), ``LLMEngine.add_request``, the ``ferrokv`` command (in
subprocesses) and the bindings (``ferrokv._core.Scheduler``).

Each case does one bad thing and must raise the expected exception type with a message naming the
field (and the value where it makes sense). After each case, whatever it was, one shared tiny
``LLM`` must still answer a normal greedy request exactly as it did before any case ran, hold no
request, and have every KV block it held when idle free again; and one shared binding
``Scheduler`` must likewise run a request and end with all its blocks free. So a bad request can
neither poison the engine nor leak what it half-allocated.

Costs: one tiny model (shared with the other end-to-end tests), a few short greedy runs per case,
and the CLI cases' subprocesses started together once; the whole file runs in seconds.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from ferrokv import (
    LLM,
    CacheCapacityError,
    DuplicateRequestError,
    FerrokvError,
    InvalidArgumentError,
    PromptTooLongError,
    SamplingParams,
    SchedulerStateError,
    UnknownRequestError,
    UnknownSequenceError,
)
from ferrokv._core import Scheduler, TextModel
from helpers.tiny_models import TINY_VOCAB

MAX_MODEL_LEN = 64
MAX_NUM_SEQS = 8
ENGINE_KW = dict(device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, block_size=4, num_gpu_blocks_override=64,
                 max_num_seqs=MAX_NUM_SEQS)
PROBE = {"prompt_token_ids": [17, 99, 250, 3, 8, 77, 140, 200, 31]}
GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
SURROGATE = "caf\ud800"  # a lone surrogate: a str that is not Unicode text


# ------------------------------------------------------------------------------------------------
# Shared state
# ------------------------------------------------------------------------------------------------
@dataclass
class World:
    llm: LLM
    baseline: list[int]  # PROBE's greedy output before any case ran
    idle_free_blocks: int
    model_dir: Any
    broken: dict[str, Any]  # model folders with a damaged file
    scheduler: Scheduler  # the bindings' shared scheduler
    next_core_id: int = 1_000

    @property
    def engine(self):
        return self.llm.llm_engine

    def core_id(self) -> int:
        self.next_core_id += 1
        return self.next_core_id


def _break_models(model_dir, root) -> dict[str, Any]:
    """Copies of the tiny model with config.json unreadable, config.json not an object, and
    generation_config.json unreadable."""
    out = {}
    for name, file, text in [("config-garbage", "config.json", '{"architectures": ["LlamaForCausalLM"],'),
                             ("config-list", "config.json", "[1, 2, 3]"),
                             ("genconfig-garbage", "generation_config.json", "{eos_token_id: 0")]:
        path = root / name
        shutil.copytree(model_dir, path)
        (path / file).write_text(text)
        out[name] = path
    return out


@pytest.fixture(scope="module")
def world(tiny_model_dir, tmp_path_factory) -> World:
    model_dir = tiny_model_dir("llama", "llama")
    llm = LLM(str(model_dir), **ENGINE_KW)
    baseline = llm.generate(PROBE, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert len(baseline) == GREEDY.max_tokens
    broken = _break_models(model_dir, tmp_path_factory.mktemp("broken_models"))
    w = World(llm, baseline, llm.llm_engine.scheduler.num_free_blocks, model_dir, broken,
              Scheduler(32, block_size=4, max_model_len=MAX_MODEL_LEN))
    _check_world(w)
    return w


def _check_world(w: World) -> None:
    """The shared LLM and binding scheduler are as good as new."""
    engine = w.engine
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.num_free_blocks == w.idle_free_blocks, engine.stats()
    out = w.llm.generate(PROBE, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert out == w.baseline
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.num_free_blocks == w.idle_free_blocks, engine.stats()
    engine.scheduler.check_invariants()

    sch = w.scheduler
    assert sch.num_unfinished == 0 and sch.num_free_blocks == sch.num_blocks - 1
    rid = w.core_id()
    sch.add_request(rid, [5, 6, 7, 8, 9], 3)
    finished = []
    while sch.has_unfinished():
        out = sch.schedule()
        finished += sch.update(out, [11] * out.num_rows)
    assert [(f.request_id, f.reason) for f in finished] == [(rid, "length")]
    assert sch.num_free_blocks == sch.num_blocks - 1
    sch.check_invariants()


# ------------------------------------------------------------------------------------------------
# CLI: every command started at once (each pays Python's and maybe torch's start-up), read per case
# ------------------------------------------------------------------------------------------------
CLI_ARGS: dict[str, list[Any]] = {
    "cli-temperature": ["generate", "--raw", "--temperature", "-1", "hi"],
    "cli-dtype": ["generate", "--raw", "--dtype", "int8", "hi"],
    "cli-seed-huge": ["generate", "--raw", "--seed", str(2**70), "hi"],
    # argv bytes that are not UTF-8 reach Python as lone surrogates (surrogateescape).
    "cli-prompt-not-utf8": ["generate", "--raw", b"caf\xff"],
    "cli-config-garbage": ["generate", "--raw", "hi"],
}


@pytest.fixture(scope="module")
def cli_runs(world) -> Iterator[dict[str, subprocess.Popen]]:
    common = ["--quiet", "--max-tokens", "2", "--num-kv-blocks", "16", "--block-size", "4", "--max-model-len", "32"]
    procs = {}
    for name, argv in CLI_ARGS.items():
        model = world.broken["config-garbage"] if name == "cli-config-garbage" else world.model_dir
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "ferrokv", *argv[:1], "--model", str(model), *common, *argv[1:]],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    yield procs
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()


def run_cli(cli_runs, name: str) -> None:
    """Raises what a user of the command sees: its exit status and its stderr (``CliError``)."""
    p = cli_runs[name]
    _, err = p.communicate(timeout=120)
    raise CliError(p.returncode, err.decode("utf-8", "replace"))


class CliError(Exception):
    def __init__(self, returncode: int, stderr: str) -> None:
        super().__init__(f"exit status {returncode}: {stderr}")
        self.returncode = returncode


# ------------------------------------------------------------------------------------------------
# The cases
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    id: str
    call: Callable[[World, Any], Any]
    error: type[BaseException]
    names: tuple[str, ...]  # text the message must contain: the field, and the value where sensible


def sp(**kw) -> Callable[[World, Any], Any]:
    return lambda w, cli: SamplingParams(**kw)


def gen(prompt: Any, params: Any = GREEDY) -> Callable[[World, Any], Any]:
    return lambda w, cli: w.llm.generate(prompt, params, use_tqdm=False)


def add(prompt: Any = PROBE, params: Any = GREEDY, **kw) -> Callable[[World, Any], Any]:
    def call(w: World, cli: Any) -> None:
        try:
            w.engine.add_request("bad", prompt, params, **kw)
        finally:  # taken by mistake, it must not stay to fail the cases after this one
            w.engine.abort_request("bad")

    return call


def mutated(**fields) -> SamplingParams:
    p = SamplingParams(temperature=1.0, max_tokens=4)
    for k, v in fields.items():
        setattr(p, k, v)
    return p


def chat(messages: Any) -> Callable[[World, Any], Any]:
    return lambda w, cli: w.llm.chat(messages, GREEDY, use_tqdm=False)


def beam(**kw) -> Callable[[World, Any], Any]:
    args = dict(beam_width=2, max_tokens=3) | kw
    return lambda w, cli: w.llm.beam_search([PROBE], **args)


def new_llm(model: str | None = None, **kw) -> Callable[[World, Any], Any]:
    return lambda w, cli: LLM(str(w.broken[model] if model else w.model_dir), **(ENGINE_KW | kw))


def duplicate_request(w: World, cli: Any) -> None:
    w.engine.add_request("dup", PROBE, GREEDY)
    try:
        w.engine.add_request("dup", PROBE, GREEDY)
    finally:
        w.engine.abort_request("dup")


def request_id_typed(request_id: Any) -> Callable[[World, Any], Any]:
    def call(w: World, cli: Any) -> None:
        w.engine.add_request(request_id, PROBE, GREEDY)  # refused before anything is queued

    return call


def abort_typed(request_ids: Any) -> Callable[[World, Any], Any]:
    def call(w: World, cli: Any) -> None:
        w.engine.add_request("1", PROBE, GREEDY)
        try:
            w.engine.abort_request(request_ids)  # bytes would iterate as ints: ids "1" and "2"
            assert w.engine.has_unfinished_requests(), "a refused abort ended a request"
        finally:
            w.engine.abort_request("1")

    return call


def core_duplicate(w: World, cli: Any) -> None:
    rid = w.core_id()
    w.scheduler.add_request(rid, [5, 6], 2)
    try:
        w.scheduler.add_request(rid, [5, 6], 2)
    finally:
        w.scheduler.abort(rid)


def core_update_twice(w: World, cli: Any) -> None:
    out = w.scheduler.schedule()
    w.scheduler.update(out, [])
    w.scheduler.update(out, [])


def core_add(prompt: Any = (5, 6), max_tokens: int = 2, **kw) -> Callable[[World, Any], Any]:
    def call(w: World, cli: Any) -> None:
        rid = w.core_id()
        try:
            w.scheduler.add_request(rid, list(prompt), max_tokens, **kw)
        finally:  # taken by mistake, it must not stay to fail the cases after this one
            try:
                w.scheduler.abort(rid)
            except UnknownRequestError:
                pass

    return call


def cli(name: str) -> Callable[[World, Any], Any]:
    return lambda w, cli_runs: run_cli(cli_runs, name)


CASES = [
    # --- SamplingParams ---------------------------------------------------------------------------
    Case("sp-temperature-negative", sp(temperature=-1.0), ValueError, ("temperature", "-1.0")),
    Case("sp-temperature-nan", sp(temperature=math.nan), ValueError, ("temperature", "nan")),
    Case("sp-top_p-zero", sp(top_p=0.0), ValueError, ("top_p", "0.0")),
    Case("sp-top_k-negative", sp(top_k=-2), ValueError, ("top_k", "-2")),
    Case("sp-min_p-above-one", sp(min_p=1.5), ValueError, ("min_p", "1.5")),
    Case("sp-n-zero", sp(n=0), ValueError, ("n must", "0")),
    Case("sp-max_tokens-zero", sp(max_tokens=0), ValueError, ("max_tokens", "0")),
    Case("sp-min_tokens-above-max", sp(min_tokens=5, max_tokens=2), ValueError, ("min_tokens", "5")),
    Case("sp-logprobs-negative", sp(logprobs=-2), ValueError, ("logprobs", "-2")),
    Case("sp-stop-empty", sp(stop=[""]), ValueError, ("stop",)),
    Case("sp-stop-surrogate", sp(stop=["ok", SURROGATE]), ValueError, ("stop", r"\ud800")),
    Case("sp-stop_token_ids-negative", sp(stop_token_ids=[-3]), ValueError, ("stop_token_ids", "-3")),
    Case("sp-stop-int", sp(stop=5), ValueError, ("stop must", "5")),
    Case("sp-stop_token_ids-int", sp(stop_token_ids=3), ValueError, ("stop_token_ids must", "3")),
    Case("sp-seed-str", sp(seed="7"), ValueError, ("seed", "'7'")),
    Case("sp-ignore_eos-str", sp(ignore_eos="yes"), ValueError, ("ignore_eos", "'yes'")),
    Case("sp-repetition_penalty-zero", sp(repetition_penalty=0.0), ValueError, ("repetition_penalty", "0.0")),
    Case("sp-output_kind", sp(output_kind=7), ValueError, ("output_kind", "7")),
    # --- LLM.generate --------------------------------------------------------------------------------
    Case("generate-token-outside-vocab", gen({"prompt_token_ids": [3, TINY_VOCAB + 7]}), ValueError,
         ("prompt_token_ids[1]", str(TINY_VOCAB + 7))),
    Case("generate-empty-prompt", gen({"prompt_token_ids": []}), ValueError, ("prompt_token_ids", "empty")),
    Case("generate-prompt-too-long", gen({"prompt_token_ids": [5] * (MAX_MODEL_LEN + 1)}), ValueError,
         ("max_model_len", str(MAX_MODEL_LEN + 1))),
    Case("generate-token-not-int", gen({"prompt_token_ids": [5, "x"]}), ValueError, ("prompt_token_ids[1]", "'x'")),
    # A list of ints is one tokenized prompt (vLLM's parsing): its id is checked against the vocabulary.
    Case("generate-prompt-int", gen([12345]), ValueError, ("prompt_token_ids[0]", "12345", "vocabulary")),
    Case("generate-prompts-int", gen(12345), ValueError, ("prompts", "12345")),
    Case("generate-prompt-surrogate", gen(SURROGATE), ValueError, ("prompt", r"\ud800")),
    Case("generate-prompt-dict-surrogate", gen({"prompt": SURROGATE}), ValueError, ("prompt", r"\ud800")),
    Case("generate-prompts-none", gen(None), ValueError, ("prompts", "None")),
    Case("generate-params-count", gen([PROBE, PROBE], [GREEDY] * 3), ValueError, ("sampling_params", "3")),
    Case("generate-params-not-params", gen(PROBE, [{"temperature": 0}]), ValueError, ("sampling_params[0]", "'temperature'")),
    Case("generate-params-dict", gen(PROBE, {"temperature": 0}), ValueError, ("sampling_params must", "{'temperature': 0}")),
    Case("generate-params-none-in-list", gen([PROBE, PROBE], [GREEDY, None]), ValueError, ("sampling_params[1]", "None")),
    Case("generate-prompt-bytes", gen(b"hi"), ValueError, ("prompts", "b'hi'")),
    Case("generate-params-mutated-nan", gen(PROBE, mutated(temperature=math.nan)), ValueError,
         ("temperature", "nan")),
    Case("generate-params-mutated-max_tokens", gen(PROBE, mutated(max_tokens=-3)), ValueError, ("max_tokens", "-3")),
    Case("generate-n-above-max_num_seqs", gen(PROBE, SamplingParams(n=MAX_NUM_SEQS + 1)), ValueError,
         (f"n={MAX_NUM_SEQS + 1}", "max_num_seqs")),
    # --- LLMEngine.add_request ------------------------------------------------------------------------
    Case("engine-cache-capacity", add(params=SamplingParams(n=MAX_NUM_SEQS, max_tokens=100)), CacheCapacityError,
         ("request_id='bad'", "max_tokens")),
    Case("engine-duplicate-request_id", duplicate_request, ValueError, ("request_id='dup'", "in use")),
    Case("engine-request_id-none", request_id_typed(None), ValueError, ("request_id must be a str", "None")),
    Case("engine-request_id-float", request_id_typed(1.5), ValueError, ("request_id must be a str", "1.5")),
    Case("engine-abort-bytes", abort_typed(b"\x01\x02"), ValueError, ("request_id must be a str", "bytes")),
    Case("engine-abort-none-in-list", abort_typed(["1", None]), ValueError, ("request_id must be a str", "None")),
    Case("engine-priority-huge", add(priority=2**40), ValueError, ("priority", str(2**40))),
    Case("engine-priority-str", add(priority="high"), ValueError, ("priority", "'high'")),
    Case("engine-cache_salt-surrogate", add(cache_salt=SURROGATE), ValueError, ("cache_salt", r"\ud800")),
    Case("engine-cache_salt-int", add(cache_salt=5), ValueError, ("cache_salt", "5")),
    Case("engine-params-mutated-top_p", add(params=mutated(top_p=0.0)), ValueError, ("top_p", "0.0")),
    # --- LLM.chat --------------------------------------------------------------------------------------
    Case("chat-missing-role", chat([{"content": "hi"}]), ValueError, ("messages[0].role", "missing")),
    Case("chat-content-int", chat([{"role": "user", "content": 5}]), ValueError, ("messages[0].content", "5")),
    Case("chat-content-surrogate", chat([{"role": "user", "content": SURROGATE}]), ValueError,
         ("messages[0].content", r"\ud800")),
    Case("chat-str", chat("hello"), ValueError, ("messages", "'hello'")),
    Case("chat-batch-second-bad", chat([[{"role": "user", "content": "hi"}], [{"role": "user", "content": 7}]]),
         ValueError, ("messages[1][0].content", "7")),
    Case("chat-message-not-dict", chat([["hi"]]), ValueError, ("messages[0][0]", "'hi'")),
    # --- LLM.beam_search ----------------------------------------------------------------------------------
    Case("beam-width-zero", beam(beam_width=0), ValueError, ("beam_width", "0")),
    Case("beam-width-above-max_num_seqs", beam(beam_width=MAX_NUM_SEQS + 1), ValueError,
         (f"beam_width={MAX_NUM_SEQS + 1}",)),
    Case("beam-width-forks-past-max_num_seqs", beam(beam_width=MAX_NUM_SEQS // 2 + 1), ValueError,
         (f"beam_width={MAX_NUM_SEQS // 2 + 1}", "sequence slots", f"max_num_seqs={MAX_NUM_SEQS}")),
    Case("beam-length_penalty-nan", beam(length_penalty=math.nan), ValueError, ("length_penalty", "nan")),
    Case("beam-max_tokens-str", beam(max_tokens="3"), ValueError, ("max_tokens", "'3'")),
    # --- LLM() ---------------------------------------------------------------------------------------------
    Case("llm-seed-huge", new_llm(seed=2**70), ValueError, ("seed", str(2**70))),
    Case("llm-block_size", new_llm(block_size=24), InvalidArgumentError, ("block_size=24",)),
    Case("llm-num_gpu_blocks_override", new_llm(num_gpu_blocks_override=1), InvalidArgumentError,
         ("num_gpu_blocks_override=1",)),
    # num_kv_blocks is an alias of vLLM's name: the error names the field it sets.
    Case("llm-num_kv_blocks", new_llm(num_kv_blocks=1, num_gpu_blocks_override=None), InvalidArgumentError,
         ("num_gpu_blocks_override=1",)),
    Case("llm-device", new_llm(device="tpu"), ValueError, ("device", "'tpu'")),
    Case("llm-unknown-keyword", new_llm(max_num_seq_s=4), TypeError, ("max_num_seq_s",)),
    Case("llm-config-garbage", new_llm("config-garbage"), ValueError, ("config-garbage/config.json", "JSON")),
    Case("llm-config-list", new_llm("config-list"), ValueError, ("config-list/config.json", "object")),
    Case("llm-generation-config-garbage", new_llm("genconfig-garbage"), ValueError,
         ("genconfig-garbage/generation_config.json", "JSON")),
    # --- ferrokv._core.Scheduler --------------------------------------------------------------------------
    Case("core-num_blocks-zero", lambda w, c: Scheduler(0), InvalidArgumentError, ("num_blocks=0",)),
    Case("core-block_size", lambda w, c: Scheduler(32, block_size=24), InvalidArgumentError, ("block_size=24",)),
    Case("core-duplicate-request", core_duplicate, DuplicateRequestError, ("request_id=",)),
    Case("core-abort-unknown", lambda w, c: w.scheduler.abort(10**9), UnknownRequestError, ("request_id=1000000000",)),
    Case("core-drop-unknown", lambda w, c: w.scheduler.drop_sequence(10**9), UnknownSequenceError,
         ("seq_id=1000000000",)),
    Case("core-prompt-too-long", core_add(range(3, 3 + MAX_MODEL_LEN + 1)), PromptTooLongError,
         ("max_model_len=64", str(MAX_MODEL_LEN + 1))),
    Case("core-max_tokens-zero", core_add(max_tokens=0), InvalidArgumentError, ("max_tokens=0",)),
    Case("core-token-negative", core_add([5, -1]), InvalidArgumentError, ("prompt_token_ids=-1",)),
    Case("core-n-zero", core_add(n=0), InvalidArgumentError, ("n=0",)),
    Case("core-update-twice", core_update_twice, SchedulerStateError, ("update()",)),
    Case("core-request_id-huge", lambda w, c: w.scheduler.add_request(2**63, [5], 2), InvalidArgumentError,
         ("request_id",)),
    Case("core-priority-huge", core_add(priority=2**40), InvalidArgumentError, ("priority",)),
    Case("core-cache_salt-surrogate", core_add(cache_salt=SURROGATE), InvalidArgumentError, ("cache_salt",)),
    Case("core-stop-empty", core_add(stop=[""]), InvalidArgumentError, ("stop", "empty")),
    Case("core-stop-not-a-list", core_add(stop=5), InvalidArgumentError, ("stop=5",)),
    Case("core-stop-without-text-layer", lambda w, c: Scheduler(32).add_request(0, [5], 2, stop=["x"]),
         InvalidArgumentError, ("stop", "text layer")),
    Case("core-stop_sequence-unknown", lambda w, c: w.scheduler.stop_sequence(10**9, 0), UnknownSequenceError,
         ("seq_id=1000000000",)),
    Case("core-text-model-garbage", lambda w, c: TextModel('{"model": 1}'), InvalidArgumentError,
         ("tokenizer_json",)),
    # --- the ferrokv command --------------------------------------------------------------------------------
    Case("cli-temperature", cli("cli-temperature"), CliError, ("exit status 2", "temperature", "-1.0")),
    Case("cli-dtype", cli("cli-dtype"), CliError, ("exit status 2", "--dtype", "'int8'")),
    Case("cli-seed-huge", cli("cli-seed-huge"), CliError, ("exit status 2", "seed", str(2**70))),
    Case("cli-prompt-not-utf8", cli("cli-prompt-not-utf8"), CliError, ("exit status 2", "prompt", r"\udcff")),
    Case("cli-config-garbage", cli("cli-config-garbage"), CliError,
         ("exit status 2", "config-garbage/config.json", "JSON")),
]


def test_the_table_is_large_and_covers_every_entry_point():
    assert len(CASES) >= 40 and len({c.id for c in CASES}) == len(CASES)
    prefixes = {c.id.split("-")[0] for c in CASES}
    assert {"sp", "generate", "engine", "chat", "beam", "llm", "core", "cli"} <= prefixes
    assert set(CLI_ARGS) == {c.id for c in CASES if c.id.startswith("cli-")}


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, id=c.id) for c in CASES],
)
def test_bad_input(case: Case, world: World, cli_runs):
    with pytest.raises(case.error) as e:
        case.call(world, cli_runs)
    # Exactly the type: a library's ValueError subclass (JSONDecodeError, UnicodeEncodeError) is
    # not an answer; ferrokv's own errors are.
    assert type(e.value) is case.error or (case.error is ValueError and isinstance(e.value, FerrokvError)), (
        f"{type(e.value).__name__}: {e.value}")
    message = str(e.value)
    for text in case.names:
        assert text in message, f"{text!r} not in {message!r}"
    _check_world(world)

