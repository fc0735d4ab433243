"""GPT-OSS configs and checkpoints jaxllm cannot serve are ParameterErrors naming the field
or tensor (its logits, engine and tensor-parallel parity are in the families' tests)."""

from __future__ import annotations

import json
import os

import pytest
from transformers import GptOssConfig

from jaxllm.errors import ParameterError
from jaxllm.models.gpt_oss import gpt_oss_arch
from tests.models.test_model_parity import load
from tests.models.tiny_checkpoints import make_tiny_checkpoint

SHAPE = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, num_local_experts=6, num_experts_per_tok=2)


@pytest.mark.parametrize("fields,tp,match", [
    (dict(swiglu_limit=0.0), 1, "config.json:swiglu_limit: must be a positive number"),
    (dict(swiglu_alpha=float("nan")), 1, "config.json:swiglu_alpha: must be a positive"),
    (dict(layer_types=["sliding_attention", "chunked_attention"]), 1,
     "config.json:layer_types: 'chunked_attention' is not supported"),
    ({}, 4, "tensor_parallel_size: 4 does not divide the 6 experts"),
])
def test_unservable_config_is_a_parameter_error_naming_the_field(fields, tp, match):
    with pytest.raises(ParameterError, match=match):
        gpt_oss_arch(GptOssConfig(**SHAPE, **fields), tp)


def test_stacked_experts_of_another_shape_are_an_error_naming_the_tensor(tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path, arch="gpt_oss")
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["intermediate_size"] = 64
    with open(path, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ParameterError, match="'model.layers.0.mlp.experts.gate_up_proj' has "
                                             r"shape \(8, 64, 256\), but config.json implies "
                                             r"\(8, 64, 128\)"):
        load(model_dir)
