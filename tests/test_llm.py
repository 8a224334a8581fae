"""End-to-end tests of the ``LLM`` API: the embedded SmolLM2 against transformers, beam search
against transformers' beam search, bad input, and ``chat``. CPU, fp32.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from ferrokv import LLM, BeamSearchParams, EngineArgs, SamplingParams
from helpers.engine_faults import engine_kwargs
from helpers.text_oracle import final_text
from helpers.tiny_models import TINY_VOCAB


def tiny_llm(path, **kw) -> LLM:
    args = dict(device="cpu", dtype="float32", max_model_len=128, block_size=4, num_kv_blocks=128)
    args.update(kw)
    return LLM(str(path), **args)


def assert_no_leak(llm: LLM) -> None:
    engine = llm.llm_engine
    sch = engine.scheduler
    assert not engine.has_unfinished_requests()
    assert sch.num_unfinished == 0 and sch.num_free_blocks == sch.num_blocks - 1, engine.stats()
    sch.check_invariants()


@pytest.fixture(scope="module")
def llama_llm(llama_path):
    return tiny_llm(llama_path)


def rand_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, TINY_VOCAB) for _ in range(n)]


# ------------------------------------------------------------------------------------------------
# 2. The embedded SmolLM2-135M-Instruct, greedy, token for token against transformers
# ------------------------------------------------------------------------------------------------
SMOL_NEW = 10


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers(smollm2_llm, hf_greedy):
    llm = smollm2_llm
    tok = llm.get_tokenizer()
    path = llm.llm_engine.model_path
    chat = [{"role": "system", "content": "You are a concise assistant."},
            {"role": "user",
             "content": "Explain in two sentences why the sky is blue during the day and red at sunset."}]
    chat_ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    chat_ids = list(chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids)
    texts = [
        "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
        "combined movable metal type, oil-based ink and a wooden screw press. Within fifty years",
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number, computed iteratively.\"\"\"\n"
        "    a, b = 0, 1\n    for _ in range(n):\n",
    ]
    prompts = [{"prompt_token_ids": chat_ids}] + texts
    prompt_ids = [chat_ids] + [tok.encode(t) for t in texts]
    assert all(len(p) >= 32 for p in prompt_ids), [len(p) for p in prompt_ids]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=SMOL_NEW, ignore_eos=True),
                        use_tqdm=False)
    for p, o in zip(prompt_ids, outs):
        assert o.prompt_token_ids == p
        assert o.outputs[0].token_ids == hf_greedy(path, p, SMOL_NEW), tok.decode(p)
    assert_no_leak(llm)


@pytest.mark.slow
def test_smollm2_chat_answers(smollm2_llm):
    out = smollm2_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                           SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text


# ------------------------------------------------------------------------------------------------
# 3. Beam search == transformers' beam search
# ------------------------------------------------------------------------------------------------
BEAM_NEW = 8


def hf_beams(model, prompt, k, eos, length_penalty=1.0):
    with torch.no_grad():
        g = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            num_beams=k, num_return_sequences=k, do_sample=False, max_new_tokens=BEAM_NEW,
            early_stopping=False, length_penalty=length_penalty, eos_token_id=eos, pad_token_id=0,
            output_scores=True, return_dict_in_generate=True,
        )
    seqs = []
    for row in g.sequences[:, len(prompt):].tolist():
        if eos is not None and eos in row:
            row = row[:row.index(eos) + 1]  # transformers pads finished beams (pad = 0)
        seqs.append(prompt + row)  # vLLM's beam tokens start with the prompt's
    return seqs, g.sequences_scores.tolist()


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("with_eos", [False, True], ids=["no-eos", "eos"])
def test_beam_search_matches_transformers(k, with_eos, llama_path, eos_model_dir, hf_model):
    if with_eos:
        path, eos_prompt = eos_model_dir
        prompts = [eos_prompt, eos_prompt[:9], rand_prompt(23, 1)]
    else:
        path = llama_path
        prompts = [rand_prompt(5, 2), rand_prompt(19, 3), rand_prompt(40, 4)]
    llm = tiny_llm(path)
    hf = hf_model(path)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], beam_width=k, max_tokens=BEAM_NEW,
                           ignore_eos=not with_eos)
    assert len(outs) == len(prompts)
    saw_eos = False
    for p, o in zip(prompts, outs):
        ref_seqs, ref_scores = hf_beams(hf, p, k, 0 if with_eos else None)
        assert o.prompt_token_ids == p
        assert len(o.sequences) == k
        assert o.sequences[0].tokens == ref_seqs[0]  # the best hypothesis
        assert [s.tokens for s in o.sequences] == ref_seqs
        for s, ref in zip(o.sequences, ref_scores):
            generated = len(s.tokens) - len(p)
            assert s.cum_logprob / generated == pytest.approx(ref, abs=1e-4)
            # vLLM's shape: one {token: Logprob} per generated token, summing to the score; the
            # text is the tokenizer's decode of every token.
            assert [list(d) for d in s.logprobs] == [[t] for t in s.tokens[len(p):]]
            assert sum(d[t].logprob for d, t in zip(s.logprobs, s.tokens[len(p):])) == pytest.approx(s.cum_logprob,
                                                                                                     abs=1e-4)
            assert s.text == llm.get_tokenizer().decode(s.tokens)
            ended = with_eos and s.tokens[-1] == 0
            saw_eos |= ended
            assert s.finish_reason == ("stop" if ended else "length")
            if not ended:
                assert generated == BEAM_NEW
    assert saw_eos == with_eos  # with EOS active, some hypotheses really ended on it
    assert_no_leak(llm)
    st = llm.llm_engine.stats()
    assert st["cow_copies"] > 0  # beams fork off shared blocks
    # A search that found its hypotheses finished: it is not counted as aborted.
    assert (st["requests_finished"], st["requests_aborted"]) == (len(prompts), 0)


@pytest.mark.parametrize("k", [2, 3])
def test_beam_searches_that_fill_max_num_seqs_wait_rather_than_fail_a_step(k, llama_path):
    """A search holds 2k - 1 sequence slots (its k beams and one step's forks, made before the
    beams without children are dropped), so searches that fill max_num_seqs queue instead of
    failing a step by forking past it; the results equal those of a roomy engine."""
    prompts = [{"prompt_token_ids": rand_prompt(3 + i, 50 + i)} for i in range(4)]
    roomy = tiny_llm(llama_path).beam_search(prompts, beam_width=k, max_tokens=BEAM_NEW, ignore_eos=True)
    tight = tiny_llm(llama_path, max_num_seqs=2 * k - 1)
    outs = tight.beam_search(prompts, beam_width=k, max_tokens=BEAM_NEW, ignore_eos=True)
    assert [[s.tokens for s in o.sequences] for o in outs] == [[s.tokens for s in o.sequences] for o in roomy]
    assert_no_leak(tight)
    with pytest.raises(ValueError, match=rf"beam_width={k + 1} needs {2 * k + 1} sequence slots"):
        tight.beam_search(prompts[:1], beam_width=k + 1, max_tokens=2)


@pytest.mark.parametrize("prompt_len, k, length_penalty", [(14, 3, 2.0), (9, 4, 0.0)])
def test_beam_search_length_penalty_matches_transformers(prompt_len, k, length_penalty, eos_model_dir, hf_model):
    """A length penalty other than 1 re-ranks hypotheses of different lengths (each case is one
    where transformers' answer differs from its answer at 1.0, so ignoring it cannot pass)."""
    path, eos_prompt = eos_model_dir
    prompt = eos_prompt[:prompt_len]
    hf = hf_model(path)
    ref, _ = hf_beams(hf, prompt, k, 0, length_penalty)
    assert ref != hf_beams(hf, prompt, k, 0, 1.0)[0]
    out = tiny_llm(path).beam_search([{"prompt_token_ids": prompt}], beam_width=k, max_tokens=BEAM_NEW,
                                     length_penalty=length_penalty)[0]
    assert [s.tokens for s in out.sequences] == ref


# ------------------------------------------------------------------------------------------------
# 5. Bad input
# ------------------------------------------------------------------------------------------------
def test_unknown_model_path():
    with pytest.raises(ValueError, match=r"model.*/nonexistent"):
        LLM(model="/nonexistent")


def test_unsupported_architecture(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=TINY_VOCAB, n_positions=64)).save_pretrained(
        tmp_path)
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as e:
        LLM(str(tmp_path), device="cpu")
    for name in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"):
        assert name in str(e.value)


def test_unknown_keyword_is_type_error(llama_path):
    with pytest.raises(TypeError, match="max_num_seq_s"):
        LLM(str(llama_path), max_num_seq_s=4)


def test_generate_with_a_bad_prompt_raises_and_llm_still_works(llama_llm, hf_greedy, llama_path):
    llm = llama_llm
    good = [rand_prompt(n, 10 + n) for n in (4, 13, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    bad_cases = [
        ({"prompt_token_ids": [3, TINY_VOCAB + 7]}, "prompt_token_ids"),
        ({"prompt_token_ids": []}, "prompt"),
        ({"prompt_token_ids": rand_prompt(129, 0)}, "max_model_len"),
    ]
    for bad, field in bad_cases:
        # The message names the refused prompt of the batch, then the field.
        with pytest.raises(ValueError, match=rf"^prompts\[3\]: .*{field}"):
            llm.generate([{"prompt_token_ids": p} for p in good] + [bad], params, use_tqdm=False)
        assert_no_leak(llm)
    with pytest.raises(ValueError, match=r"^prompts\[1\]: .*prompt_token_ids") as e:  # in a later chunk
        llm.beam_search([{"prompt_token_ids": good[0]}, bad_cases[0][0]], beam_width=2, max_tokens=2,
                        concurrency_limit=1)
    assert e.value.args[0].count("prompts[") == 1
    with pytest.raises(ValueError, match=r"^prompt_token_ids"):  # one prompt: nothing to name
        llm.generate(bad_cases[0][0], params, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([{"prompt_token_ids": p} for p in good], [params, params], use_tqdm=False)
    with pytest.raises(ValueError, match="beam_width"):
        llm.beam_search([{"prompt_token_ids": good[0]}], beam_width=0, max_tokens=4)
    assert_no_leak(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in good], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(llama_path, p, 6) for p in good]
    assert_no_leak(llm)


# ------------------------------------------------------------------------------------------------
# 6. Text prompts, per-prompt params, chat
# ------------------------------------------------------------------------------------------------
def test_text_prompts_and_per_prompt_params(llama_llm, hf_greedy, llama_path):
    llm = llama_llm
    tok = llm.get_tokenizer()
    texts = ["The cat reads a long story today.", "My friend likes fresh bread in Paris."]
    # The first prompt finishes last: results still come back in prompt order.
    params = [SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)]
    outs = llm.generate(texts, params, use_tqdm=False)
    for t, p, o in zip(texts, params, outs):
        ids = tok.encode(t)
        assert o.prompt == t and o.prompt_token_ids == ids
        ref = hf_greedy(llama_path, ids, p.max_tokens)
        assert o.outputs[0].token_ids == ref
        assert o.outputs[0].text == final_text(tok, ref)
    single = llm.generate(texts[0], params[0], use_tqdm=False)  # a bare str is one prompt
    assert len(single) == 1 and single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert_no_leak(llm)


def test_chat_uses_the_chat_template(llama_llm):
    llm = llama_llm
    tok = llm.get_tokenizer()
    conv1 = [{"role": "user", "content": "Hello, who are you?"}]
    conv2 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
             {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another one?"}]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    one = llm.chat(conv1, params, use_tqdm=False)
    both = llm.chat([conv1, conv2], params, use_tqdm=False)
    assert len(one) == 1 and len(both) == 2
    for conv, o in zip([conv1, conv2], both):
        ids = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        assert o.prompt_token_ids == ids
        assert tok.decode(ids).endswith("<|im_start|>assistant\n")
        # vLLM's output.prompt of a chat: the rendered template.
        assert o.prompt == tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
        direct = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
        assert o.outputs[0].token_ids == direct.outputs[0].token_ids
    assert one[0].outputs[0].token_ids == both[0].outputs[0].token_ids
    assert_no_leak(llm)


def test_chat_takes_content_as_openai_text_parts(llama_llm):
    """vLLM's chat() takes OpenAI's content parts: for a template that reads strings, the text
    parts (also input_text, refusal and thinking ones) are joined with newlines, as vLLM joins
    them; other parts are refused; null content is empty text."""
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    plain = llama_llm.chat([{"role": "user", "content": "A dog\nruns.\nfast\nnow"}], params, use_tqdm=False)[0]
    parts = [{"type": "text", "text": "A dog"}, {"type": "input_text", "text": "runs."},
             {"type": "refusal", "refusal": "fast"}, {"type": "thinking", "thinking": "now"}]
    joined = llama_llm.chat([{"role": "user", "content": parts}], params, use_tqdm=False)[0]
    assert joined.prompt_token_ids == plain.prompt_token_ids
    assert joined.outputs[0].token_ids == plain.outputs[0].token_ids
    empty = llama_llm.chat([{"role": "user", "content": ""}], params, use_tqdm=False)[0]
    assert llama_llm.chat([{"role": "user", "content": None}], params, use_tqdm=False)[0].prompt == empty.prompt
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[1\] must be a \{'type': 'text'"):
        llama_llm.chat([{"role": "user", "content": [parts[0], {"type": "image_url", "image_url": {}}]}], params)
    assert_no_leak(llama_llm)


def test_chat_gives_tools_and_an_assistants_null_content_to_the_template(llama_llm):
    """vLLM's ``chat(tools=...)``: OpenAI's tool definitions reach the template; an assistant
    turn with null content (one that only called tools) renders as empty text."""
    llm = llama_llm
    template = ("{% if tools %}TOOLS {% for t in tools %}{{ t['function']['name'] }} {% endfor %}{% endif %}"
                "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}")
    tools = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]
    conv = [{"role": "user", "content": "time?"}, {"role": "assistant", "content": None},
            {"role": "user", "content": "well?"}]
    params = SamplingParams(temperature=0.0, max_tokens=2)
    out = llm.chat(conv, params, use_tqdm=False, chat_template=template, tools=tools)[0]
    assert out.prompt == "TOOLS now [user]time?[assistant][user]well?"
    assert llm.chat(conv, params, use_tqdm=False, chat_template=template)[0].prompt.startswith("[user]")
    with pytest.raises(ValueError, match="tools must be a list of tool objects"):
        llm.chat(conv, params, use_tqdm=False, tools={"name": "now"})
    with pytest.raises(ValueError, match=r"messages\[1\].content must be a str"):
        llm.chat([{"role": "user", "content": "a"}, {"role": "user", "content": 5}], params, use_tqdm=False)


def test_chat_replays_tool_calls_with_their_arguments_as_objects(llama_llm):
    """vLLM's chat(): an assistant turn that only called tools may leave out its content; its
    calls' ``arguments`` (JSON text) reach the template as objects, and a tool message's
    ``tool_call_id`` reaches it too; arguments that are not JSON are a ValueError naming them."""
    template = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}"
                "{% for c in m.get('tool_calls', []) %}{{ c['function']['name'] }}({{ c['function']['arguments']['city'] }})"
                "{% endfor %}{{ m.get('tool_call_id', '') }}{% endfor %}")
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    conv = [{"role": "user", "content": "weather?"}, {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    params = SamplingParams(temperature=0.0, max_tokens=2)
    out = llama_llm.chat(conv, params, use_tqdm=False, chat_template=template, add_generation_prompt=False)[0]
    assert out.prompt == "[user]weather?[assistant]weather(Paris)[tool]sunnyc1"
    assert conv[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # the caller's is untouched
    bad = [conv[0], {"role": "assistant", "tool_calls": [{**call, "function": {"name": "w", "arguments": "{x"}}]}]
    with pytest.raises(ValueError, match=r"messages\[1\]\.tool_calls\[0\]\.function\.arguments must be JSON"):
        llama_llm.chat(bad, params, use_tqdm=False, chat_template=template)
    # vLLM's: a message without content (or with null) renders as empty text; a role is needed.
    no_content = llama_llm.chat([conv[0], {"role": "user"}], params, use_tqdm=False, chat_template=template)[0]
    assert no_content.prompt == "[user]weather?[user]"
    with pytest.raises(ValueError, match=r"messages\[1\]\.role is missing"):
        llama_llm.chat([conv[0], {"content": "hi"}], params, use_tqdm=False, chat_template=template)
    assert_no_leak(llama_llm)


PARTS_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}]{% for part in m['content'] %}"
                  "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}\n{% endfor %}")


def test_chat_content_format_follows_what_the_template_reads(llama_llm):
    """vLLM's chat_template_content_format: "auto" finds a template that loops over a message's
    content parts and gives it parts ({"type": "text", ...}); "openai" and "string" force one."""
    from ferrokv.chat_content_format import detect_content_format

    conv = [{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": "Hello"}]
    params = SamplingParams(temperature=0.0, max_tokens=1)
    prompt = llama_llm.chat(conv, params, use_tqdm=False, chat_template=PARTS_TEMPLATE)[0].prompt
    assert prompt == "[user]Hi there[assistant]Hello"  # parts as they are; transformers trims the newline after a block
    assert llama_llm.chat(conv, params, use_tqdm=False, chat_template=PARTS_TEMPLATE,
                          chat_template_content_format="openai")[0].prompt == prompt
    # Forced to strings, the loop walks the characters and finds no text part.
    assert llama_llm.chat(conv, params, use_tqdm=False, chat_template=PARTS_TEMPLATE,
                          chat_template_content_format="string")[0].prompt == "[user][assistant]"
    assert detect_content_format(PARTS_TEMPLATE) == "openai"
    assert detect_content_format("{% for m in messages %}{{ m.content }}{% endfor %}") == "string"
    assert detect_content_format("{% for m in messages %}{% set c = m.content %}{% for p in c %}{{ p.text }}"
                                 "{% endfor %}{% endfor %}") == "openai"
    assert detect_content_format("{% for m in messages %}{% for p in m.content | selectattr('type') %}"
                                 "{% break %}{% endfor %}{% endfor %}") == "openai"
    assert detect_content_format("{% for %}") == "string"  # rendering reports a broken template
    tok = llama_llm.get_tokenizer()
    assert detect_content_format(tok.chat_template) == "string"


def test_chat_template_and_continue_final_message(llama_llm):
    """vLLM's chat(): a chat_template string replaces the tokenizer's, and continue_final_message
    leaves the last (assistant) message open, both as transformers renders them; bad values name
    the argument."""
    llm = llama_llm
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    conv = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"

    def ids(**kw):
        r = tok.apply_chat_template(conv, tokenize=True, **kw)
        return list(r["input_ids"] if hasattr(r, "keys") else r)

    out = llm.chat(conv, params, use_tqdm=False, chat_template=template)[0]
    assert out.prompt_token_ids == ids(chat_template=template, add_generation_prompt=True)
    # vLLM's positional order: messages, sampling_params, use_tqdm, lora_request, chat_template,
    # chat_template_content_format, add_generation_prompt.
    assert llm.chat(conv, params, False, None, template, "string", True)[0].prompt_token_ids == out.prompt_token_ids
    with pytest.raises(ValueError, match="chat_template_content_format must be one of 'auto', 'string', 'openai', "
                                         "got 'parts'"):
        llm.chat(conv, params, use_tqdm=False, chat_template_content_format="parts")
    assert tok.decode(out.prompt_token_ids).startswith("[user] Name a colour.")
    cont = llm.chat(conv, params, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    want = ids(add_generation_prompt=False, continue_final_message=True)
    assert cont.prompt_token_ids == want and tok.decode(want).rstrip().endswith("The colour is")
    assert want != ids(add_generation_prompt=True), "the last message is left open"
    with pytest.raises(ValueError, match="add_generation_prompt must be False"):
        llm.chat(conv, params, use_tqdm=False, continue_final_message=True)
    with pytest.raises(ValueError, match="continue_final_message must be a bool, got 'yes'"):
        llm.chat(conv, params, use_tqdm=False, add_generation_prompt=False, continue_final_message="yes")
    with pytest.raises(ValueError, match="chat_template must be a non-empty"):
        llm.chat(conv, params, use_tqdm=False, chat_template="  ")
    with pytest.raises(ValueError, match="chat_template refused this conversation"):
        llm.chat(conv, params, use_tqdm=False, chat_template="{{ raise_exception('no') }}")
    greet = "{% if greeting %}{{ greeting }} {% endif %}" + template
    out = llm.chat(conv, params, use_tqdm=False, chat_template=greet, chat_template_kwargs={"greeting": "Hello there."})[0]
    assert out.prompt_token_ids == ids(chat_template=greet, add_generation_prompt=True, greeting="Hello there.")
    assert tok.decode(out.prompt_token_ids).startswith("Hello there. [user]")
    with pytest.raises(ValueError, match="chat_template_kwargs may not set tokenize"):
        llm.chat(conv, params, use_tqdm=False, chat_template_kwargs={"tokenize": False})
    # vLLM applies chat_template_kwargs last: they override the arguments of their names.
    over = llm.chat(conv, params, use_tqdm=False,
                    chat_template_kwargs={"add_generation_prompt": False, "continue_final_message": True})[0]
    assert over.prompt_token_ids == want
    # Content parts as vLLM reads them: a bare string is text, a text part without text is skipped.
    parts = [{"role": "user", "content": ["Name a", {"type": "text", "text": None}, {"type": "text", "text": "colour."}]}]
    joined = llm.chat([{"role": "user", "content": "Name a\ncolour."}], params, use_tqdm=False)[0]
    assert llm.chat(parts, params, use_tqdm=False)[0].prompt_token_ids == joined.prompt_token_ids
    with pytest.raises(ValueError, match="chat_template_kwargs must be a dict"):
        llm.chat(conv, params, use_tqdm=False, chat_template_kwargs=["x"])
    assert_no_leak(llm)


def test_chat_template_failures_are_value_errors_naming_the_template(llama_llm):
    """Whatever a template's code raises on what the caller gave it (a division by zero, a type
    error, the sandbox's range cap, a lone surrogate printed from chat_template_kwargs) is a
    ValueError naming the template, and the engine goes on; ``messages`` cannot be overridden."""
    llm = llama_llm
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    conv = [{"role": "user", "content": "Hi"}]
    for template, kwargs, needle in [
        ("{{ 1/0 }}", None, "ZeroDivisionError"),
        ("{{ messages[0].content + 1 }}", None, "TypeError"),
        ("{% for i in range(1000000) %}{% endfor %}x", None, "OverflowError"),
        ("{{ x }}", {"x": "a\ud800b"}, "lone surrogate"),
        ("{{ raise_exception(x) }}", {"x": "bad \udc80"}, "refused this conversation (bad \\udc80)"),
    ]:
        with pytest.raises(ValueError, match="chat_template") as e:
            llm.chat(conv, params, use_tqdm=False, chat_template=template, chat_template_kwargs=kwargs)
        assert needle in str(e.value), (template, str(e.value))
        str(e.value).encode("utf-8")  # the message itself is valid text
    with pytest.raises(ValueError, match="chat_template_kwargs may not set messages"):
        llm.chat(conv, params, use_tqdm=False, chat_template_kwargs={"messages": 1})
    assert llm.chat(conv, params, use_tqdm=False)[0].finished
    assert_no_leak(llm)


def test_use_tqdm_callable_makes_the_bar(llama_llm):
    """vLLM's use_tqdm may be a callable that makes the progress bar (partial(tqdm, leave=False))."""
    import functools

    from tqdm import tqdm

    class Bar:
        """A bar made for vLLM's calls: these keywords, then update() and close() only."""

        def __init__(self, total, desc, dynamic_ncols, postfix):
            self.total, self.n, self.closed, self.postfix = total, 0, False, postfix

        def update(self, k):
            self.n += k

        def close(self):
            self.closed = True

    made = []
    outs = llama_llm.generate(["a b", "c d"], SamplingParams(max_tokens=2),
                              use_tqdm=lambda **kw: made.append(Bar(**kw)) or made[-1])
    assert len(outs) == 2 and len(made) == 1 and (made[0].n, made[0].total, made[0].closed) == (2, 2, True)
    assert made[0].postfix.startswith("est. speed input: ") and made[0].postfix.endswith(" toks/s")
    assert len(llama_llm.generate(["a"], SamplingParams(max_tokens=1), use_tqdm=functools.partial(tqdm, disable=True)))


def test_beam_search_params_form_equals_the_earlier_forms(llama_llm):
    """vLLM's beam_search(prompts, BeamSearchParams(...)) and ferrokv's earlier keyword and
    positional forms run the same search; unsupported and conflicting values are refused."""
    from ferrokv import BeamSearchParams

    llm = llama_llm
    prompts = [{"prompt_token_ids": rand_prompt(7, 11)}, {"prompt_token_ids": rand_prompt(12, 12)}]

    def seqs(outs, approx=False):
        # Scores within float32 noise: the batches of the runs differ, so their sums may round apart.
        return [[(s.tokens, pytest.approx(s.cum_logprob, abs=1e-4) if approx else s.cum_logprob) for s in o.sequences]
                for o in outs]

    vllm_form = seqs(llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True)), True)
    assert seqs(llm.beam_search(prompts, beam_width=3, max_tokens=5, ignore_eos=True)) == vllm_form
    assert seqs(llm.beam_search(prompts, 3, 5, 1.0, True)) == vllm_form
    # vLLM's concurrency_limit: the prompts searched a few at a time, the same searches.
    runs = []
    real_run = type(llm)._run

    def counted_run(self, batch, *a, **kw):
        runs.append(len(batch))
        return real_run(self, batch, *a, **kw)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(type(llm), "_run", counted_run)
        limited = llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True),
                                  concurrency_limit=1)
    assert seqs(limited) == vllm_form and runs == [1, 1]
    # vLLM's positional form after the params: lora_request, use_tqdm, concurrency_limit.
    runs.clear()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(type(llm), "_run", counted_run)
        positional = llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True), None,
                                     False, 1)
    assert seqs(positional) == vllm_form and runs == [1, 1]
    with pytest.raises(TypeError, match="multiple values for argument 'use_tqdm'"):
        llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=5), None, False, use_tqdm=True)
    with pytest.raises(TypeError, match="at most 5 positional arguments"):
        llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=5), None, False, 1, 2)
    with pytest.raises(TypeError, match="unexpected keyword argument 'beams'"):
        llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=5), beams=2)
    with pytest.raises(ValueError, match="concurrency_limit must be in"):
        llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=5), concurrency_limit=0)
    assert all(len(o) == 3 for o in vllm_form)
    with pytest.raises(ValueError, match="temperature=0.7"):
        BeamSearchParams(beam_width=2, max_tokens=3, temperature=0.7)
    with pytest.raises(ValueError, match="include_stop_str_in_output"):
        BeamSearchParams(beam_width=2, max_tokens=3, include_stop_str_in_output=True)
    with pytest.raises(ValueError, match="max_tokens must be an int, got None"):
        llm.beam_search(prompts, beam_width=2)
    with pytest.raises(ValueError, match="not both"):
        llm.beam_search(prompts, BeamSearchParams(beam_width=2, max_tokens=3), max_tokens=4)
    with pytest.raises(ValueError, match="beam_width given twice"):
        llm.beam_search(prompts, 2, 3, beam_width=2)
    p = BeamSearchParams(beam_width=2, max_tokens=3)
    p.beam_width = 0  # assigned after construction: checked again when used
    with pytest.raises(ValueError, match="beam_width must be in"):
        llm.beam_search(prompts, p)
    assert_no_leak(llm)


def test_chat_without_template_is_value_error(tmp_path, llama_path):
    import shutil

    path = tmp_path / "m"
    shutil.copytree(llama_path, path)
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(cfg))
    for f in path.glob("chat_template.*"):
        f.unlink()
    llm = tiny_llm(path)
    with pytest.raises(ValueError, match="chat template"):
        llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)


def test_a_named_template_set_renders_the_entry_vllm_picks_in_its_content_format(tmp_path, llama_path):
    """A tokenizer's named set: "default", or "tool_use" with tools, or the one chat_template names;
    "auto" reads that entry, so one looping over content parts gets the user's text."""
    import shutil

    path = tmp_path / "m"
    shutil.copytree(llama_path, path)
    for f in path.glob("chat_template.*"):
        f.unlink()
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "default", "template": PARTS_TEMPLATE},
                            {"name": "tool_use", "template": "TOOLS" + PARTS_TEMPLATE},
                            {"name": "plain", "template": "{% for m in messages %}({{ m.content }}){% endfor %}"}]
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    llm = tiny_llm(path)
    conv = [{"role": "user", "content": "hello"}]
    params = SamplingParams(temperature=0.0, max_tokens=1)
    assert llm.chat(conv, params, use_tqdm=False)[0].prompt == "[user]hello"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert llm.chat(conv, params, use_tqdm=False, tools=tools)[0].prompt == "TOOLS[user]hello"
    assert llm.chat(conv, params, use_tqdm=False, chat_template="plain")[0].prompt == "(hello)"
    del cfg["chat_template"][0]
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="no default specified"):
        tiny_llm(path).chat(conv, params, use_tqdm=False)


def test_generate_priority_orders_admission_under_the_priority_policy(llama_path):
    """vLLM's ``generate(..., priority=[...])``: lower runs first; one sequence at a time, so the
    first-scheduled times follow the priorities, not the prompt order."""
    llm = tiny_llm(llama_path, scheduling_policy="priority", max_num_seqs=1)
    prompts = [[5, 6, 7], [8, 9, 10], [11, 12, 13]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False, priority=[2, 0, 1])
    order = sorted(range(3), key=lambda i: outs[i].metrics.scheduled_ts)
    assert order == [1, 2, 0], [o.metrics.scheduled_ts for o in outs]
    with pytest.raises(ValueError, match="priority: got 2 for 3 prompts"):
        llm.generate(prompts, use_tqdm=False, priority=[0, 1])


def test_priority_without_the_priority_policy_is_refused(llama_llm):
    with pytest.raises(ValueError, match=r"priority=3 needs scheduling_policy='priority'"):
        llama_llm.generate([[5, 6, 7]], use_tqdm=False, priority=[3])
    assert llama_llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False, priority=[0])[0].finished


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llama_llm, llama_path, hf_greedy):
    """vLLM's left truncation: the request runs on the last k prompt tokens (its output's
    ``prompt_token_ids``), exactly as if those had been the prompt; -1 means as many as leave
    max_tokens to generate (vLLM's renderer)."""
    prompt = [17, 99, 250, 3, 8, 77, 140, 200, 31, 64, 12]
    out = llama_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5, truncate_prompt_tokens=4),
                             use_tqdm=False)[0]
    assert out.prompt_token_ids == prompt[-4:]
    assert out.outputs[0].token_ids == hf_greedy(llama_path, prompt[-4:], 5)
    long_prompt = [5 + i % 300 for i in range(llama_llm.llm_engine.max_model_len + 10)]
    with pytest.raises(ValueError, match="max_model_len"):
        llama_llm.generate([long_prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    max_len = llama_llm.llm_engine.max_model_len
    for max_tokens, keep in ((1, max_len - 1), (7, max_len - 7), (None, max_len - 1), (10 * max_len, 1)):
        params = SamplingParams(max_tokens=max_tokens, truncate_prompt_tokens=-1, ignore_eos=True)
        out = llama_llm.generate([long_prompt], params, use_tqdm=False)[0]
        assert out.prompt_token_ids == long_prompt[-keep:]
        assert len(out.outputs[0].token_ids) == min(max_tokens or 1, max_len - keep)
    too_many = llama_llm.llm_engine.max_model_len + 1  # vLLM refuses a truncation longer than the context
    with pytest.raises(ValueError, match=rf"truncate_prompt_tokens={too_many} is greater than max_model_len"):
        llama_llm.generate([prompt], SamplingParams(max_tokens=1, truncate_prompt_tokens=too_many), use_tqdm=False)
    assert_no_leak(llama_llm)


def test_lora_request_none_is_accepted_everywhere_and_an_adapter_refused(llama_llm, llama_path):
    """vLLM's keyword: wrappers pass lora_request=None through every call."""
    import asyncio

    from ferrokv import AsyncLLM
    from ferrokv.engine import EngineArgs, LLMEngine

    params = SamplingParams(temperature=0.0, max_tokens=2)
    assert llama_llm.generate([5, 6, 7], params, use_tqdm=False, lora_request=None)[0].finished
    assert llama_llm.chat([{"role": "user", "content": "hi"}], params, use_tqdm=False, lora_request=None)[0].finished
    assert llama_llm.beam_search([[5, 6]], beam_width=2, max_tokens=2, lora_request=None)
    for call in (lambda: llama_llm.generate([5], params, use_tqdm=False, lora_request="adapter"),
                 lambda: llama_llm.chat([{"role": "user", "content": "hi"}], params, lora_request=object()),
                 lambda: llama_llm.beam_search([[5]], beam_width=2, max_tokens=2, lora_request="adapter")):
        with pytest.raises(ValueError, match="lora_request must be None: LoRA adapters are not supported"):
            call()
    engine = LLMEngine(EngineArgs(model=str(llama_path), device="cpu", max_model_len=32, num_kv_blocks=16))
    engine.add_request("a", {"prompt_token_ids": [5, 6]}, params, lora_request=None)
    with pytest.raises(ValueError, match="lora_request must be None"):
        engine.add_request("b", {"prompt_token_ids": [5, 6]}, params, lora_request="adapter")
    engine.abort_request("a")
    allm = AsyncLLM(str(llama_path), device="cpu", max_model_len=32, num_kv_blocks=16, disable_log_requests=True)
    try:
        async def main():
            ids = {"prompt_token_ids": [5, 6]}
            outs = [o async for o in allm.generate(ids, params, "x", lora_request=None)]
            with pytest.raises(ValueError, match="lora_request must be None"):
                _ = [o async for o in allm.generate(ids, params, "y", lora_request="adapter")]
            return outs

        assert asyncio.run(main())[-1].finished
    finally:
        allm.shutdown()
    assert_no_leak(llama_llm)


def test_engine_args_take_vllms_arguments_as_llm_does(llama_path):
    """``AsyncEngineArgs(...)``/``EngineArgs(...)``, as vLLM's servers build them, take what
    ``LLM(...)`` takes: vLLM-only arguments at neutral values are dropped
    (``enable_prefix_caching=None`` is the default), others are a ValueError naming them."""
    from ferrokv import AsyncLLM
    from ferrokv.engine_args import AsyncEngineArgs, EngineArgs
    vllm_kw = dict(served_model_name="my-model", disable_custom_all_reduce=True, distributed_executor_backend="mp",
                   data_parallel_size=1, enable_sleep_mode=False, enable_lora=False, async_scheduling=False,
                   compilation_config=None, enable_prefix_caching=None)
    for cls in (EngineArgs, AsyncEngineArgs):
        args = cls(model=str(llama_path), **vllm_kw)
        assert args.enable_prefix_caching is True and args.model == str(llama_path)
        with pytest.raises(ValueError, match="data_parallel_size=2 is not supported"):
            cls(model=str(llama_path), data_parallel_size=2)
        with pytest.raises(TypeError, match="bogus"):
            cls(model=str(llama_path), bogus=1)
    assert AsyncEngineArgs(enable_log_requests=True).enable_log_requests is True  # a field of its own
    allm = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_kwargs(llama_path), **vllm_kw))
    try:
        assert allm.stats()["num_blocks"] > 0
    finally:
        allm.shutdown()


def test_vllms_arguments_ferrokv_has_no_use_for_are_accepted_at_neutral_values(llama_path):
    """Scripts written for vLLM pass compilation, parallelism, LoRA... arguments: at values that
    mean what ferrokv does they are accepted (enable_prefix_caching=None is vLLM's default);
    any other is a ValueError naming it."""
    llm = tiny_llm(llama_path, compilation_config={"cudagraph_mode": "NONE"}, max_seq_len_to_capture=8192,
                   cpu_offload_gb=0, disable_custom_all_reduce=True, pipeline_parallel_size=1, data_parallel_size=1,
                   enable_lora=False, skip_tokenizer_init=False, task="generate", runner="auto",
                   disable_async_output_proc=True, async_scheduling=False, served_model_name="x",
                   distributed_executor_backend=None, enable_sleep_mode=False, mm_processor_kwargs=None,
                   enable_prefix_caching=None, limit_mm_per_prompt={"image": 0, "video": {"count": 0}}, hf_token=True,
                   speculative_config=None, kv_transfer_config={}, structured_outputs_config=None, max_lora_rank=16,
                   model_impl="auto", config_format="auto", worker_extension_cls="", override_pooler_config=None,
                   allowed_local_media_path="", logits_processors=None, code_revision=None,
                   disable_sliding_window=False, use_tqdm_on_load=False, calculate_kv_scales=False,
                   model_loader_extra_config=None, enable_expert_parallel=False, cuda_graph_sizes=[1, 2],
                   max_cudagraph_capture_size=64, long_prefill_token_threshold=0, max_num_partial_prefills=1,
                   max_long_partial_prefills=1, num_scheduler_steps=1, use_v2_block_manager=True,
                   worker_use_ray=False, max_num_seqs=None, block_size=None, tokenizer_mode="hf")
    assert llm.llm_engine.args.enable_prefix_caching is True
    defaults = EngineArgs()  # vLLM's None: the default
    assert (llm.llm_engine.args.max_num_seqs, llm.llm_engine.args.block_size) == (defaults.max_num_seqs,
                                                                                 defaults.block_size)
    assert llm.model_config is llm.llm_engine.model_config
    assert llm.get_tokenizer(lora_request=None) is llm.get_tokenizer()
    for pooling in (llm.encode, llm.embed, llm.classify, llm.score, llm.reward):
        for kind in (ValueError, NotImplementedError):  # vLLM's on a generative model; ferrokv's before
            with pytest.raises(kind, match="pooling models, which ferrokv does not serve"):
                pooling(["a"])
    assert llm.generate([], use_tqdm=False) == []  # vLLM's: nothing to do
    assert llm.beam_search([], BeamSearchParams(beam_width=2, max_tokens=3)) == []
    with pytest.raises(ValueError, match="priority must be a list with one int per prompt"):
        llm.generate(["a"], priority=1, use_tqdm=False)
    with pytest.raises(ValueError, match="reset_running_requests"):
        llm.reset_prefix_cache(reset_running_requests=True)
    assert llm.reset_prefix_cache(reset_connector=False) is True and llm.reset_mm_cache() is None
    with pytest.raises(ValueError, match="reset_connector"):
        llm.reset_prefix_cache(reset_connector=True)
    # What ferrokv has none of is refused by name, never an AttributeError.
    for call, name in [(llm.sleep, "sleep"), (llm.wake_up, "wake_up"), (llm.start_profile, "profile"),
                       (llm.stop_profile, "profile"), (lambda: llm.collective_rpc("m"), "collective_rpc"),
                       (lambda: llm.apply_model(len), "apply_model")]:
        with pytest.raises(NotImplementedError, match=name):
            call()
    for kw in ({"pipeline_parallel_size": 2}, {"enable_lora": True}, {"cpu_offload_gb": 4}, {"task": "embed"},
               {"speculative_config": {"method": "ngram"}}, {"model_impl": "transformers"},
               {"logits_processors": ["my.Processor"]}, {"limit_mm_per_prompt": {"image": {"count": 1}}},
               {"pipeline_parallel_size": np.array([1, 2])}, {"disable_sliding_window": True},
               {"num_scheduler_steps": 8}, {"code_revision": "main"}, {"calculate_kv_scales": True}):  # a value the check cannot read is named too
        with pytest.raises(ValueError, match=f"{next(iter(kw))}=.* is not supported"):
            tiny_llm(llama_path, **kw)


def test_vllms_public_names_import_from_where_vllm_has_them():
    import ferrokv
    from ferrokv import AsyncLLM, AsyncLLMEngine, PromptType, TextPrompt, TokensPrompt
    from ferrokv.inputs import TextPrompt as InputsTextPrompt
    from ferrokv.sampling_params import BeamSearchParams as SPBeam, RequestOutputKind, StructuredOutputsParams

    assert AsyncLLMEngine is AsyncLLM and InputsTextPrompt is TextPrompt and SPBeam is BeamSearchParams
    assert RequestOutputKind is ferrokv.RequestOutputKind and StructuredOutputsParams is ferrokv.StructuredOutputsParams
    assert TokensPrompt(prompt_token_ids=[1, 2]) == {"prompt_token_ids": [1, 2]} and PromptType is not None
    assert TextPrompt.__required_keys__ == {"prompt"} and TokensPrompt.__required_keys__ == {"prompt_token_ids"}


def test_generate_takes_vllms_tokenization_kwargs(bos_model_dir):
    """``tokenization_kwargs={"add_special_tokens": False}`` tokenizes text prompts without the
    tokenizer's own BOS; other keys are refused naming them; chat checks them too."""
    llm = tiny_llm(bos_model_dir)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    plain = llm.get_tokenizer()("the cat", add_special_tokens=False)["input_ids"]
    with_bos, without = (llm.generate(["the cat"], params, use_tqdm=False, tokenization_kwargs=kw)[0]
                         for kw in (None, {"add_special_tokens": False}))
    assert (with_bos.prompt_token_ids, without.prompt_token_ids) == ([1, *plain], plain)
    assert without.prompt == "the cat"
    with pytest.raises(ValueError, match="tokenization_kwargs\\['truncation'\\] is not supported"):
        llm.generate(["a"], params, use_tqdm=False, tokenization_kwargs={"truncation": True})
    with pytest.raises(ValueError, match="mm_processor_kwargs"):
        llm.chat([{"role": "user", "content": "hi"}], params, use_tqdm=False, mm_processor_kwargs={"x": 1})
    # truncate_prompt_tokens (where vLLM now takes it) keeps each prompt's last tokens, over the
    # params' own, as the tokenizer truncates (vLLM's): a text keeps the BOS it gets; chat's too.
    long = "the cat sat on the mat and the dog ran"
    ids = llm.get_tokenizer()(long, add_special_tokens=False)["input_ids"]
    for kw, kept in (({}, [1, *ids[-2:]]), ({"add_special_tokens": False}, ids[-3:])):
        cut = llm.generate([long], SamplingParams(temperature=0.0, max_tokens=2, truncate_prompt_tokens=6),
                           use_tqdm=False, tokenization_kwargs={"truncate_prompt_tokens": 3, **kw})[0]
        assert cut.prompt_token_ids == kept
    assert llm.generate([{"prompt_token_ids": [1, *ids]}], SamplingParams(max_tokens=1, truncate_prompt_tokens=3),
                        use_tqdm=False)[0].prompt_token_ids == ids[-3:]  # ids given are only cut
    conv = [{"role": "user", "content": long}]
    chat_ids = llm.chat(conv, params, use_tqdm=False)[0].prompt_token_ids
    assert llm.chat(conv, params, use_tqdm=False, tokenization_kwargs={"truncate_prompt_tokens": 4})[0] \
        .prompt_token_ids == chat_ids[-4:]
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.generate([long], params, use_tqdm=False, tokenization_kwargs={"truncate_prompt_tokens": 0})
    for junk, match in ((5, "tokenization_kwargs must be a dict, got 5"), ("abc", "must be a dict"),
                        ({"add_special_tokens": 1}, r"\['add_special_tokens'\] must be a bool, got 1")):
        with pytest.raises(ValueError, match=match):
            llm.generate([long], params, use_tqdm=False, tokenization_kwargs=junk)
    # LLMEngine.add_request takes them too (and vLLM's arrival_time, trace_headers).
    engine = llm.llm_engine
    engine.add_request("e", "the cat", params, tokenization_kwargs={"add_special_tokens": False},
                       arrival_time=123.0, trace_headers={"traceparent": "x"})
    with pytest.raises(ValueError, match="tokenization_kwargs\\['truncation'\\] is not supported"):
        engine.add_request("f", "the cat", params, tokenization_kwargs={"truncation": True})
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [(o.request_id, o.prompt, o.prompt_token_ids) for o in outs] == [("e", "the cat", plain)]
    assert_no_leak(llm)


@pytest.mark.parametrize("max_tokens", [1, 3])
def test_a_beam_wider_than_the_vocabulary_returns_real_sequences_only(tiny_model_dir, max_tokens):
    """With fewer candidate tokens than beams, the padded beams (scored -1e9, as transformers
    starts) never become hypotheses: every sequence returned is distinct and really scored."""
    from ferrokv import BeamSearchParams

    llm = LLM(str(tiny_model_dir("llama-vocab6", vocab_size=6, seed=3)), device="cpu", dtype="float32",
              max_model_len=64, block_size=4, num_kv_blocks=256, max_num_seqs=64)
    out = llm.beam_search([{"prompt_token_ids": [1, 2, 3]}],
                          BeamSearchParams(beam_width=8, max_tokens=max_tokens, ignore_eos=True))[0]
    tokens = [tuple(s.tokens) for s in out.sequences]
    assert len(tokens) == len(set(tokens)) and 0 < len(tokens) <= 8
    assert all(s.cum_logprob > -1e8 for s in out.sequences), [s.cum_logprob for s in out.sequences]
    if max_tokens == 1:
        assert len(tokens) == 6  # one per token of the vocabulary
    assert_no_leak(llm)


def test_request_ids_and_tasks_are_vllms(llama_path):
    """vLLM's LLM numbers its requests from "0" and tells its supported tasks."""
    llm = tiny_llm(llama_path, num_kv_blocks=16)
    outs = llm.generate(["a b", "c d"], SamplingParams(max_tokens=1), use_tqdm=False)
    assert [o.request_id for o in outs] == ["0", "1"]
    assert llm.supported_tasks == llm.llm_engine.get_supported_tasks() == ("generate",)
