"""Tool-call parsers: a model's text -> (content, tool calls), whole or streamed.

`hermes` reads `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
blocks; `llama3_json` reads bare `{"name": ..., "arguments"|"parameters": ...}`
objects (after an optional `<|python_tag|>`, several separated by `;`).
Their one-shot results follow vLLM's parsers of those names: text the parser
cannot read (malformed JSON, a missing key) leaves the whole output as content.

Streaming (`ToolStream`) parses the growing text and hands out only what the
one-shot parse of any continuation would also return: content up to the first
possible call, and each call once its JSON has closed and checks out (its
arguments then come in one fragment). At the end the one-shot parse of the
whole text settles the rest, so the assembled stream equals it -- except when
a call that was already sent is followed by a malformed one, which the
one-shot parse turns into content (vLLM's streaming sends the calls too).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import ClassVar

_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


@dataclass
class Extracted:
    calls: list[ParsedCall]
    content: str | None


@dataclass
class StreamDelta:
    """What one piece of streamed text adds: content text and newly completed calls."""

    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)


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
    of a partial text: the length of its certain content and the calls certain so far."""

    name: ClassVar[str]

    def extract(self, text: str) -> Extracted:
        raise NotImplementedError

    def safe(self, text: str, known: list[ParsedCall]) -> tuple[int, list[ParsedCall]]:
        raise NotImplementedError


class HermesToolParser(ToolParser):
    name = "hermes"
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

    def safe(self, text: str, known: list[ParsedCall]) -> tuple[int, list[ParsedCall]]:
        start = text.find(self.START)
        if start < 0:
            return len(text) - _partial_suffix(text, self.START), []
        # Closed blocks never change as text is appended; only count past those known.
        calls = list(known)
        for i, m in enumerate(self._CLOSED.finditer(text, start)):
            if i < len(known):
                continue
            call = self._parse(m.group(1))
            if call is None:
                break
            calls.append(call)
        return start, calls


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

    def safe(self, text: str, known: list[ParsedCall]) -> tuple[int, list[ParsedCall]]:
        # As vLLM's streaming: calls only when the output opens with one, else all content.
        if text.startswith(self.BOT) or text.startswith("{"):
            return 0, self._objects(text, 0)[0]
        if self.BOT.startswith(text):
            return 0, []
        return len(text), []


class RequiredToolParser(ToolParser):
    """`tool_choice: required`: the output is a JSON array of {"name", "parameters"}, held
    to that shape by its grammar. The calls are its elements that closed: all of them, or
    those before the cut when max_tokens ran out (vLLM fails such a request instead)."""

    name = "required"

    def extract(self, text: str) -> Extracted:
        calls = self.safe(text, [])[1]
        return Extracted(calls, None) if calls else Extracted([], text)

    def safe(self, text: str, known: list[ParsedCall]) -> tuple[int, list[ParsedCall]]:
        calls = []
        pos = text.find("{") if text.lstrip().startswith("[") else -1
        while pos >= 0:
            try:
                obj, end = _DECODER.raw_decode(text, pos)
            except (json.JSONDecodeError, RecursionError):
                break
            call = _call(obj, ("parameters",))
            if call is None:
                break
            calls.append(call)
            pos = text.find("{", end)
        return 0, calls


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser,
    "llama4_json": Llama3JsonToolParser}


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
        self.sent_calls: list[ParsedCall] = []

    def feed(self, delta: str) -> StreamDelta:
        self.text += delta
        content_end, calls = self.parser.safe(self.text, self.sent_calls)
        out = StreamDelta()
        if content_end > self.sent_content:
            out.content = self.text[self.sent_content:content_end]
            self.sent_content = content_end
        out.calls = calls[len(self.sent_calls):]
        self.sent_calls = calls
        return out

    def finish(self) -> StreamDelta:
        """The rest of the one-shot parse of the whole text, where it extends what was sent."""
        final = self.parser.extract(self.text)
        sent = self.text[:self.sent_content]
        out = StreamDelta()
        if final.calls and final.calls[:len(self.sent_calls)] == self.sent_calls \
                and (final.content or "").startswith(sent):
            out.content = (final.content or "")[len(sent):]
            out.calls = final.calls[len(self.sent_calls):]
        elif not final.calls and not self.sent_calls:
            out.content = self.text[self.sent_content:]
        self.sent_content = len(self.text)
        self.sent_calls = self.sent_calls + out.calls
        return out
