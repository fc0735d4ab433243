"""`LLM.chat(messages, tools=...)` renders the tools (and the tool-call history) in the
chat template, as vLLM's LLM.chat does."""

from __future__ import annotations

import json

import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.errors import ParameterError
from tests.models.tiny_checkpoints import make_tiny_checkpoint, make_tiny_tokenizer
from tests.tools.templates import TOOL_CHAT_TEMPLATE

pytestmark = pytest.mark.slow  # an engine starts here

TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer"}}}}}
HISTORY = [{"role": "user", "content": "time?"},
           {"role": "assistant", "content": "", "tool_calls": [
               {"id": "c1", "type": "function",
                "function": {"name": "get_time", "arguments": '{"zone": 1}'}}]},
           {"role": "tool", "tool_call_id": "c1", "content": "noon"}]


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    model = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), arch="llama",
                                 max_position_embeddings=512)
    return LLM(model, dtype="float32", max_model_len=512, max_num_seqs=2, block_size=8,
               token_buckets=[16, 64], request_buckets=[2], max_num_batched_tokens=64)


def test_llm_chat_renders_the_tools_and_the_tool_call_history(llm):
    (out,) = llm.chat(HISTORY, SamplingParams(max_tokens=1), use_tqdm=False,
                      chat_template=TOOL_CHAT_TEMPLATE, tools=[TOOL])
    want = make_tiny_tokenizer().apply_chat_template(
        [HISTORY[0], {**HISTORY[1], "tool_calls": [{**HISTORY[1]["tool_calls"][0], "function": {
            "name": "get_time", "arguments": {"zone": 1}}}]}, HISTORY[2]],
        chat_template=TOOL_CHAT_TEMPLATE, tools=[TOOL], tokenize=False,
        add_generation_prompt=True)
    assert out.prompt == want
    assert json.dumps(TOOL) in out.prompt and "<|tool|>c1=noon" in out.prompt
    (plain,) = llm.chat(HISTORY[:1], SamplingParams(max_tokens=1), use_tqdm=False,
                        chat_template=TOOL_CHAT_TEMPLATE)
    assert "tools:" not in plain.prompt


def test_llm_chat_rejects_a_malformed_tool_naming_the_field(llm):
    with pytest.raises(ParameterError) as e:
        llm.chat(HISTORY[:1], use_tqdm=False, chat_template=TOOL_CHAT_TEMPLATE,
                 tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}])
    assert e.value.field == "tools[0].function.parameters"
