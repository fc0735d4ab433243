"""Tool-call parsers: a model's text -> (content, tool calls), whole or streamed.

`hermes` reads `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
blocks; `llama3_json` reads bare `{"name": ..., "arguments"|"parameters": ...}`
objects (after an optional `<|python_tag|>`, several separated by `;`).
Their one-shot results follow vLLM's parsers of those names: text the parser
cannot read (malformed JSON, a missing key) leaves the whole output as content.

Streaming (`ToolStream`) parses the growing text and hands out only what the
one-shot parse of any continuation would also return: content up to the first
possible call, and each hermes or llama3_json call once its JSON has closed and
checks out (its arguments then come in one fragment: an open call may still
turn out malformed, and then the one-shot parse makes it content). The output
of `tool_choice: required` is held to its JSON shape by a grammar, so its
arguments stream as they are written (see `json_prefix`). At the end the
one-shot parse of the whole text settles the rest, so the assembled stream
equals it -- except when a call that was already sent is followed by a
malformed one (which the one-shot parse turns into content; vLLM's streaming
sends the calls too), or a `required` array is cut by max_tokens in a call.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import ClassVar

from jaxllm.entrypoints.openai.json_prefix import Malformed, members

_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


@dataclass
class Extracted:
    calls: list[ParsedCall]
    content: str | None


@dataclass(frozen=True)
class PartialCall:
    """A call as far as the text goes: its name once whole, the fixed beginning of its
    arguments (all of them once `closed`)."""

    name: str | None
    arguments: str
    closed: bool


@dataclass(frozen=True)
class CallDelta:
    """One streamed step of call `index`: its name (first step only) or an arguments
    fragment."""

    index: int
    name: str | None = None
    arguments: str = ""


@dataclass
class StreamDelta:
    """What one piece of streamed text adds: content text and call steps."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


def _call(obj: object, args_keys: tuple[str, ...]) -> ParsedCall | None:
    """A call from a decoded object: a string name and the first of `args_keys` present."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in args_keys:
        if key in obj:
            return ParsedCall(obj["name"], json.dumps(obj[key], ensure_ascii=False))
    return None


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (held back while streaming)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ToolParser:
    """One parser kind. `extract` is the one-shot parse; `safe` is what streaming may send
    of a partial text: the length of its certain content and the calls so far."""

    name: ClassVar[str]
    # As vLLM's hermes parser: its tags are special tokens in some models, which
    # decoding with skip_special_tokens would drop before the parser sees them.
    keeps_special_tokens: ClassVar[bool] = False

    def extract(self, text: str) -> Extracted:
        raise NotImplementedError

    def safe(self, text: str) -> tuple[int, list[PartialCall]]:
        raise NotImplementedError


def _closed(calls: list[ParsedCall]) -> list[PartialCall]:
    return [PartialCall(c.name, c.arguments, True) for c in calls]


class HermesToolParser(ToolParser):
    name = "hermes"
    keeps_special_tokens = True
    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
    _CLOSED = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    @staticmethod
    def _parse(body: str) -> ParsedCall | None:
        try:
            return _call(json.loads(body), ("arguments",))
        except (json.JSONDecodeError, RecursionError):
            return None

    def extract(self, text: str) -> Extracted:
        start = text.find(self.START)
        if start < 0:
            return Extracted([], text)
        calls = []
        for m in self._BLOCK.finditer(text):
            call = self._parse(m.group(1) if m.group(1) is not None else m.group(2))
            if call is None:
                return Extracted([], text)
            calls.append(call)
        return Extracted(calls, text[:start] or None)

    def __init__(self) -> None:
        self._known: list[ParsedCall] = []  # closed blocks never change as text grows

    def safe(self, text: str) -> tuple[int, list[PartialCall]]:
        start = text.find(self.START)
        if start < 0:
            return len(text) - _partial_suffix(text, self.START), []
        for i, m in enumerate(self._CLOSED.finditer(text, start)):
            if i < len(self._known):
                continue
            call = self._parse(m.group(1))
            if call is None:
                break
            self._known.append(call)
        return start, _closed(self._known)


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    BOT = "<|python_tag|>"

    @staticmethod
    def _objects(text: str, start: int) -> tuple[list[ParsedCall], bool]:
        """The calls of the JSON objects from `start` on, and whether all of them parsed
        (an object that does not decode -- malformed or unfinished -- stops the walk)."""
        calls = []
        pos = text.find("{", start)
        while pos >= 0:
            try:
                obj, end = _DECODER.raw_decode(text, pos)
            except (json.JSONDecodeError, RecursionError):
                return calls, False
            call = _call(obj, ("arguments", "parameters"))
            if call is None:
                return calls, False
            calls.append(call)
            pos = text.find("{", end)
        return calls, True

    def extract(self, text: str) -> Extracted:
        if self.BOT not in text and "{" not in text:
            return Extracted([], text)
        calls, ok = self._objects(text, 0)
        if not ok or not calls:
            return Extracted([], text)
        return Extracted(calls, None)

    def safe(self, text: str) -> tuple[int, list[PartialCall]]:
        # As vLLM's streaming: calls only when the output opens with one, else all content.
        if text.startswith(self.BOT) or text.startswith("{"):
            return 0, _closed(self._objects(text, 0)[0])
        if self.BOT.startswith(text):
            return 0, []
        return len(text), []


class RequiredToolParser(ToolParser):
    """`tool_choice: required`: the output is a JSON array of {"name", "parameters"}, held
    to that shape by its grammar. The calls are its elements that closed: all of them, or
    those before the cut when max_tokens ran out (vLLM fails such a request instead)."""

    name = "required"

    def __init__(self) -> None:
        # Closed elements never change as text grows: a stream scans on from the last one.
        self._done: list[PartialCall] = []
        self._resume: int | None = None
        self._ended = False  # a malformed element ends the calls

    def extract(self, text: str) -> Extracted:
        calls = [ParsedCall(c.name, c.arguments) for c in RequiredToolParser().safe(text)[1]
                 if c.closed and c.name is not None]
        return Extracted(calls, None) if calls else Extracted([], text)

    def safe(self, text: str) -> tuple[int, list[PartialCall]]:
        if self._ended:
            return 0, list(self._done)
        if self._resume is None:
            if not text.lstrip().startswith("["):
                return 0, []
            self._resume = text.index("[") + 1
        i, open_call = self._resume, []
        try:
            while not open_call:
                while i < len(text) and text[i] in " \t\n\r,":
                    i += 1
                if i == len(text) or text[i] != "{":
                    break
                found, end = members(text, i)
                call = self._element(text, i, found, end)
                if call is None:
                    self._ended = True
                    break
                if end is None:
                    open_call = [call]
                else:
                    self._done.append(call)
                    i = self._resume = end
        except Malformed:
            self._ended = True
        return 0, self._done + open_call

    @staticmethod
    def _element(text: str, start: int, found: list, end: int | None) -> PartialCall | None:
        if end is not None:  # closed: the one-shot parse's own reading
            try:
                call = _call(json.loads(text[start:end]), ("parameters",))
            except (json.JSONDecodeError, RecursionError):
                return None
            return None if call is None else PartialCall(call.name, call.arguments, True)
        values = dict(found)
        name = values.get("name")
        named = None
        if name is not None and name.end is not None and name.out.startswith('"'):
            named = json.loads(name.out)
        params = values.get("parameters")
        return PartialCall(named, params.out if params is not None else "", False)


class OpenAIToolParser(ToolParser):
    """GPT-OSS's calls (`openai`): the harmony messages addressed to `functions.NAME`,
    which the harmony reasoning split (jaxllm/harmony.py) hands on as `to=functions.NAME
    <|message|>ARGS<|call|>` blocks; the rest of the answer is content. A call is known
    by its header, so its arguments stream as they are written and stand as written."""

    name = "openai"
    keeps_special_tokens = True
    START, CALL = "to=functions.", "<|call|>"
    _BLOCK = re.compile(r"to=functions\.(.*?)<\|message\|>(.*?)(<\|call\|>|$)", re.DOTALL)

    def _blocks(self, text: str) -> tuple[int, list[PartialCall]]:
        first = text.find(self.START)
        if first < 0:
            return len(text) - _partial_suffix(text, self.START), []
        calls = []
        for m in self._BLOCK.finditer(text, first):
            closed = bool(m.group(3))
            calls.append(PartialCall(m.group(1), m.group(2) if closed else m.group(2)
                                     [:len(m.group(2)) - _partial_suffix(m.group(2), self.CALL)],
                                     closed))
        return first, calls

    def extract(self, text: str) -> Extracted:
        first, calls = self._blocks(text)
        if not calls:
            return Extracted([], text)
        content = self._BLOCK.sub("", text[first:])
        content = (text[:first] + content) or None
        return Extracted([ParsedCall(c.name or "", c.arguments) for c in calls], content)

    def safe(self, text: str) -> tuple[int, list[PartialCall]]:
        return self._blocks(text)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser,
    "llama4_json": Llama3JsonToolParser, "openai": OpenAIToolParser}


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r} (known: "
                         f"{', '.join(sorted(TOOL_PARSERS))})") from None


class ToolStream:
    """Incremental parse of one choice's text with `parser` (see the module docstring)."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""
        self.sent_content = 0
        self.sent_names: list[str] = []
        self.sent_args: list[str] = []

    def feed(self, delta: str) -> StreamDelta:
        self.text += delta
        content_end, calls = self.parser.safe(self.text)
        out = StreamDelta()
        if content_end > self.sent_content:
            out.content = self.text[self.sent_content:content_end]
            self.sent_content = content_end
        for index, call in enumerate(calls):
            if call.name is None:
                break  # calls are sent in order, each opening with its name
            self._send(out, index, call.name, call.arguments)
        return out

    def finish(self) -> StreamDelta:
        """The rest of the one-shot parse of the whole text, where it extends what was sent."""
        final = self.parser.extract(self.text)
        sent = self.text[:self.sent_content]
        out = StreamDelta()
        extends = len(final.calls) >= len(self.sent_names) and all(
            c.name == name and c.arguments.startswith(args)
            for c, name, args in zip(final.calls, self.sent_names, self.sent_args, strict=False))
        if final.calls and extends and (final.content or "").startswith(sent):
            out.content = (final.content or "")[len(sent):]
            for index, call in enumerate(final.calls):
                self._send(out, index, call.name, call.arguments)
        elif not final.calls and not self.sent_names:
            out.content = self.text[self.sent_content:]
        self.sent_content = len(self.text)
        return out

    def _send(self, out: StreamDelta, index: int, name: str, arguments: str) -> None:
        if index == len(self.sent_names):
            self.sent_names.append(name)
            self.sent_args.append("")
            out.calls.append(CallDelta(index, name=name))
        sent = self.sent_args[index]
        if len(arguments) > len(sent) and arguments.startswith(sent):
            out.calls.append(CallDelta(index, arguments=arguments[len(sent):]))
            self.sent_args[index] = arguments
