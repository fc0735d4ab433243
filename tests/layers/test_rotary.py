"""Rotary embedding: the inverse frequencies and the factor on cos and sin of every rope
type equal transformers' own (`ROPE_INIT_FUNCTIONS`), longrope's factor set follows the
engine's context."""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm.errors import ParameterError
from jaxllm.layers.rotary import RotaryEmbedding

_LONG = dict(short_factor=[1.0 + 0.05 * i for i in range(64)],
             long_factor=[1.0 + 0.5 * i for i in range(64)])


@pytest.mark.parametrize("params", [
    dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
         high_freq_factor=4.0, original_max_position_embeddings=8192),
    dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
    dict(rope_type="default", rope_theta=1000000.0),
    dict(rope_type="yarn", rope_theta=1000000.0, factor=4.0,
         original_max_position_embeddings=32768),
    dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, beta_fast=32, beta_slow=1,
         mscale=1.0, mscale_all_dim=0.707, original_max_position_embeddings=4096),
    dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, truncate=False,
         original_max_position_embeddings=4096, attention_factor=1.2),
    dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=4096,
         **_LONG),
])
def test_rope_inverse_frequencies_and_attention_factor_match_transformers(params):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072,
                      rope_parameters=dict(params))
    rope = RotaryEmbedding.from_hf_config(cfg, 128)
    if params["rope_type"] == "default":
        want, factor = 1.0 / params["rope_theta"] ** (np.arange(0, 128, 2) / 128), 1.0
    else:
        # Past the original context: longrope's long set, as the engine's 131072 tokens take.
        want, factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, "cpu", seq_len=131072)
        want = want.numpy()
    np.testing.assert_allclose(np.asarray(rope.inv_freq), want, rtol=1e-6)
    assert rope.scale == pytest.approx(factor, rel=1e-9)


def test_longrope_takes_its_short_factors_when_the_engine_context_stays_within_the_original():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072,
                      rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                           original_max_position_embeddings=4096, **_LONG))
    short, factor = ROPE_INIT_FUNCTIONS["longrope"](cfg, "cpu", seq_len=4096)
    for max_len, want in ((4096, short.numpy()), (4097, None)):
        rope = RotaryEmbedding.from_hf_config(cfg, 128, max_model_len=max_len)
        assert rope.scale == pytest.approx(factor)  # the 131072-token model's, either way
        if want is not None:
            np.testing.assert_allclose(np.asarray(rope.inv_freq), want, rtol=1e-6)
        else:
            assert not np.allclose(np.asarray(rope.inv_freq), short.numpy())
    bad = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_parameters=dict(
        rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=16,
        short_factor=[1.0] * 3, long_factor=[1.0] * 3))
    with pytest.raises(ParameterError, match="rope_parameters.long_factor.*needs 64"):
        RotaryEmbedding.from_hf_config(bad, 128)
