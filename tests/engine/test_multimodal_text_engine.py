"""Multimodal Gemma 3, Mistral 3 and Qwen-VL checkpoints serve text as transformers'
`Gemma3ForConditionalGeneration` / `Mistral3ForConditionalGeneration` /
`Qwen2_5_VLForConditionalGeneration` / `Qwen3VLForConditionalGeneration` run text-only
input ids (float32): greedy tokens, top-5 logprobs and prompt logprobs; chat renders
the checkpoint's template (Mistral 3's only in its processor's `chat_template.json`,
as released) and refuses an image part."""

from __future__ import annotations

import json
import os

import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.errors import ParameterError
from tests.engine.hf_reference import hf_greedy, hf_prompt_logprobs, random_prompts
from tests.models.tiny_checkpoints import CHAT_TEMPLATE
from tests.models.tiny_multimodal import MODEL_CLASSES, make_tiny_multimodal_checkpoint

NEW_TOKENS = 16
LENGTHS = [5, 13, 22]
ENGINE = dict(dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
              block_size=8, token_buckets=[32], request_buckets=[4], seed=0)
CASES = {
    # A local window shorter than the prompts, local and global rope bases.
    "gemma3-local-global": dict(
        family="gemma3", sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10.0),
                         "full_attention": dict(rope_type="linear", rope_theta=10000.0,
                                                factor=4.0)}),
    "mistral3-untied-head": dict(family="mistral3"),
    # Ministral 3 (the text model of the Ministral 3 releases): yarn past an original
    # context of 8, and the query scale growing from there.
    "mistral3-ministral3-query-scale": dict(family="mistral3", model_type="ministral3",
                                            rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=8,
        llama_4_scaling_beta=0.3)),
    # Qwen2.5-VL (q/k/v biases, the releases' tensor names) and Qwen3-VL (per-head q/k
    # norms, the module tree's names, tied): text tokens take their text model's rope.
    "qwen2_vl-text": dict(family="qwen2_vl"),
    "qwen2_5_vl-text": dict(family="qwen2_5_vl"),
    "qwen3_vl-text-tied": dict(family="qwen3_vl", tie_word_embeddings=True),
}

pytestmark = pytest.mark.slow  # an engine and transformers per family


def _template_for_the_processor_only(model_dir: str) -> None:
    os.remove(os.path.join(model_dir, "chat_template.jinja"))
    with open(os.path.join(model_dir, "chat_template.json"), "w") as f:
        json.dump({"chat_template": CHAT_TEMPLATE}, f)


@pytest.fixture(scope="module", params=list(CASES))
def served(request, tmp_path_factory):
    """(family, checkpoint, its LLM)."""
    fields = dict(CASES[request.param])
    family = fields.pop("family")
    model_dir = make_tiny_multimodal_checkpoint(tmp_path_factory.mktemp(request.param),
                                                family, **fields)
    if family == "mistral3":
        _template_for_the_processor_only(model_dir)
    return family, model_dir, LLM(model_dir, **ENGINE)


def test_greedy_tokens_top5_logprobs_and_prompt_logprobs_match_the_wrapper_in_transformers(
        served):
    family, model_dir, llm = served
    assert llm.llm_engine.model_config.checkpoint_architecture == MODEL_CLASSES[family].__name__
    prompts = random_prompts(256, LENGTHS, seed=len(family))
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5,
                            prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ref_tokens, ref_top = hf_greedy(model_dir, prompts, NEW_TOKENS,
                                    model_cls=MODEL_CLASSES[family])
    ref_prompt = hf_prompt_logprobs(model_dir, prompts, model_cls=MODEL_CLASSES[family])
    for out, want, want_top, want_prompt, prompt in zip(outs, ref_tokens, ref_top, ref_prompt,
                                                        prompts, strict=True):
        got_prompt = [lp[t].logprob for t, lp in zip(prompt[1:], out.prompt_logprobs[1:],
                                                     strict=True)]
        assert max(abs(g - w) for g, w in zip(got_prompt, want_prompt, strict=True)) < 1e-4
        assert out.outputs[0].token_ids == want
        for got_lp, ref_lp in zip(out.outputs[0].logprobs, want_top, strict=True):
            top5 = {t: lp.logprob for t, lp in got_lp.items() if lp.rank is not None
                    and lp.rank <= 5}
            assert set(top5) == set(ref_lp)
            assert max(abs(top5[t] - lp) for t, lp in ref_lp.items()) < 1e-4


def test_chat_renders_the_checkpoints_template_and_refuses_an_image_part(served):
    _, _, llm = served
    params = SamplingParams(temperature=0.0, max_tokens=2)
    text_parts = [{"type": "text", "text": "count "}, {"type": "text", "text": "to 3"}]
    out = llm.chat([{"role": "user", "content": text_parts}], params, use_tqdm=False)[0]
    assert out.prompt == "<s><|user|>count to 3\n<|assistant|>"
    assert out.prompt_token_ids == llm.get_tokenizer()(out.prompt,
                                                       add_special_tokens=False).input_ids
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(ParameterError, match=r"^messages\[1\]\.content: content part type "
                                             r"'image_url' is not supported"):
        llm.chat([{"role": "system", "content": "be brief"},
                  {"role": "user", "content": [image, text_parts[0]]}], params, use_tqdm=False)
    with pytest.raises(ParameterError, match=r"^messages\[1\]\[0\]\.content: content part "
                                             r"type 'input_audio'"):
        llm.chat([[{"role": "user", "content": "hi"}],
                  [{"role": "user", "content": [{"type": "input_audio"}]}]], params,
                 use_tqdm=False)
