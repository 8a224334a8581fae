"""vLLM's script idiom (``ferrokv.utils``, ``EngineArgs.add_cli_args``/``from_cli_args``): the
engine flags on a ``FlexibleArgumentParser``, spelled with dashes or underscores, parse into the
``EngineArgs`` the CLI builds."""

from __future__ import annotations

import pytest

from ferrokv import AsyncEngineArgs, EngineArgs
from ferrokv.utils import FlexibleArgumentParser


def test_engine_flags_parse_into_engine_args_as_in_vllm_scripts():
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    parser.add_argument("--my-own", type=int, default=0)  # a script's flag beside the engine's
    args = parser.parse_args(["--model", "org/my_model", "--max_num_seqs=4", "--max-model-len", "128",
                              "--enable_prefix_caching", "--my_own", "7"])
    e = EngineArgs.from_cli_args(args)
    assert (e.model, e.max_num_seqs, e.max_model_len, e.enable_prefix_caching) == ("org/my_model", 4, 128, True)
    assert args.my_own == 7 and e == EngineArgs(model="org/my_model", max_num_seqs=4, max_model_len=128,
                                                 enable_prefix_caching=True)
    assert isinstance(AsyncEngineArgs.from_cli_args(args), AsyncEngineArgs)
    with pytest.raises(SystemExit):  # argparse's own refusal of an unknown flag
        parser.parse_args(["--no_such_flag", "1"])


def test_vllms_module_paths_of_the_script_helpers():
    """vLLM's examples import FlexibleArgumentParser from vllm.utils.argparse_utils and call
    vllm.distributed.cleanup_dist_env_and_memory between two LLMs: both paths exist here."""
    from ferrokv.utils.argparse_utils import FlexibleArgumentParser as FromSubmodule
    assert FromSubmodule is FlexibleArgumentParser


def test_cleanup_between_two_llms_frees_the_dropped_engine(tiny_model_dir):
    import weakref

    from ferrokv import LLM, SamplingParams
    from ferrokv.distributed import cleanup_dist_env_and_memory

    path = str(tiny_model_dir("llama"))
    llm = LLM(path, device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=32)
    want = llm.generate("the cat", SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)[0].outputs[0].text
    cache = weakref.ref(llm.llm_engine.kv_cache)
    del llm
    cleanup_dist_env_and_memory()
    assert cache() is None  # the first engine's KV cache is gone
    again = LLM(path, device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=32)
    assert again.generate("the cat", SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)[0].outputs[0].text \
        == want
