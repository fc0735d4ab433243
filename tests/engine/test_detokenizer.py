"""Incremental detokenization: UTF-8 safe across tokens, stop strings, streaming deltas."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from jaxllm.core.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    LogprobsLists,
)
from jaxllm.engine.detokenizer import IncrementalDetokenizer
from jaxllm.engine.output_processor import OutputProcessor, ParentRequest
from jaxllm.sampling_params import RequestOutputKind, SamplingParams

TEXT = "héllo wörld, 日本語 and 🙂 emoji; hello world again 🙂🙂"


@pytest.fixture(scope="module")
def tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world", "héllo", "world again"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def _stream(tokenizer, params, ids):
    detok = IncrementalDetokenizer(tokenizer, params, [0])
    pieces, stop = [], None
    for tid in ids:
        stop = detok.update([tid])
        pieces.append(detok.get_next_output_text(finished=stop is not None, delta=True))
        if stop is not None:
            break
    return detok, pieces, stop


def test_multibyte_characters_split_across_tokens_never_show_replacement_chars(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    # The emoji and CJK characters are several byte-level tokens each here.
    assert len(ids) > len(TEXT.split())
    detok, pieces, _ = _stream(tokenizer, SamplingParams(), ids)
    assert "".join(pieces) == TEXT == detok.output_text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_truncates_and_is_never_streamed(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    params = SamplingParams(stop=["and 🙂"])
    detok, pieces, stop = _stream(tokenizer, params, ids)
    assert stop == "and 🙂"
    assert detok.output_text == "héllo wörld, 日本語 "
    assert "".join(pieces) == detok.output_text
    params = SamplingParams(stop=["and 🙂"], include_stop_str_in_output=True)
    detok, _, _ = _stream(tokenizer, params, ids)
    assert detok.output_text == "héllo wörld, 日本語 and 🙂"


def _request(rid, ids, params):
    return EngineCoreRequest(request_id=rid, prompt_token_ids=[0], sampling_params=params)


def test_output_processor_aborts_core_request_on_stop_string_and_merges_n_children(tokenizer):
    ids = tokenizer("hello world again", add_special_tokens=False).input_ids
    op = OutputProcessor(tokenizer)
    params = SamplingParams(stop=["again"], output_kind=RequestOutputKind.FINAL_ONLY)
    parent = ParentRequest("r", 2, RequestOutputKind.FINAL_ONLY)
    for i in range(2):
        op.add_request(_request(f"{i}_r", ids, params), "p", parent, i)
    res = op.process_outputs(EngineCoreOutputs([EngineCoreOutput("0_r", ids)]))
    assert res.reqs_to_abort == ["0_r"] and res.request_outputs == []
    res = op.process_outputs(EngineCoreOutputs([EngineCoreOutput(
        "1_r", ids[:2], finish_reason=FinishReason.LENGTH)]))
    (out,) = res.request_outputs
    assert out.finished and [c.index for c in out.outputs] == [0, 1]
    assert out.outputs[0].text == "hello world " and out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == "again"
    assert out.outputs[1].finish_reason == "length"
    assert not op.has_unfinished_requests()


def test_delta_outputs_carry_each_token_once_with_logprobs(tokenizer):
    ids = tokenizer("hello world", add_special_tokens=False).input_ids
    op = OutputProcessor(tokenizer)
    params = SamplingParams(logprobs=1, output_kind=RequestOutputKind.DELTA)
    parent = ParentRequest("d", 1, RequestOutputKind.DELTA)
    op.add_request(_request("d", ids, params), "p", parent, 0)
    got, text = [], ""
    for i, tid in enumerate(ids):
        lp = LogprobsLists([[tid, 7]], [[-0.5, -0.1]], [2])
        fin = FinishReason.LENGTH if i == len(ids) - 1 else None
        (out,) = op.process_outputs(EngineCoreOutputs([EngineCoreOutput(
            "d", [tid], new_logprobs=lp, finish_reason=fin)])).request_outputs
        comp = out.outputs[0]
        got += comp.token_ids
        text += comp.text
        assert len(comp.logprobs) == 1 and comp.logprobs[0][tid].rank == 2
        assert comp.logprobs[0][7].rank == 1
    assert got == ids and text == "hello world"
    assert comp.cumulative_logprob == pytest.approx(-0.5 * len(ids))


def test_compact_tokens_keep_the_reported_prefix_cache_hits(tokenizer):
    ids = tokenizer("hello world again", add_special_tokens=False).input_ids
    op = OutputProcessor(tokenizer)
    params = SamplingParams(output_kind=RequestOutputKind.DELTA)
    parent = ParentRequest("c", 1, RequestOutputKind.DELTA)
    op.add_request(_request("c", ids, params), "p", parent, 0)
    (first,) = op.process_outputs(EngineCoreOutputs([EngineCoreOutput(
        "c", ids[:1], num_cached_tokens=16)])).request_outputs
    (second,) = op.process_outputs(EngineCoreOutputs(
        token_req_ids=["c"], token_ids=ids[1:2])).request_outputs
    assert first.num_cached_tokens == second.num_cached_tokens == 16
    assert second.outputs[0].token_ids == ids[1:2]


@pytest.mark.parametrize("include_stop", [False, True])
def test_the_stop_token_that_ends_a_request_is_not_in_its_text_as_in_vllm(tokenizer,
                                                                          include_stop):
    ids = tokenizer("hello world", add_special_tokens=False).input_ids
    eos = tokenizer.eos_token_id
    op = OutputProcessor(tokenizer)
    params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=include_stop,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    op.add_request(_request("s", ids, params), "p", ParentRequest("s", 1, params.output_kind), 0)
    (out,) = op.process_outputs(EngineCoreOutputs([EngineCoreOutput(
        "s", [*ids, eos], finish_reason=FinishReason.STOP)])).request_outputs
    comp = out.outputs[0]
    assert comp.token_ids == [*ids, eos]  # the token stays among the ids
    assert comp.text == ("hello world</s>" if include_stop else "hello world")
