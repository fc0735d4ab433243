"""StructuredOutputManager: compiled grammars cached by key, matchers per request, bitmasks."""

from __future__ import annotations

import numpy as np

from jaxllm.sampling_params import StructuredOutputsParams
from jaxllm.structured_output.grammar import make_tokenizer
from jaxllm.structured_output.manager import StructuredOutputManager
from tests.models.tiny_checkpoints import EOS_ID, make_tiny_tokenizer


def _manager(vocab_size: int = 256) -> tuple[StructuredOutputManager, object]:
    hf = make_tiny_tokenizer(256)
    return StructuredOutputManager(lambda: make_tokenizer(hf, 256, EOS_ID), vocab_size), hf


def _ready(m: StructuredOutputManager) -> tuple[list[str], dict[str, str]]:
    while m.has_pending():
        m.wait_any(1.0)
        ready, failed = m.take_ready()
        if ready or failed:
            return ready, failed
    return [], {}


def _allowed(mask_row: np.ndarray) -> set[int]:
    bits = (mask_row.view(np.uint32)[:, None] >> np.arange(32, dtype=np.uint32)) & 1
    return set(np.flatnonzero(bits.reshape(-1)).tolist())


def test_requests_with_the_same_constraint_share_one_compiled_grammar_and_not_its_state():
    m, hf = _manager()
    regex = StructuredOutputsParams(regex="ab|ac")
    m.submit("r1", regex)
    m.submit("r2", StructuredOutputsParams(regex="ab|ac"))
    m.submit("r3", StructuredOutputsParams(choice=["ab"]))
    ready = []
    while len(ready) < 3:
        ready += _ready(m)[0]
    assert len(m._compiled) == 2 and sorted(ready) == ["r1", "r2", "r3"]
    a = hf.convert_tokens_to_ids("a")
    m.accept("r1", [a])  # r1 advances, r2 does not
    mask = m.fill_bitmask(["r1", "r2", "free"], np.array([True, True, True]))
    assert _allowed(mask[0]) == set(hf.convert_tokens_to_ids(["b", "c"]))
    assert _allowed(mask[1]) == {a}
    assert _allowed(mask[2]) == set(range(256))  # unconstrained: everything
    # A request that samples nothing this step (a prompt chunk) needs no bitmask.
    assert m.fill_bitmask(["r1"], np.array([False])) is None


def test_a_finished_grammar_allows_only_eos():
    m, hf = _manager()
    m.submit("r", StructuredOutputsParams(choice=["hi"]))
    _ready(m)
    m.accept("r", hf.convert_tokens_to_ids(["h", "i"]))
    assert _allowed(m.fill_bitmask(["r"], np.array([True]))[0]) == {EOS_ID}


def test_ids_past_the_tokenizer_are_never_allowed_when_the_model_vocabulary_is_larger():
    m, _ = _manager(vocab_size=300)
    m.submit("r", StructuredOutputsParams(regex="[a-z]+"))
    _ready(m)
    mask = m.fill_bitmask(["r", "free"], np.array([True, True]))
    assert mask.shape == (2, 10)
    assert max(_allowed(mask[0])) < 256 and _allowed(mask[1]) == set(range(320))


def test_a_structural_tag_constrains_the_text_after_its_trigger_to_the_schema():
    import json

    m, hf = _manager()
    tag = {"type": "structural_tag", "triggers": ["<f"], "structures": [
        {"begin": "<f>", "schema": {"type": "object", "properties": {"a": {"enum": [7]}},
                                    "required": ["a"], "additionalProperties": False},
         "end": "</f>"}]}
    m.submit("r", StructuredOutputsParams(structural_tag=json.dumps(tag)))
    assert _ready(m)[0] == ["r"]
    free = _allowed(m.fill_bitmask(["r"], np.array([True]))[0])
    assert hf.convert_tokens_to_ids("x") in free  # free text before the trigger
    m.accept("r", hf.encode("hi <f>", add_special_tokens=False))
    assert _allowed(m.fill_bitmask(["r"], np.array([True]))[0]) == {
        hf.convert_tokens_to_ids("{")}
    m.accept("r", hf.encode('{"a":7}', add_special_tokens=False))
    assert _allowed(m.fill_bitmask(["r"], np.array([True]))[0]) == {
        hf.convert_tokens_to_ids("<")}


def test_under_a_reasoning_parser_the_grammar_waits_out_the_thinking():
    """Unconstrained rows while the request reasons, and its tokens are not the grammar's;
    the grammar starts right after the end tag, in the same step's tokens; a prompt that
    closed the block starts constrained."""
    hf = make_tiny_tokenizer(256)
    ids = lambda text: hf.encode(text, add_special_tokens=False)  # noqa: E731
    m = StructuredOutputManager(lambda: make_tokenizer(hf, 256, EOS_ID), 256,
                                reasoning_tags=(ids("<think>"), ids("</think>"), None))
    m.submit("thinking", StructuredOutputsParams(regex="ab"), ids("q<think>\n"))
    m.submit("closed", StructuredOutputsParams(regex="ab"), ids("q<think>\n\n</think>\n\n"))
    ready = []
    while len(ready) < 2:
        ready += _ready(m)[0]
    mask = m.fill_bitmask(["thinking", "closed"], np.array([True, True]))
    a, b = hf.convert_tokens_to_ids(["a", "b"])
    assert _allowed(mask[0]) == set(range(256)) and _allowed(mask[1]) == {a}
    m.accept("thinking", ids("zzz</th"))
    assert m.fill_bitmask(["thinking"], np.array([True])) is None  # no row constrained
    m.accept("thinking", ids("ink>a"))  # the tag ends, and "a" is the grammar's first
    assert _allowed(m.fill_bitmask(["thinking"], np.array([True]))[0]) == {b}
    m.remove(["thinking", "closed"])
    assert not m.gates and not m.matchers
