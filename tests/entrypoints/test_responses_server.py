"""/v1/responses over HTTP with the official openai client, on a tiny random model.

The oracle is the chat endpoint of the same server: a greedy response equals the chat
completion of the messages it stands for (instructions as a system message, earlier
function calls and their outputs, a previous response's turns), in text, tokens and
logprobs; its stream assembles to the same. Named and required tool choices give
function_call items with arguments valid for the tool's schema, and a json_schema
text format valid JSON. Kept responses continue a conversation and can be fetched
and deleted; bad fields are a 400 naming them.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.entrypoints.server import TINY_ENGINE_FLAGS, RemoteServer
from tests.models.tiny_checkpoints import make_tiny_checkpoint
from tests.tools.templates import TOOL_CHAT_TEMPLATE
from tests.tools.test_openai_tools import WEATHER

pytestmark = pytest.mark.slow  # a server for the module

MODEL = "tiny"
TOOL = {"type": "function", **WEATHER["function"]}  # the Responses tool shape: flat
PARAMS = WEATHER["function"]["parameters"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("responses")
    model = make_tiny_checkpoint(tmp, arch="llama", max_position_embeddings=1024)
    template = tmp / "tools.jinja"
    template.write_text(TOOL_CHAT_TEMPLATE)
    srv = RemoteServer([model, *TINY_ENGINE_FLAGS, "--max-model-len", "1024",
                        "--max-num-seqs", "4", "--request-buckets", "4",
                        "--served-model-name", MODEL, "--chat-template", str(template),
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                        "--responses-store-size", "8"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)


def chat(client, messages, n_tokens: int = 12, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                          max_tokens=n_tokens, **kw)


def respond(client, n_tokens: int = 12, **kw):
    return client.responses.create(model=MODEL, temperature=0, max_output_tokens=n_tokens,
                                   **kw)


def streamed(client, n_tokens: int = 12, **kw) -> tuple[list, dict]:
    events = list(client.responses.create(model=MODEL, temperature=0, stream=True,
                                          max_output_tokens=n_tokens, **kw))
    return events, events[-1].response


def test_a_response_is_the_chat_completion_of_its_input(client):
    resp = respond(client, input="Hello there", instructions="Answer briefly.")
    want = chat(client, [{"role": "system", "content": "Answer briefly."},
                         {"role": "user", "content": "Hello there"}])
    assert resp.id.startswith("resp_") and resp.object == "response"
    assert resp.output_text == want.choices[0].message.content
    assert want.choices[0].finish_reason == "length"
    assert resp.status == "incomplete"
    assert resp.incomplete_details.reason == "max_output_tokens"
    (item,) = resp.output
    assert item.type == "message" and item.role == "assistant"
    assert resp.usage.input_tokens == want.usage.prompt_tokens
    assert resp.usage.output_tokens == want.usage.completion_tokens == 12
    assert resp.usage.total_tokens == want.usage.total_tokens
    assert resp.instructions == "Answer briefly." and resp.max_output_tokens == 12


def test_the_stream_assembles_to_the_whole_response(client):
    whole = respond(client, input="Tell me more")
    events, final = streamed(client, input="Tell me more")
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == final.output_text
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert done.text == text
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_logprobs_are_the_chat_endpoints(client):
    resp = respond(client, input="Count", include=["message.output_text.logprobs"],
                   top_logprobs=3)
    want = chat(client, [{"role": "user", "content": "Count"}], logprobs=True, top_logprobs=3)
    got = resp.output[0].content[0].logprobs
    expected = want.choices[0].logprobs.content
    assert [g.token for g in got] == [e.token for e in expected]
    assert [g.logprob for g in got] == pytest.approx([e.logprob for e in expected], abs=1e-5)
    assert all(len(g.top_logprobs) == 3 for g in got)


def test_a_previous_response_continues_its_conversation(client, server):
    first = respond(client, input="First question")
    second = respond(client, input="And then?", previous_response_id=first.id)
    want = chat(client, [{"role": "user", "content": "First question"},
                         {"role": "assistant", "content": first.output_text},
                         {"role": "user", "content": "And then?"}])
    assert second.output_text == want.choices[0].message.content
    assert second.previous_response_id == first.id
    # Kept: fetched as it was sent, then deleted.
    fetched = httpx.get(f"{server.url}/v1/responses/{first.id}", timeout=30).json()
    assert fetched["id"] == first.id and fetched["output"][0]["content"][0]["text"] == \
        first.output_text
    gone = httpx.delete(f"{server.url}/v1/responses/{first.id}", timeout=30)
    assert gone.json() == {"id": first.id, "object": "response", "deleted": True}
    missing = httpx.get(f"{server.url}/v1/responses/{first.id}", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "response_id"
    with pytest.raises(openai.NotFoundError) as e:
        respond(client, input="x", previous_response_id=first.id)
    assert e.value.body["param"] == "previous_response_id"
    # store=false keeps nothing.
    unkept = respond(client, input="x", store=False)
    assert httpx.get(f"{server.url}/v1/responses/{unkept.id}", timeout=30).status_code == 404


def test_function_calls_and_their_outputs_are_rendered_as_chat_turns(client):
    args = json.dumps({"city": "Oslo", "unit": "c"})
    items = [{"role": "user", "content": "Weather?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": args},
             {"type": "function_call_output", "call_id": "call_1", "output": "4 degrees"}]
    resp = respond(client, input=items, tools=[TOOL], tool_choice="none")
    want = chat(client, [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "4 degrees"}],
        tools=[WEATHER], tool_choice="none")
    assert resp.output_text == want.choices[0].message.content
    assert resp.usage.input_tokens == want.usage.prompt_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_named_and_required_tool_choices_give_valid_function_calls(client, stream):
    for choice in ({"type": "function", "name": "get_weather"}, "required"):
        kw = dict(input="Weather?", tools=[TOOL], tool_choice=choice, n_tokens=200)
        if stream:
            events, final = streamed(client, **kw)
            deltas = "".join(e.delta for e in events
                             if e.type == "response.function_call_arguments.delta")
            calls = [i for i in final.output if i.type == "function_call"]
            assert deltas == "".join(c.arguments for c in calls)
        else:
            calls = [i for i in respond(client, **kw).output if i.type == "function_call"]
        assert calls, choice
        for call in calls:
            assert call.name == "get_weather" and call.call_id
            jsonschema.validate(json.loads(call.arguments), PARAMS)


def test_a_json_schema_text_format_constrains_the_output(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    resp = respond(client, input="Yes or no", n_tokens=40, text={"format": {
        "type": "json_schema", "name": "answer", "schema": schema, "strict": True}})
    assert resp.status == "completed"
    jsonschema.validate(json.loads(resp.output_text), schema)
    assert resp.text.format.type == "json_schema"


@pytest.mark.parametrize("body,param", [
    (dict(input="x", max_output_tokens=5000), "max_output_tokens"),
    (dict(input=[{"type": "function_call_output", "call_id": "c", "output": "x"}]),
     "input[0].call_id"),
    (dict(input=[{"type": "computer_call"}]), "input[0].type"),
    (dict(input="x", tools=[{"type": "function", "parameters": {}}]), "tools[0].name"),
    (dict(input="x", include=["file_search_call.results"]), "include[0]"),
    (dict(input="x", background=True), "background"),
    (dict(input="x", text={"format": {"type": "json_schema", "name": "n"}}), "text.format"),
    (dict(input="x", text={"format": {"type": "json_schema", "name": "n",
                                      "schema": {"type": "nonsense"}}}), "text.format.schema"),
])
def test_bad_fields_are_a_400_naming_them(server, body, param):
    r = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    # The server carries on.
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
