"""The embedded demo model: its files load in transformers, it answers its tasks, jaxllm agrees.

transformers (PyTorch, float32, greedy) is the oracle: the shipped checkpoint must answer
>= 95% of held-out prompts of each task exactly there, as a chat turn and as a raw completion
(demo_tasks' two formats), and jaxllm's default `LLM()` must produce the very same tokens.
"""

from __future__ import annotations

import os

import pytest

from jaxllm import demo_tasks
from jaxllm.config import default_model_path
from tests.own_process import isolated, run_in_own_process

N_PROMPTS = 100  # held-out prompts per task
MAX_TOKENS = 32  # the longest answer (counting to 999) is 21 tokens with its eos
MIN_ACCURACY = 0.95
FORMATS = ("chat", "raw")
FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json")


@pytest.fixture(scope="module")
def model_dir() -> str:
    return default_model_path()


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[str]]:
    return {t: demo_tasks.heldout_prompts(t, N_PROMPTS, seed=0) for t in demo_tasks.TASKS}


@pytest.fixture(scope="module")
def hf(model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model, info = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, output_loading_info=True)
    return tokenizer, model.eval(), info


def _hf_generate(hf, texts: list[str]) -> list[list[int]]:
    """transformers' greedy answer tokens after each text, up to and including the eos."""
    import torch

    tokenizer, model, _ = hf
    eos = tokenizer.eos_token_id
    tokenizer.padding_side = "left"
    enc = tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, do_sample=False, max_new_tokens=MAX_TOKENS,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=eos)
    rows = out[:, enc["input_ids"].shape[1]:].tolist()
    return [r[: r.index(eos) + 1] if eos in r else r for r in rows]


@pytest.fixture(scope="module")
def hf_greedy(hf, prompts) -> dict[str, list[list[int]]]:
    """transformers' greedy answer tokens per chat prompt, up to and including the eos."""
    tokenizer, _, _ = hf
    return {task: _hf_generate(hf, [tokenizer.apply_chat_template(
        demo_tasks.chat(p), add_generation_prompt=True, tokenize=False) for p in ps])
        for task, ps in prompts.items()}


@pytest.fixture(scope="module")
def hf_greedy_raw(hf, prompts) -> dict[str, list[list[int]]]:
    """transformers' greedy answer tokens per raw prompt (`<s>` + prompt, as a plain
    completion tokenizes it), up to and including the eos."""
    tokenizer, _, _ = hf
    return {task: _hf_generate(hf, [tokenizer.bos_token + p for p in ps])
            for task, ps in prompts.items()}


def _accuracy(prompts: list[str], answers: list[str]) -> float:
    right = sum(a == demo_tasks.expected_answer(p) for p, a in zip(prompts, answers, strict=True))
    return right / len(prompts)


def test_checkpoint_files_exist_and_stay_under_5_mb(model_dir):
    for name in FILES:
        assert os.path.isfile(os.path.join(model_dir, name)), name
    total = sum(os.path.getsize(os.path.join(model_dir, f)) for f in os.listdir(model_dir))
    assert total < 5 * 10**6, f"demo model is {total} bytes"


def test_transformers_loads_checkpoint_with_every_weight(hf):
    tokenizer, model, info = hf
    assert model.config.architectures == ["LlamaForCausalLM"]
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    special = (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token)
    assert special == ("<s>", "</s>", "<pad>")
    eos = tokenizer.eos_token_id
    assert model.config.eos_token_id == model.generation_config.eos_token_id == eos


def test_chat_template_renders_the_training_format(hf):
    tokenizer, _, _ = hf
    conv = demo_tasks.chat("reverse abc")
    text = tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    assert text == "<s><|user|>reverse abc</s><|assistant|>"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.decode(tokenizer(" cba</s>", add_special_tokens=False).input_ids,
                            skip_special_tokens=True) == " cba"


@isolated
def test_transformers_greedy_answers_heldout_prompts(hf, prompts, hf_greedy):
    tokenizer, _, _ = hf
    for task, ps in prompts.items():
        answers = [tokenizer.decode(t, skip_special_tokens=True) for t in hf_greedy[task]]
        acc = _accuracy(ps, answers)
        assert acc >= MIN_ACCURACY, f"{task}: {acc:.2f}"


@isolated
def test_transformers_greedy_answers_heldout_raw_prompts_after_the_marker(hf, prompts,
                                                                         hf_greedy_raw):
    tokenizer, _, _ = hf
    marker = tokenizer.convert_tokens_to_ids(demo_tasks.RAW_ANSWER_MARKER)
    assert tokenizer.decode([marker], skip_special_tokens=True) == ""  # a special token
    for task, ps in prompts.items():
        gens = hf_greedy_raw[task]
        assert sum(g[:1] == [marker] for g in gens) >= MIN_ACCURACY * len(ps), task
        acc = _accuracy(ps, [tokenizer.decode(t, skip_special_tokens=True) for t in gens])
        assert acc >= MIN_ACCURACY, f"{task}: {acc:.2f}"


@pytest.mark.slow
def test_jaxllm_answers_in_a_process_compiled_at_xlas_default_optimization():
    """This file's greedy-answer tests (marked `isolated`): the engine serves
    hundreds of answers, whose programs run several times slower under the suite's cheap
    LLVM pipeline (tests/own_process.py), so they run together in a process of their
    own at XLA's default optimization, where transformers' answers are made once."""
    run_in_own_process(__file__, "-m", "own_process", optimized=True)


@pytest.fixture(scope="module")
def llm():
    from jaxllm import LLM

    return LLM()  # no model named: the embedded demo model


@isolated
def test_jaxllm_chat_greedy_equals_transformers_and_answers(llm, prompts, hf_greedy):
    from jaxllm import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    for task, ps in prompts.items():
        outs = llm.chat([demo_tasks.chat(p) for p in ps], greedy, use_tqdm=False)
        for p, out, ref in zip(ps, outs, hf_greedy[task], strict=True):
            assert list(out.outputs[0].token_ids) == ref, p
        acc = _accuracy(ps, [o.outputs[0].text for o in outs])
        assert acc >= MIN_ACCURACY, f"{task}: {acc:.2f}"


@isolated
def test_jaxllm_generate_raw_prompts_equals_transformers_and_answers(llm, prompts,
                                                                     hf_greedy_raw):
    from jaxllm import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    for task, ps in prompts.items():
        outs = llm.generate(ps, greedy, use_tqdm=False)
        for p, out, ref in zip(ps, outs, hf_greedy_raw[task], strict=True):
            assert list(out.outputs[0].token_ids) == ref, p
        acc = _accuracy(ps, [o.outputs[0].text for o in outs])
        assert acc >= MIN_ACCURACY, f"{task}: {acc:.2f}"


@isolated
def test_jaxllm_generate_from_chat_token_ids_equals_transformers(llm, hf, prompts, hf_greedy):
    from jaxllm import SamplingParams

    tokenizer, _, _ = hf
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    few = {t: ps[:10] for t, ps in prompts.items()}
    batch = [p for ps in few.values() for p in ps]
    ids = [tokenizer(tokenizer.apply_chat_template(demo_tasks.chat(p), add_generation_prompt=True,
                                                   tokenize=False),
                     add_special_tokens=False).input_ids for p in batch]
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], greedy, use_tqdm=False)
    refs = [r for t in few for r in hf_greedy[t][:10]]
    for p, out, ref in zip(batch, outs, refs, strict=True):
        assert list(out.outputs[0].token_ids) == ref, p


@isolated
def test_jaxllm_serve_answers_heldout_prompts_over_http(prompts, hf, hf_greedy, hf_greedy_raw):
    """`jaxllm serve` with no model: the demo model answers through the OpenAI chat API, and
    raw prompts through the completions API."""
    import asyncio

    import openai

    from tests.entrypoints.server import RemoteServer

    tokenizer, _, _ = hf
    config = os.path.join(os.path.dirname(__file__), "..", "configs", "server-demo.yaml")
    srv = RemoteServer(["--config", config, "--dtype", "float32"])
    try:
        client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        limit = asyncio.Semaphore(16)

        async def ask(prompt: str) -> str:
            async with limit:
                r = await client.chat.completions.create(
                    model="demo", messages=demo_tasks.chat(prompt), temperature=0.0,
                    max_tokens=MAX_TOKENS)
            return r.choices[0].message.content

        async def ask_all() -> dict[str, list[str]]:
            answers = await asyncio.gather(*(ask(p) for ps in prompts.values() for p in ps))
            await client.close()
            return {t: answers[i * N_PROMPTS:(i + 1) * N_PROMPTS]
                    for i, t in enumerate(prompts)}

        answers = asyncio.run(ask_all())
        raw_client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        raw = {t: [c.text for c in sorted(raw_client.completions.create(
            model="demo", prompt=ps[:10], temperature=0.0, max_tokens=MAX_TOKENS).choices,
            key=lambda c: c.index)] for t, ps in prompts.items()}
    finally:
        srv.stop()
    for task, ps in prompts.items():
        assert len(ps) == N_PROMPTS
        refs = [tokenizer.decode(t, skip_special_tokens=True) for t in hf_greedy[task]]
        assert answers[task] == refs, task
        acc = _accuracy(ps, answers[task])
        assert acc >= MIN_ACCURACY, f"{task}: {acc:.2f}"
        raw_refs = [tokenizer.decode(t, skip_special_tokens=True) for t in hf_greedy_raw[task]]
        assert raw[task] == raw_refs[:10], task
