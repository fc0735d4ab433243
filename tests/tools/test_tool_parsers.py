"""The hermes and llama3_json parsers (and `required`'s), whole and streamed.

The one-shot results are vLLM's for the same text; streamed, the text comes in
random chunkings and the assembled content and calls must equal the one-shot
parse.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxllm.entrypoints.openai.json_prefix import dump_prefix
from jaxllm.entrypoints.openai.tool_parsers import (
    CallDelta,
    Extracted,
    ParsedCall,
    RequiredToolParser,
    StreamDelta,
    ToolStream,
    get_tool_parser,
)

WEATHER = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
TIME = {"name": "get_time", "arguments": {"zone": "CET", "nested": {"a": [1, 2.5, None]}}}


def call(obj: dict, key: str = "arguments") -> ParsedCall:
    return ParsedCall(obj["name"], json.dumps(obj[key], ensure_ascii=False))


def hermes_block(obj: dict) -> str:
    return f"<tool_call>\n{json.dumps(obj)}\n</tool_call>"


def assemble(steps: list[CallDelta]) -> list[ParsedCall]:
    """Calls from their streamed steps: each opens with its name, in index order."""
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    for step in steps:
        if step.name is not None:
            assert step.index == len(names) and not step.arguments
            names[step.index], args[step.index] = step.name, ""
        else:
            assert step.index in names and step.arguments
            args[step.index] += step.arguments
    return [ParsedCall(names[i], args[i]) for i in sorted(names)]


def calls_of(delta: StreamDelta) -> list[ParsedCall]:
    return assemble(delta.calls)


def streamed(parser_name: str, text: str, cuts: list[int]) -> Extracted:
    """The stream's assembled (calls, content) for `text` cut at `cuts`."""
    parser = RequiredToolParser() if parser_name == "required" else get_tool_parser(parser_name)
    stream = ToolStream(parser)
    content, steps = "", []
    bounds = [0, *sorted({c for c in cuts if 0 < c < len(text)}), len(text)]
    for a, b in zip(bounds, bounds[1:], strict=False):
        part = stream.feed(text[a:b])
        content += part.content
        steps += part.calls
    rest = stream.finish()
    return Extracted(assemble(steps + rest.calls), content + rest.content)


def one_shot(parser_name: str, text: str) -> Extracted:
    parser = RequiredToolParser() if parser_name == "required" else get_tool_parser(parser_name)
    return parser.extract(text)


HERMES_CASES = {
    "plain text": ("Hello <tool there", Extracted([], "Hello <tool there")),
    "one call": (hermes_block(WEATHER), Extracted([call(WEATHER)], None)),
    "text before the call": ("Let me check.\n" + hermes_block(WEATHER),
                             Extracted([call(WEATHER)], "Let me check.\n")),
    "several calls": (hermes_block(WEATHER) + "\n" + hermes_block(TIME),
                      Extracted([call(WEATHER), call(TIME)], None)),
    "unclosed last call": (hermes_block(WEATHER) + '<tool_call>{"name": "get_time", '
                           '"arguments": {}}', Extracted([call(WEATHER),
                                                          ParsedCall("get_time", "{}")], None)),
    "malformed JSON": ('Sure <tool_call>{"name": "get_weather", "arguments": {"city": }'
                       "</tool_call>", None),
    "unfinished JSON": ('<tool_call>{"name": "get_weather", "arguments": {"city": "Pa', None),
    "missing arguments": ('<tool_call>{"name": "get_weather"}</tool_call>', None),
    "non-string name": ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', None),
    "unicode kept": ('<tool_call>{"name": "f", "arguments": {"s": "\\u00e9t\\u00e9"}}'
                     "</tool_call>", Extracted([ParsedCall("f", '{"s": "été"}')], None)),
}

LLAMA_CASES = {
    "plain text": ("The weather is fine.", Extracted([], "The weather is fine.")),
    "one call": (json.dumps(WEATHER), Extracted([call(WEATHER)], None)),
    "python tag": ("<|python_tag|>" + json.dumps(WEATHER), Extracted([call(WEATHER)], None)),
    "parameters key": (json.dumps({"name": "get_time", "parameters": TIME["arguments"]}),
                       Extracted([call(TIME)], None)),
    "several calls": (json.dumps(WEATHER) + "; " + json.dumps(TIME),
                      Extracted([call(WEATHER), call(TIME)], None)),
    "malformed JSON": ('{"name": "get_weather", "arguments": {"city": Paris}}', None),
    "unfinished JSON": ('{"name": "get_weather", "arguments": {"city": "Pa', None),
    "missing name": ('{"arguments": {"city": "Paris"}}', None),
    "a brace that is not JSON": ("{not json} and more", None),
}


def _expected(text: str, want: Extracted | None) -> Extracted:
    # None: the parser leaves the whole output as content, as vLLM does.
    return want if want is not None else Extracted([], text)


@pytest.mark.parametrize("case", HERMES_CASES)
def test_hermes_one_shot_parse_matches_vllm(case):
    text, want = HERMES_CASES[case]
    assert one_shot("hermes", text) == _expected(text, want)


@pytest.mark.parametrize("case", LLAMA_CASES)
def test_llama3_json_one_shot_parse_matches_vllm(case):
    text, want = LLAMA_CASES[case]
    assert one_shot("llama3_json", text) == _expected(text, want)


def test_llama3_json_one_shot_drops_text_around_the_calls_as_vllm():
    text = "Calling: " + json.dumps(WEATHER) + " done"
    assert one_shot("llama3_json", text) == Extracted([call(WEATHER)], None)


def _same(a: Extracted, b: Extracted) -> None:
    assert a.calls == b.calls
    assert (a.content or "") == (b.content or "")


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(sorted(HERMES_CASES)),
       cuts=st.lists(st.integers(0, 200), max_size=12))
def test_hermes_stream_assembles_to_the_one_shot_parse(case, cuts):
    text, _ = HERMES_CASES[case]
    _same(streamed("hermes", text, cuts), one_shot("hermes", text))


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(sorted(LLAMA_CASES)),
       cuts=st.lists(st.integers(0, 200), max_size=12))
def test_llama3_json_stream_assembles_to_the_one_shot_parse(case, cuts):
    text, _ = LLAMA_CASES[case]
    _same(streamed("llama3_json", text, cuts), one_shot("llama3_json", text))


def test_hermes_stream_sends_content_before_the_call_arrives_and_each_call_as_it_closes():
    stream = ToolStream(get_tool_parser("hermes"))
    assert stream.feed("Let me <tool").content == "Let me "  # '<tool' may open a call
    assert stream.feed("ing> a").content == "<tooling> a"
    first = hermes_block(WEATHER)
    assert stream.feed(first[:-3]).calls == []  # still open
    assert stream.feed(first[-3:]).calls == [
        CallDelta(0, name="get_weather"), CallDelta(0, arguments=call(WEATHER).arguments)]
    assert stream.feed(hermes_block(TIME)).calls == [
        CallDelta(1, name="get_time"), CallDelta(1, arguments=call(TIME).arguments)]
    assert stream.finish() == StreamDelta()


def test_llama3_json_stream_is_content_when_the_output_does_not_open_with_a_call():
    # vLLM's streaming rule: calls only when the text starts with '{' or <|python_tag|>.
    stream = ToolStream(get_tool_parser("llama3_json"))
    assert stream.feed("<|python").content == ""
    assert calls_of(stream.feed("_tag|>" + json.dumps(WEATHER))) == [call(WEATHER)]
    other = ToolStream(get_tool_parser("llama3_json"))
    assert other.feed("Hi ").content == "Hi "


def test_stream_keeps_calls_it_sent_when_a_later_call_is_malformed():
    text = hermes_block(WEATHER) + '<tool_call>{"name": "x", "arguments": }</tool_call>'
    assert one_shot("hermes", text) == Extracted([], text)  # vLLM: all content
    got = streamed("hermes", text, [len(hermes_block(WEATHER))])
    assert got.calls == [call(WEATHER)] and not got.content


REQUIRED_TEXT = json.dumps([{"name": "get_weather", "parameters": {"city": "Paris"}},
                            {"name": "get_time", "parameters": {}}])


def test_required_parse_reads_the_array_of_name_and_parameters():
    assert one_shot("required", REQUIRED_TEXT) == Extracted(
        [ParsedCall("get_weather", '{"city": "Paris"}'), ParsedCall("get_time", "{}")], None)
    cut = REQUIRED_TEXT[:-5]  # max_tokens ran out: the calls that closed
    assert one_shot("required", cut) == Extracted(
        [ParsedCall("get_weather", '{"city": "Paris"}')], None)
    assert one_shot("required", cut[:20]) == Extracted([], cut[:20])


REQUIRED_CASES = [
    REQUIRED_TEXT,
    ' [ {"parameters": {"x": [1, "\\u00e9\\n"]}, "name": "late_name"} ]',  # name after
    '[{"name": "a", "parameters": {}}, {"name": 5, "parameters": {}}]',  # a bad element
    "[]", "not an array"]


@settings(max_examples=80, deadline=None)
@given(text=st.sampled_from(REQUIRED_CASES), cuts=st.lists(st.integers(0, 120), max_size=10))
def test_required_stream_assembles_to_the_one_shot_parse(text, cuts):
    _same(streamed("required", text, cuts), one_shot("required", text))


def test_required_stream_sends_arguments_as_they_are_written():
    stream = ToolStream(RequiredToolParser())
    text = '[{"name": "get_weather", "parameters": {"city": "Par'
    assert stream.feed(text).calls == [CallDelta(0, name="get_weather"),
                                       CallDelta(0, arguments='{"city": "Par')]
    assert stream.feed('is",  "n":1').calls == [CallDelta(0, arguments='is", "n": ')]
    assert stream.feed("}}]").calls == [CallDelta(0, arguments="1}")]
    assert stream.finish() == StreamDelta()


def test_required_stream_cut_inside_a_call_keeps_what_it_sent():
    # max_tokens ran out in the second call: the one-shot parse has the first only
    text = REQUIRED_TEXT[:-5]
    got = streamed("required", text, [])
    assert got.calls[0] == one_shot("required", text).calls[0]
    assert got.calls[1].name == "get_time"


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**20, 10**20)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8)


@settings(max_examples=200, deadline=None)
@given(value=_JSON_VALUES, ascii_escapes=st.booleans(), indent=st.sampled_from([None, 0, 2]),
       data=st.data())
def test_dump_prefix_of_every_prefix_begins_the_final_dump(value, ascii_escapes, indent, data):
    text = json.dumps({"v": value}, ensure_ascii=ascii_escapes, indent=indent)
    final = json.dumps(json.loads(text), ensure_ascii=False)
    cut = data.draw(st.integers(0, len(text)))
    assert final.startswith(dump_prefix(text[:cut]))
    assert dump_prefix(text) == final


def test_unknown_parser_name_is_an_error_listing_the_known_ones():
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("nope")
