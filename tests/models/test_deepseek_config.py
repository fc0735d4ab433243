"""DeepSeek-V2/V3 configs the engine cannot serve fail with an error naming the field."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from jaxllm import LLM
from jaxllm.errors import ParameterError
from jaxllm.models.deepseek import deepseek_arch
from tests.models.tiny_checkpoints import make_tiny_checkpoint


@pytest.mark.parametrize("arch,field,value", [
    ("deepseek_v3", "topk_method", "greedy"),
    ("deepseek_v2", "topk_method", "noaux_tc"),
    ("deepseek_v2", "qk_rope_head_dim", 7),
    ("deepseek_v3", "kv_lora_rank", 0),
])
def test_unsupported_settings_name_their_field(arch, field, value, tmp_path):
    cfg = AutoConfig.from_pretrained(make_tiny_checkpoint(tmp_path, arch=arch))
    setattr(cfg, field, value)
    with pytest.raises(ParameterError, match=f"config.json:{field}"):
        deepseek_arch(cfg)


def test_lora_is_refused_naming_enable_lora(tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path, arch="deepseek_v3")
    with pytest.raises(ParameterError, match="enable_lora"):
        LLM(model_dir, dtype="float32", max_model_len=64, max_num_seqs=2,
            max_num_batched_tokens=16, token_buckets=[16], request_buckets=[2],
            enable_lora=True, precompile=False)
