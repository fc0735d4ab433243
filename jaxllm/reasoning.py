"""Reasoning outputs (vLLM's `--reasoning-parser`): a model's thinking split from its answer.

A reasoning model writes its thinking between a start and an end tag (`<think>` ...
`</think>` for DeepSeek-R1, Qwen3, GLM-4.5 and OLMo 3; `<seed:think>` ... `</seed:think>` for
Seed-OSS) and its answer after. The chat server returns the thinking as
`message.reasoning` (and the older name `reasoning_content`) and the rest as
`content`, whole or streamed; tool calls are read from the content only. Under
structured outputs the grammar holds only the answer: it starts once the reasoning
has ended (`ReasoningGate`, which the engine core's grammars use).

Where the output starts is read from the prompt, since chat templates often open
(Qwen3-Thinking, DeepSeek-R1-0528) or close (Qwen3 with `enable_thinking: false`) the
block themselves: the prompt's last tag says whether the block is open. With no tag
in the prompt, `deepseek_r1`, `olmo3` and `seed_oss` start in reasoning (these models
think first, tag or not) and `qwen3` and `glm45` in the answer (`glm45` reads only the
prompt after its last `<|assistant|>`, as vLLM's). Either way an output that begins
with the start tag (past whitespace) opens the block there. The streamed split equals
the whole one: text that may be the start of a tag is held back until it is told
apart. (vLLM's whole-output `qwen3` parser returns an output cut off inside an opened
block as content, while its stream sends the same text as reasoning; here both call
it reasoning.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxllm.errors import ParameterError
from jaxllm.harmony import HarmonySplitter, SplitParts


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start: str
    end: str
    open_without_tags: bool  # the output starts in reasoning when the prompt has no tag
    # Where the model's own turn begins in the prompt: only tags after its last one count
    # (GLM-4.5's template closes a <think></think> in every earlier assistant turn).
    turn: str | None = None
    # GPT-OSS's harmony messages (jaxllm/harmony.py) rather than tags around the thinking;
    # `start` / `end` then only gate a grammar (the analysis and final channels' headers).
    harmony: bool = False


REASONING_PARSERS = {
    "deepseek_r1": ReasoningFormat("deepseek_r1", "<think>", "</think>", True),
    "qwen3": ReasoningFormat("qwen3", "<think>", "</think>", False),
    # OLMo 3 Think writes plain-text tags, its template opening the block or not.
    "olmo3": ReasoningFormat("olmo3", "<think>", "</think>", True),
    "seed_oss": ReasoningFormat("seed_oss", "<seed:think>", "</seed:think>", True),
    "glm45": ReasoningFormat("glm45", "<think>", "</think>", False, turn="<|assistant|>"),
    "openai_gptoss": ReasoningFormat("openai_gptoss", "<|channel|>analysis<|message|>",
                                     "<|channel|>final<|message|>", True,
                                     turn="<|start|>assistant", harmony=True),
}
# The reasoning split a family's chat answers get with no --reasoning-parser, as in vLLM
# (GPT-OSS writes harmony messages whatever the flags).
DEFAULT_FOR_MODEL_TYPE = {"gpt_oss": "openai_gptoss"}


def get_reasoning_format(name: str) -> ReasoningFormat:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ParameterError("reasoning_parser", f"unknown parser {name!r}; supported: "
                             f"{', '.join(sorted(REASONING_PARSERS))}") from None


def opened_by_prompt(fmt: ReasoningFormat, prompt: str) -> bool:
    """Whether the output starts inside the reasoning block (module docstring)."""
    if fmt.turn is not None and fmt.turn in prompt:
        prompt = prompt[prompt.rfind(fmt.turn) + len(fmt.turn):]
    start, end = prompt.rfind(fmt.start), prompt.rfind(fmt.end)
    if start < 0 and end < 0:
        return fmt.open_without_tags
    return start > end


def _held(text: str, tag: str) -> int:
    """How many of `text`'s last characters may begin `tag` (0: none)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass
class ReasoningSplitter(SplitParts):
    """One choice's output text, fed as it grows, split into reasoning and content."""

    fmt: ReasoningFormat
    in_reasoning: bool  # `opened_by_prompt`
    leading: bool = True  # nothing but whitespace seen: a start tag may still open the block
    entered: bool = False  # the block was open at some point (reasoning is "" not None)
    _buffer: str = ""
    reasoning_parts: list[str] = field(default_factory=list)
    content_parts: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.entered = self.in_reasoning

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that `text` adds, as far as they are settled."""
        self._buffer += text
        reasoning, content = [], []
        while self._buffer:
            if self.leading:
                head = self._buffer.lstrip()
                if head.startswith(self.fmt.start):
                    self._buffer = head[len(self.fmt.start):]
                    self.in_reasoning = self.entered = True
                elif head and not self.fmt.start.startswith(head):
                    pass  # not a tag: the text belongs where the output started
                else:
                    break  # whitespace, or what may become the start tag
                self.leading = False
            elif self.in_reasoning:
                before, tag, after = self._buffer.partition(self.fmt.end)
                if tag:
                    reasoning.append(before)
                    self._buffer, self.in_reasoning = after, False
                    continue
                keep = _held(self._buffer, self.fmt.end)
                reasoning.append(self._buffer[:len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep:]
                break
            else:
                content.append(self._buffer)
                self._buffer = ""
        return self._record("".join(reasoning), "".join(content))

    def finish(self) -> tuple[str, str]:
        """What was held back, now that the output is whole."""
        rest, self._buffer, self.leading = self._buffer, "", False
        return self._record(rest, "") if self.in_reasoning else self._record("", rest)


def make_splitter(fmt: ReasoningFormat, prompt: str, calls: bool = False
                  ) -> ReasoningSplitter | HarmonySplitter:
    """A choice's splitter. `calls`: harmony's function calls stay in the answer, for the
    `openai` tool parser."""
    if fmt.harmony:
        return HarmonySplitter(calls)
    return ReasoningSplitter(fmt, opened_by_prompt(fmt, prompt))


def split_reasoning(fmt: ReasoningFormat, prompt: str, text: str, calls: bool = False
                    ) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole output; None where the output has none."""
    splitter = make_splitter(fmt, prompt, calls)
    splitter.feed(text)
    splitter.finish()
    return splitter.reasoning, splitter.content


def _last(ids: list[int], sub: list[int]) -> int:
    """Where `sub` last starts in `ids` (-1: nowhere)."""
    n = len(sub)
    for i in range(len(ids) - n, -1, -1):
        if ids[i:i + n] == sub:
            return i
    return -1


@dataclass
class ReasoningGate:
    """Token-level: holds a request's grammar back until its reasoning has ended, as
    vLLM's structured outputs do under a reasoning parser. `start_ids` / `end_ids`: the
    tags as the tokenizer writes them."""

    start_ids: list[int]
    end_ids: list[int]
    ended: bool = False
    _tail: list[int] = field(default_factory=list)

    @classmethod
    def for_prompt(cls, start_ids: list[int], end_ids: list[int], prompt_ids: list[int],
                   turn_ids: list[int] | None = None) -> ReasoningGate:
        """A gate for a request: already past the reasoning where the prompt's last tag
        (after its last `turn_ids`, where given) is the end tag (the template closed the
        block)."""
        turn = _last(prompt_ids, turn_ids) if turn_ids else -1
        if turn >= 0:
            prompt_ids = prompt_ids[turn + len(turn_ids):]
        start, end = _last(prompt_ids, start_ids), _last(prompt_ids, end_ids)
        return cls(start_ids, end_ids, ended=end >= 0 and end > start)

    def feed(self, token_ids: list[int]) -> list[int]:
        """Newly sampled tokens in; those after the end tag (the grammar's) out."""
        if self.ended:
            return token_ids
        n = len(self.end_ids)
        seen = self._tail + token_ids
        for i in range(len(self._tail), len(seen)):
            if i + 1 >= n and seen[i + 1 - n:i + 1] == self.end_ids:
                self.ended, self._tail = True, []
                return seen[i + 1:]
        self._tail = seen[-(n - 1):] if n > 1 else []
        return []
