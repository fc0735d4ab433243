"""`speculative_config` as vLLM spells it: offline argument, CLI JSON flag, bad input."""

import argparse

import pytest

from jaxllm.config import EngineArgs
from jaxllm.entrypoints.arg_utils import add_engine_args, engine_args_from
from jaxllm.errors import ParameterError
from jaxllm.spec_decode.config import SpeculativeConfig


def test_ngram_config_takes_vllms_fields_and_defaults_one_lookup_bound_from_the_other():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4,
                                     "prompt_lookup_max": 3})
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (
        "ngram", 4, 3, 3)
    assert SpeculativeConfig.from_dict(None) is None


def test_cli_flag_parses_json_into_the_engine_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(["--speculative-config",
                            '{"method": "ngram", "num_speculative_tokens": 2}'])
    args = engine_args_from(ns)
    assert isinstance(args, EngineArgs)
    assert SpeculativeConfig.from_dict(args.speculative_config).num_speculative_tokens == 2


@pytest.mark.parametrize("raw, field", [
    ("{not json", "speculative_config"),
    ([1, 2], "speculative_config"),
    ({"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}, "speculative_config"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "speculative_config.method"),
    ({"method": "eagle5", "model": "/some/draft", "num_speculative_tokens": 2},
     "speculative_config.method"),
    # A model without a method is a draft model (as vLLM), and it must exist.
    ({"model": "/some/draft", "num_speculative_tokens": 2}, "speculative_config.model"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0},
     "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
     "speculative_config.prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "speculative_config.prompt_lookup_min"),
])
def test_bad_speculative_config_names_the_field(raw, field):
    with pytest.raises(ParameterError) as e:
        SpeculativeConfig.from_dict(raw)
    assert e.value.field == field


def test_spec_decoding_counts_cross_the_engine_core_socket_intact():
    from jaxllm.core.messages import EngineCoreOutputs, SchedulerStats, SpecDecodingStats
    from jaxllm.engine.codec import Codec

    codec = Codec()
    outs = EngineCoreOutputs(scheduler_stats=SchedulerStats(
        num_running_reqs=2, spec_decoding_stats=SpecDecodingStats(
            num_spec_tokens=3, num_drafts=2, num_draft_tokens=6, num_accepted_tokens=4,
            num_accepted_tokens_per_pos=[2, 1, 1])))
    assert codec.outputs_decoder.decode(codec.encode(outs)) == outs


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from tests.models.tiny_checkpoints import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("ckpts")
    return {"target": make_tiny_checkpoint(root, vocab_size=256),
            "small_vocab": make_tiny_checkpoint(root, vocab_size=128, num_hidden_layers=1),
            "short": make_tiny_checkpoint(root, max_position_embeddings=64)}


def test_a_draft_model_is_checked_against_the_target_and_kept_in_the_engine_config(
        checkpoints):
    config = EngineArgs(model=checkpoints["target"], max_model_len=64, speculative_config={
        "method": "draft_model", "model": checkpoints["short"],
        "num_speculative_tokens": 3}).create_engine_config()
    draft = config.draft_model_config
    assert config.speculative_config.method == "draft_model"
    assert (draft.model, draft.dtype, draft.max_model_len) == (
        checkpoints["short"], config.model_config.dtype, 64)


@pytest.mark.parametrize("draft, k, max_len, field", [
    ("small_vocab", 3, 64, "speculative_config.model"),  # another vocabulary
    ("short", 3, 128, "speculative_config.model"),  # shorter than the target's context
    ("short", 17, 64, "speculative_config.num_speculative_tokens"),
    ("short", 0, 64, "speculative_config.num_speculative_tokens"),
])
def test_bad_draft_model_config_names_the_field(checkpoints, draft, k, max_len, field):
    args = EngineArgs(model=checkpoints["target"], max_model_len=max_len, speculative_config={
        "method": "draft_model", "model": checkpoints[draft], "num_speculative_tokens": k})
    with pytest.raises(ParameterError) as e:
        args.create_engine_config()
    assert e.value.field == field
