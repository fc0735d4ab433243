"""On NVIDIA GPUs: what the GPU compiles gives transformers' greedy tokens (float32).

The CPU suite holds each Pallas kernel to its jnp oracle in interpret mode and each
family to transformers through the interpreted kernels. On a GPU the same kernels are
compiled (Triton and Mosaic GPU bodies, the small-step MoE kernels, qkv_rope) and the
engine runs under its GPU XLA flags (command buffers, their update mode, dependent
launch: jaxllm/xla_flags.py), none of which the CPU suite sees. A change to either is
checked on the device with

    JAX_PLATFORMS=cuda python3 -m pytest tests/engine/test_gpu_token_parity.py

at tp 1, and at tp 2 where two GPUs are visible. Skipped on other backends.
"""

from __future__ import annotations

import gc

import jax
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.layers import row_reduce
from tests.engine.hf_reference import hf_greedy, random_prompts
from tests.models.tiny_checkpoints import make_tiny_checkpoint

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu",
                                reason="compiles the GPU kernels: needs an NVIDIA GPU")

# Shapes the GPU kernels take (head_dim 64; a dense MLP, and 16 experts routed 4 at a
# time through the small-step kernels at decode), small enough to compile in seconds.
SHAPE = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
CASES = {
    "llama": dict(SHAPE, arch="llama", intermediate_size=512),
    "qwen3_moe": dict(SHAPE, arch="qwen3_moe", num_experts=16, num_experts_per_tok=4,
                      moe_intermediate_size=128),
    # The routed experts' small-step kernels beside a shared expert's dense MLP.
    "qwen2_moe": dict(SHAPE, arch="qwen2_moe", num_experts=16, num_experts_per_tok=4,
                      moe_intermediate_size=128, shared_expert_intermediate_size=256),
    # Grouped sigmoid routing in jnp before the same kernels; partial rotary (no qkv_rope).
    "glm4_moe": dict(SHAPE, arch="glm4_moe", n_routed_experts=16, num_experts_per_tok=4,
                     n_group=4, topk_group=2, moe_intermediate_size=128),
    # Attention sinks in the Triton body (and its split-KV combine), windows, yarn, and
    # biased experts with the clamped SwiGLU on the loop.
    # GPT-OSS's own clamp and slope: some transformers versions (5.17, the GPU image's)
    # fix them in code and ignore the config's; the CPU suite tests other values.
    "gpt_oss": dict(SHAPE, arch="gpt_oss", num_local_experts=8, num_experts_per_tok=2,
                    intermediate_size=128, sliding_window=16, swiglu_limit=7.0,
                    swiglu_alpha=1.702),
    # qkv_rope's q/k norms and yarn's factor on cos and sin, compiled.
    "qwen3-yarn": dict(SHAPE, arch="qwen3", intermediate_size=512, rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32)),
    # q/k norms over every head before the fused rope kernel, norms after attention and
    # MLP only, three sliding layers of four.
    "olmo3": dict(SHAPE, arch="olmo3", intermediate_size=512, sliding_window=16),
    # Groups off the powers of two: Qwen2.5-7B's 7 query heads a kv head (padded to 8 in
    # the Triton body), Phi-3's head_dim 96's like (24, in a cache padded to 32) at 3.
    "qwen2-group7": dict(arch="qwen2", hidden_size=112, num_attention_heads=7,
                         num_key_value_heads=1, head_dim=16, intermediate_size=256),
    "phi3-group3": dict(arch="phi3", hidden_size=144, num_attention_heads=6,
                        num_key_value_heads=2, intermediate_size=256),
}
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-parity")
    return {case: make_tiny_checkpoint(root, init_std=0.05, **kw)
            for case, kw in CASES.items()}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_tokens_equal_transformers_on_the_gpu(checkpoints, case, tp, monkeypatch):
    if tp > jax.device_count():
        pytest.skip(f"tp {tp} needs {tp} GPUs")
    # Split-K partials wherever the engine would take them at full size (the peer sum's
    # add-norm kernel adds them at tp 2), the tiny widths too.
    monkeypatch.setattr(row_reduce, "MIN_SPLIT_WIDTH", 16)
    model_dir = checkpoints[case]
    # One prompt shorter than a KV page, and prompts spanning several.
    prompts = random_prompts(256, [5, 17, 40, 3], seed=1)
    want, want_top = hf_greedy(model_dir, prompts, NEW_TOKENS)
    # A fixed, small KV pool: the budget would otherwise count the memory an earlier
    # case's engine still holds.
    # Two token buckets: decode steps (the small-step kernels) and 64-row steps, over which
    # the 65 prompt tokens are chunked (the grouped matmul, chunked prefill).
    llm = LLM(model=model_dir, dtype="float32", max_model_len=256, tensor_parallel_size=tp,
              num_gpu_blocks_override=256, max_num_seqs=4, max_num_batched_tokens=64,
              token_buckets=[8, 64], request_buckets=[4])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                                       logprobs=5),
                        use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    del llm
    gc.collect()
    assert got == want
    # float32 products in float32: JAX's TF32 default moved these by ~1e-3 and can flip
    # a near tie (layers/precision.py).
    errs = [abs(lp.logprob - hf[tok]) for o, tops in zip(outs, want_top, strict=True)
            for step, hf in zip(o.outputs[0].logprobs, tops, strict=True)
            for tok, lp in step.items() if tok in hf]
    assert len(errs) >= NEW_TOKENS * len(prompts) and max(errs) < 1e-4, max(errs)
