"""`jaxllm generate` and `jaxllm chat` through the CLI's main(), in-process."""

from __future__ import annotations

import json
import os

import pytest

from jaxllm import demo_tasks
from jaxllm.entrypoints.cli import main
from tests.models.tiny_checkpoints import make_tiny_checkpoint

# Small engine: few buckets, short context, so each engine starts in seconds on the CPU.
ENGINE = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64, block_size=8,
              token_buckets=[16, 64], request_buckets=[4])
ENGINE_FLAGS = ["--max-model-len", "64", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
                "--block-size", "8", "--token-buckets", "16,64", "--request-buckets", "4"]
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory) -> str:
    """A tiny float32 Llama whose tokenizer has no chat template."""
    model = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), arch="llama")
    os.remove(os.path.join(model, "chat_template.jinja"))
    with open(os.path.join(model, "tokenizer_config.json")) as f:
        assert "chat_template" not in json.load(f)
    return model


@pytest.fixture(scope="module")
def reference(plain_model):
    """The offline API on the same checkpoint and engine settings as the CLI runs."""
    from jaxllm import LLM, SamplingParams

    llm = LLM(plain_model, dtype="float32", **ENGINE)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)

    def texts(prompts: list[str]) -> list[str]:
        return [o.outputs[0].text for o in llm.generate(prompts, greedy, use_tqdm=False)]

    return texts


def _generate(capsys, *args: str) -> tuple[int, list[dict], str]:
    """Runs `jaxllm generate --json ARGS`: exit code, one dict per completion, stderr."""
    rc = main(["generate", "--json", *ENGINE_FLAGS, *args])
    out, err = capsys.readouterr()
    return rc, [json.loads(line) for line in out.splitlines() if line.strip()], err


@pytest.mark.slow
def test_generate_without_model_answers_with_the_demo_model_in_its_chat_template(
        capsys, monkeypatch):
    from jaxllm.entrypoints.llm import LLM

    conversations, chat = [], LLM.chat

    def recording_chat(self, messages, *args, **kwargs):
        conversations.extend(messages)
        return chat(self, messages, *args, **kwargs)

    monkeypatch.setattr(LLM, "chat", recording_chat)
    rc, outs, _ = _generate(capsys, "reverse hello", "--max-tokens", "8")
    assert rc == 0
    # The demo model answers raw prompts too, so the answer alone cannot show the
    # template: the prompt went through LLM.chat, which renders it.
    assert conversations == [[{"role": "user", "content": "reverse hello"}]]
    assert outs == [{"prompt": "reverse hello", "text": demo_tasks.expected_answer("reverse hello"),
                     "finish_reason": "stop"}]


@pytest.mark.slow
def test_generate_on_a_model_without_chat_template_prints_the_offline_api_completion(
        capsys, plain_model, reference):
    rc, outs, err = _generate(capsys, "--model", plain_model, "--dtype", "float32",
                              "--max-tokens", str(MAX_TOKENS), "hello")
    assert rc == 0, err
    (expected,) = reference(["hello"])
    assert expected  # a random model could stop at once; then this test would prove nothing
    assert outs == [{"prompt": "hello", "text": expected, "finish_reason": "length"}]


@pytest.mark.slow
def test_generate_reads_prompts_file_one_per_line_skipping_blank_lines(
        capsys, tmp_path, plain_model, reference):
    path = tmp_path / "prompts.txt"
    path.write_text("hello\n\nabc\n")
    rc, outs, err = _generate(capsys, "--model", plain_model, "--dtype", "float32",
                              "--max-tokens", str(MAX_TOKENS), "--prompts-file", str(path))
    assert rc == 0, err
    assert [o["prompt"] for o in outs] == ["hello", "abc"]
    assert [o["text"] for o in outs] == reference(["hello", "abc"])


def test_generate_with_explicit_chat_on_a_model_without_template_is_a_one_line_error(
        capsys, plain_model):
    rc, outs, err = _generate(capsys, "--model", plain_model, "--dtype", "float32",
                              "--max-tokens", "2", "--chat", "hello")
    assert rc == 2 and outs == []
    assert "jaxllm generate: error: chat: the model's tokenizer has no chat template" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("args, message", [
    (["--model", "/nonexistent/model-dir", "hello"], "error: model: no model directory at"),
    (["--max-tokens", "0", "hello"], "error: max_tokens: must be at least 1, got 0"),
    ([], "error: prompts: give prompts as arguments or --prompts-file"),
    (["--prompts-file", "/nonexistent/prompts.txt"], "error: prompts_file: cannot read"),
    (["--token-buckets", "16", "--max-num-batched-tokens", "64", "hello"],
     "error: token_buckets: the largest (16) must cover max_num_batched_tokens=64"),
])
def test_generate_bad_input_exits_2_with_one_line_naming_the_field(capsys, args, message):
    rc, outs, err = _generate(capsys, *args)
    assert rc == 2 and outs == []
    assert f"jaxllm generate: {message}" in err
    assert "Traceback" not in err


def test_chat_with_unknown_model_dir_exits_2_with_one_line_naming_the_field(capsys):
    rc = main(["chat", "--model", "/nonexistent/model-dir"])
    _, err = capsys.readouterr()
    assert rc == 2
    assert "jaxllm chat: error: model: no model directory at '/nonexistent/model-dir'" in err
    assert "Traceback" not in err


def test_chat_on_a_model_without_template_exits_2_before_reading_input(
        capsys, monkeypatch, plain_model):
    def no_input(_prompt: str) -> str:
        raise AssertionError("chat read input from a model it cannot chat with")

    monkeypatch.setattr("builtins.input", no_input)
    rc = main(["chat", "--model", plain_model, "--dtype", "float32", *ENGINE_FLAGS])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert "jaxllm chat: error: model: its tokenizer has no chat template" in err
