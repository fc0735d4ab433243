"""GPT-OSS's harmony output format, read from the decoded text (special tokens kept):
the `openai_gptoss` reasoning parser and the `openai` tool parser's input.

GPT-OSS's chat template ends the prompt with `<|start|>assistant`, so an output is a run
of messages, each a header, `<|message|>`, a body and an end tag:

    <|channel|>analysis<|message|>thinking...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
        <|message|>{"city": "Oslo"}<|call|>        (one line in the text)
    <|start|>assistant<|channel|>final<|message|>the answer<|return|>

The header names the channel and, for a tool call, the recipient (`to=...`, before
or after the channel). `<|return|>` and `<|call|>` are stop tokens, so the last
message usually ends with the text. A body is the reasoning on the `analysis` channel
(and on any other channel addressed to a built-in tool, which jaxllm does not run),
the answer on `final` (and on `commentary` without a recipient: the preambles the
model shows the user before its calls), and a function call when addressed to
`functions.NAME`. Calls reach the answer as `to=functions.NAME<|message|>ARGS<|call|>`
blocks, which the `openai` tool parser reads; without that parser they are dropped.
A header is read once whole, and a body's end that may begin a special token is
held back, so a stream splits exactly as the whole text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

START, END, MESSAGE, CALL, RETURN = "<|start|>", "<|end|>", "<|message|>", "<|call|>", "<|return|>"
CHANNEL = "<|channel|>"
_ENDS = (END, CALL, RETURN)
_RECIPIENT = re.compile(r"to=([^\s<]+)")
FUNCTIONS = "functions."


def call_block(name: str, arguments: str, closed: bool) -> str:
    """A function call as the answer carries it to the `openai` tool parser."""
    return f"to={FUNCTIONS}{name}{MESSAGE}{arguments}{CALL if closed else ''}"


def _kind(header: str) -> tuple[str, str | None]:
    """("reasoning" | "content" | "call", the called function's name) of a header."""
    channel = ""
    if CHANNEL in header:
        channel = re.split(r"[\s<]", header.split(CHANNEL, 1)[1], maxsplit=1)[0]
    found = _RECIPIENT.search(header)
    recipient = found.group(1) if found else None
    if recipient is not None and recipient.startswith(FUNCTIONS):
        return "call", recipient[len(FUNCTIONS):]
    if channel == "analysis" or recipient is not None:
        return "reasoning", None
    return "content", None


def _held(text: str) -> int:
    """How many of `text`'s last characters may begin an end tag."""
    for n in range(min(max(len(t) for t in _ENDS) - 1, len(text)), 0, -1):
        if any(t.startswith(text[-n:]) for t in _ENDS):
            return n
    return 0


class SplitParts:
    """What a splitter has handed out (its dataclass holds `entered`, `reasoning_parts`
    and `content_parts`): the output's reasoning ("" once a block was entered, else None)
    and content (None when empty)."""

    entered: bool
    reasoning_parts: list[str]
    content_parts: list[str]

    def _record(self, reasoning: str, content: str) -> tuple[str, str]:
        if reasoning:
            self.reasoning_parts.append(reasoning)
        if content:
            self.content_parts.append(content)
        return reasoning, content

    @property
    def reasoning(self) -> str | None:
        return "".join(self.reasoning_parts) if self.entered else None

    @property
    def content(self) -> str | None:
        return "".join(self.content_parts) or None


@dataclass
class HarmonySplitter(SplitParts):
    """One choice's harmony text, fed as it grows, split into reasoning and answer (the
    interface of reasoning.ReasoningSplitter). `calls`: keep function calls in the answer
    (under the `openai` tool parser)."""

    calls: bool = False
    _text: str = ""
    _sent: tuple[int, int] = (0, 0)  # reasoning, answer characters handed out
    entered: bool = False
    reasoning_parts: list[str] = field(default_factory=list)
    content_parts: list[str] = field(default_factory=list)

    def _parse(self, final: bool) -> tuple[str, str]:
        """The whole text's settled (reasoning, answer)."""
        reasoning, answer, pos, text = [], [], 0, self._text
        while pos < len(text):
            j = text.find(MESSAGE, pos)
            if j < 0 and final and pos == 0:
                answer.append(text)  # no harmony at all (a grammar from the first token)
            if j < 0:
                break  # a header still being written
            kind, name = _kind(text[pos:j])
            pos = j + len(MESSAGE)
            ends = [(k, t) for t in _ENDS if (k := text.find(t, pos)) >= 0]
            end, tag = min(ends) if ends else (len(text), None)
            body = text[pos:end]
            if tag is None and not final:
                body = body[:len(body) - _held(body)]
            if kind == "reasoning":
                self.entered = True
                reasoning.append(body)
            elif kind == "content":
                answer.append(body)
            elif self.calls:
                answer.append(call_block(name or "", body, closed=tag is not None or final))
            if tag is None:
                break
            pos = end + len(tag)
            if text.startswith(START, pos):
                pos += len(START)
        return "".join(reasoning), "".join(answer)

    def _step(self, final: bool) -> tuple[str, str]:
        reasoning, answer = self._parse(final)
        r, a = self._sent
        self._sent = (len(reasoning), len(answer))
        return self._record(reasoning[r:], answer[a:])

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) that `text` adds, as far as they are settled."""
        self._text += text
        return self._step(final=False)

    def finish(self) -> tuple[str, str]:
        return self._step(final=True)
