"""--reasoning-parser over HTTP with the official openai client, on a tiny random model:
`message.reasoning` (and `reasoning_content`) split from `content` as the whole-output
split says, streamed deltas that assemble to the same, `include_reasoning`, tool calls
read from the answer only, and a grammar that waits until the reasoning has ended.

The chat template opens the block (`enable_thinking: true`) or closes it (`false`), as
Qwen3's does; a `structured_outputs` regex steers the model to a known output where
the block is closed.
"""

from __future__ import annotations

import re

import openai
import pytest

from jaxllm.reasoning import REASONING_PARSERS, split_reasoning
from tests.entrypoints.server import TINY_ENGINE_FLAGS, RemoteServer
from tests.models.tiny_checkpoints import make_tiny_checkpoint, make_tiny_tokenizer
from tests.tools.test_openai_tools import WEATHER

pytestmark = pytest.mark.slow  # a server for the module

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Is it warm?"}]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined %}"
    "{% if enable_thinking %}<think>\n{% else %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}{% endif %}")
OPEN, CLOSED = {"enable_thinking": True}, {"enable_thinking": False}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reasoning")
    model = make_tiny_checkpoint(tmp, arch="llama", max_position_embeddings=512)
    template = tmp / "thinking.jinja"
    template.write_text(TEMPLATE)
    srv = RemoteServer([model, *TINY_ENGINE_FLAGS, "--max-model-len", "512",
                        "--max-num-seqs", "4", "--request-buckets", "4",
                        "--served-model-name", MODEL, "--chat-template", str(template),
                        "--reasoning-parser", "qwen3", "--enable-auto-tool-choice",
                        "--tool-call-parser", "hermes"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)


def whole(client, thinking: dict, **kw):
    body = {"chat_template_kwargs": thinking, **kw.pop("extra_body", {})}
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0,
                                          extra_body=body, **kw)
    return resp.choices[0]


def streamed(client, thinking: dict, **kw) -> tuple[str | None, str | None, list, str]:
    """(reasoning, content, [(name, arguments)], finish_reason) from the deltas; checks
    that no reasoning comes after content."""
    body = {"chat_template_kwargs": thinking, **kw.pop("extra_body", {})}
    reasoning, content, calls, finish, order = [], [], {}, None, []
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0,
                                                stream=True, extra_body=body, **kw):
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            if delta.get("reasoning"):
                assert delta["reasoning_content"] == delta["reasoning"]
                reasoning.append(delta["reasoning"])
                order.append("r")
            if delta.get("content"):
                content.append(delta["content"])
                order.append("c")
            for tc in choice.delta.tool_calls or []:
                name, args = calls.get(tc.index, ("", ""))
                calls[tc.index] = (name + (tc.function.name or ""),
                                   args + (tc.function.arguments or ""))
            finish = choice.finish_reason or finish
    assert "".join(order) == "".join(sorted(order, key="rc".index))
    return ("".join(reasoning) or None, "".join(content) or None,
            [calls[i] for i in sorted(calls)], finish)


def _message(choice) -> tuple[str | None, str | None]:
    msg = choice.message.model_dump()
    assert msg.get("reasoning_content") == msg.get("reasoning")
    return msg.get("reasoning"), msg["content"]


def test_a_steered_thought_and_answer_split_whole_and_streamed(client):
    steer = {"structured_outputs": {"regex": re.escape("<think>abc</think>wxyz")}}
    choice = whole(client, CLOSED, max_tokens=40, extra_body=steer)
    assert _message(choice) == ("abc", "wxyz")
    assert streamed(client, CLOSED, max_tokens=40, extra_body=steer) == (
        "abc", "wxyz", [], "stop")
    hidden = whole(client, CLOSED, max_tokens=40, extra_body={**steer,
                                                             "include_reasoning": False})
    assert _message(hidden) == (None, "wxyz")


def test_an_open_block_makes_the_output_reasoning_as_the_whole_split_says(client):
    prompt = make_tiny_tokenizer().apply_chat_template(
        MESSAGES, chat_template=TEMPLATE, add_generation_prompt=True, tokenize=False,
        enable_thinking=True)
    raw = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=24,
                                    extra_body={"add_special_tokens": False}).choices[0].text
    want = split_reasoning(REASONING_PARSERS["qwen3"], prompt, raw)
    assert want[0]  # the model's output is thought
    assert _message(whole(client, OPEN, max_tokens=24)) == want
    assert streamed(client, OPEN, max_tokens=24)[:2] == want
    # A grammar waits until the reasoning has ended: here it never does, so the output
    # is the unconstrained one; with the block closed it holds from the first token.
    regex = {"structured_outputs": {"regex": "ab"}}
    assert _message(whole(client, OPEN, max_tokens=24, extra_body=regex)) == want
    assert _message(whole(client, CLOSED, max_tokens=24, extra_body=regex)) == (None, "ab")


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_are_read_from_the_answer_after_the_reasoning(client, stream):
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}'
    steer = {"structured_outputs": {"regex": re.escape(
        f"<think>cold?</think>{call}</tool_call>")}}
    want_call = [("get_weather", '{"city": "Oslo", "unit": "c"}')]
    if stream:
        assert streamed(client, CLOSED, max_tokens=200, tools=[WEATHER],
                        extra_body=steer) == ("cold?", None, want_call, "tool_calls")
        return
    choice = whole(client, CLOSED, max_tokens=200, tools=[WEATHER], extra_body=steer)
    assert _message(choice)[0] == "cold?"
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == \
        want_call
    assert choice.finish_reason == "tool_calls"
