"""The reasoning split (jaxllm/reasoning.py): whole outputs as vLLM's parsers split them,
the streamed split equal to the whole at every cut, and the token-level gate that holds
a grammar back until the reasoning has ended."""

from __future__ import annotations

import pytest

from jaxllm.errors import ParameterError
from jaxllm.reasoning import (
    REASONING_PARSERS,
    ReasoningGate,
    ReasoningSplitter,
    get_reasoning_format,
    opened_by_prompt,
    split_reasoning,
)

R1, QWEN3 = REASONING_PARSERS["deepseek_r1"], REASONING_PARSERS["qwen3"]
SEED, GLM = REASONING_PARSERS["seed_oss"], REASONING_PARSERS["glm45"]
# GLM-4.5's template closes a block in every earlier assistant turn.
GLM_HISTORY = "<|assistant|><think></think>old<|user|>again<|assistant|>"
OPEN, CLOSED, PLAIN = "<|assistant|><think>\n", "<|assistant|><think>\n\n</think>\n\n", "<|a|>"

# (format, prompt, output, reasoning, content)
CASES = [
    # Both tags in the output (DeepSeek-R1-0528, Qwen3 with thinking on).
    (QWEN3, PLAIN, "<think>a b</think>\n\nyes", "a b", "\n\nyes"),
    (R1, PLAIN, "<think>a b</think>yes", "a b", "yes"),
    # The template opened the block: the output starts inside it.
    (QWEN3, OPEN, "a b</think>yes", "a b", "yes"),
    (R1, PLAIN, "a b</think>yes", "a b", "yes"),  # R1 thinks first, tag or not
    # Cut off inside the reasoning: no content.
    (QWEN3, OPEN, "a b c", "a b c", None),
    (R1, PLAIN, "<think>a b", "a b", None),
    # No reasoning at all: Qwen3 without tags, or with the block closed by the template.
    (QWEN3, PLAIN, "just this", None, "just this"),
    (QWEN3, CLOSED, "just this", None, "just this"),
    # A start tag only counts at the output's beginning (past whitespace).
    (QWEN3, PLAIN, "  \n<think>x</think>y", "x", "y"),
    (QWEN3, PLAIN, "say <think> then", None, "say <think> then"),
    (QWEN3, CLOSED, "<think>x</think>y", "x", "y"),
    # Empty reasoning is "" (the block was there), empty content is None.
    (QWEN3, PLAIN, "<think></think>", "", None),
    (R1, PLAIN, "</think>ok", "", "ok"),
    # Text that begins like a tag but is not one.
    (QWEN3, OPEN, "a </thin b</think>c", "a </thin b", "c"),
    (QWEN3, PLAIN, "<thx", None, "<thx"),
    (QWEN3, OPEN, "a </th", "a </th", None),
    # Seed-OSS's own tags; a <think> means nothing to it.
    (SEED, PLAIN, "<seed:think>a</seed:think>b", "a", "b"),
    (SEED, PLAIN, "a <think>x</think></seed:think>b", "a <think>x</think>", "b"),
    (SEED, PLAIN, "<seed:thi", "<seed:thi", None),
    # GLM-4.5 reads only its own turn of the prompt.
    (GLM, GLM_HISTORY, "<think>a</think>b", "a", "b"),
    (GLM, GLM_HISTORY + "<think>", "a</think>b", "a", "b"),
    (GLM, GLM_HISTORY, "plain", None, "plain"),
    # A second end tag is content.
    (QWEN3, OPEN, "a</think>b</think>c", "a", "b</think>c"),
]


@pytest.mark.parametrize("fmt,prompt,output,reasoning,content", CASES)
def test_whole_outputs_split_as_vllm(fmt, prompt, output, reasoning, content):
    assert split_reasoning(fmt, prompt, output) == (reasoning, content)


@pytest.mark.parametrize("fmt,prompt,output,reasoning,content", CASES)
def test_every_streamed_cut_assembles_to_the_whole_split(fmt, prompt, output, reasoning,
                                                         content):
    for cuts in ([i] for i in range(len(output) + 1)):
        pieces = [output[:cuts[0]], output[cuts[0]:]]
        splitter = ReasoningSplitter(fmt, opened_by_prompt(fmt, prompt))
        got_r, got_c = "", ""
        for piece in pieces:
            r, c = splitter.feed(piece)
            got_r, got_c = got_r + r, got_c + c
        r, c = splitter.finish()
        assert (got_r + r, got_c + c) == (reasoning or "", content or "")
    # One character at a time: reasoning is handed out before the end tag arrives.
    splitter = ReasoningSplitter(fmt, opened_by_prompt(fmt, prompt))
    got = [splitter.feed(ch) for ch in output]
    tail = splitter.finish()
    assert "".join(r for r, _ in got) + tail[0] == (reasoning or "")
    if reasoning and len(reasoning) > len(fmt.end):
        assert got[len(output) // 2][0] or any(r for r, _ in got[:len(output) // 2])


def test_an_unknown_parser_is_named():
    with pytest.raises(ParameterError, match="reasoning_parser: unknown parser 'r2'; "
                                             "supported: deepseek_r1, glm45, olmo3, "
                                             "openai_gptoss, qwen3, seed_oss"):
        get_reasoning_format("r2")


START, END = [7, 8], [9, 10, 11]


def test_the_gate_opens_after_the_end_tag_even_across_steps():
    gate = ReasoningGate.for_prompt(START, END, [1, 2, 7, 8])
    assert not gate.ended
    assert gate.feed([3, 9]) == [] and not gate.ended
    assert gate.feed([10]) == [] and not gate.ended
    assert gate.feed([11, 4, 5]) == [4, 5] and gate.ended
    assert gate.feed([6]) == [6]


def test_the_gate_reads_the_prompt_and_a_false_start():
    assert ReasoningGate.for_prompt(START, END, [7, 8, 1, 9, 10, 11, 2]).ended  # closed
    assert not ReasoningGate.for_prompt(START, END, [9, 10, 11, 7, 8]).ended  # reopened
    assert not ReasoningGate.for_prompt(START, END, [1, 2]).ended  # as vLLM: no tag, waits
    # Only the prompt after the last turn marker counts (GLM-4.5's history).
    assert not ReasoningGate.for_prompt(START, END, [7, 8, 9, 10, 11, 5, 1, 5], [5]).ended
    assert ReasoningGate.for_prompt(START, END, [5, 7, 8, 9, 10, 11], [5]).ended
    assert ReasoningGate.for_prompt(START, END, [7, 8, 9, 10, 11], [5]).ended  # no turn
    gate = ReasoningGate.for_prompt(START, END, [])
    assert gate.feed([9, 10, 3, 9, 10, 11]) == [] and gate.ended  # 9 10 3 is no tag
