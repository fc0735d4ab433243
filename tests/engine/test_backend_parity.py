"""The whole engine on each Pallas attention body gives transformers' greedy tokens.

The Pallas bodies run in Pallas interpret mode on the CPU (`attention_interpret`,
the TPU one in TPU interpret mode), inside the engine's own jitted step: paged KV
writes, chunked prefill beside decodes, padding tokens and padded requests.
One token bucket and one request bucket keep the (slow) interpret compiles few.
"""

from __future__ import annotations

import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.layers import row_reduce
from jaxllm.layers.attention_backend import QKV_SPLIT_K
from tests.engine.hf_reference import hf_greedy, random_prompts
from tests.jaxprs import equations
from tests.models.tiny_checkpoints import checkpoint_vocab_size, make_tiny_checkpoint

NEW_TOKENS = 8
# Budget 32 per step: the 61-token prompt is cut into chunks that run beside the
# other requests' decodes. 32 tokens over 4 request slots is prefill-shaped for the
# GPU body, so its mixed steps run the one-token requests in their own call.
LENGTHS = [3, 61, 11]
ENGINE = dict(dtype="float32", max_model_len=96, max_num_seqs=4, max_num_batched_tokens=32,
              block_size=8, token_buckets=[32], request_buckets=[4], seed=0,
              precompile=False, enable_prefix_caching=False)


pytestmark = pytest.mark.slow  # the Pallas bodies in interpret mode


@pytest.fixture(scope="module")
def prompts(model_dir):
    return random_prompts(checkpoint_vocab_size(model_dir), LENGTHS, seed=7)


@pytest.fixture(scope="module")
def hf_tokens(model_dir, prompts):
    return hf_greedy(model_dir, prompts, NEW_TOKENS)[0]


@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu"])
def test_engine_on_a_pallas_body_in_interpret_mode_matches_transformers_greedy(
        backend, model_dir, prompts, hf_tokens, monkeypatch):
    # The GPU body's steps (all of them decode-shaped here) take the QKV product as
    # split-K partials, the tiny hidden size split too.
    monkeypatch.setattr(row_reduce, "MIN_SPLIT_WIDTH", 8)
    llm = LLM(model_dir, attention_backend=backend, attention_interpret=True, **ENGINE)
    runner = llm.llm_engine.engine_core.engine_core.model_runner
    assert (runner.attn_backend.name, runner.attn_backend.interpret) == (backend, True)
    programs = runner.programs
    args = (runner.state, runner.kv_cache, programs.dummy_inputs(32), runner._no_prev)
    traced = programs.forward.trace(*args[:4], programs.out_buffers(*args))
    split = [e for e in equations(traced.jaxpr.jaxpr, kernels=False)
             if e.primitive.name == "dot_general" and e.outvars[0].aval.ndim == 5]
    assert [e.outvars[0].aval.shape[0] for e in split] == (
        [QKV_SPLIT_K] * llm.llm_engine.model_config.hf_config.num_hidden_layers
        if backend == "pallas_gpu" else [])
    runner.step_log = []
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_tokens
    # The schedule did mix: prompt chunks beside other requests' decodes, e.g.
    # [3 + 29 of 61], [decode + 31 of 61], [decode + 1 of 61 + 11], ...
    mixed = [s for s in runner.step_log if s.num_reqs > 1 and s.num_tokens > s.num_reqs]
    assert len(mixed) >= 2, runner.step_log
    if backend == "pallas_gpu":
        from pallas_kernels.ragged_paged_attention import gpu

        hf = llm.llm_engine.model_config.hf_config
        heads, kv_heads = hf.num_attention_heads, hf.num_key_value_heads
        bs = gpu.default_block_sizes(32, 4, heads // kv_heads, runner.kv_layout.head_dim, 8,
                                     96 // 8, kv_heads, 4)
        assert bs.decode is not None  # the mixed steps took the two-call path


def test_the_gpu_body_serves_a_group_and_head_dim_that_are_not_powers_of_two(tmp_path):
    """Three query heads per kv head (Qwen2.5-7B has 7, -14B 5) and a 24-wide head
    (Phi-3's 96): the GPU cache rounds head_dim up to 32, the query heads are padded to 4
    a kv head around the Triton tiles, and the tokens are transformers'."""
    model_dir = make_tiny_checkpoint(tmp_path, arch="phi3", hidden_size=72,
                                     num_attention_heads=6, num_key_value_heads=2,
                                     head_dim=24)
    prompts = random_prompts(checkpoint_vocab_size(model_dir), LENGTHS, seed=3)
    llm = LLM(model_dir, attention_backend="pallas_gpu", attention_interpret=True, **ENGINE)
    runner = llm.llm_engine.engine_core.engine_core.model_runner
    assert runner.kv_cache.shape[-1] == 32
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(model_dir, prompts,
                                                               NEW_TOKENS)[0]


@pytest.mark.parametrize("tp", [1, 2])
def test_engine_on_the_fused_swiglu_kernel_in_interpret_mode_matches_transformers_greedy(
        tp, model_dir, prompts, hf_tokens, monkeypatch):
    """The MLP's gate/up projection through the Mosaic GPU SwiGLU kernel in interpret
    mode, and (without tensor parallelism) the output and down projections through
    the residual-add kernel. One 256-token bucket: every step, decodes included, is a
    multiple of the kernels' 256-row CTA tile. Under tensor parallelism the SwiGLU
    call runs per 'model' shard in shard_map; the interpreter cannot run two devices'
    kernels at once, so there the per-shard body is the kernel's reference (the
    sharding is what is tested). The row-parallel projections stay on XLA there."""
    from pallas_kernels.matmul_add import gpu_mgpu as ma_kernel
    from pallas_kernels.swiglu import gpu_mgpu, reference

    traced, traced_add = [], []
    real = gpu_mgpu.swiglu_up if tp == 1 else (lambda x, w, **_: reference.swiglu_up(x, w))
    real_add = ma_kernel.matmul_add

    def counting(x, w, **kw):
        traced.append((x.shape, w.shape))
        return real(x, w, **kw)

    def counting_add(x, w, residual, **kw):
        traced_add.append((x.shape, w.shape))
        return real_add(x, w, residual, **kw)

    monkeypatch.setattr(gpu_mgpu, "swiglu_up", counting)
    monkeypatch.setattr(ma_kernel, "matmul_add", counting_add)
    engine = dict(ENGINE, max_num_batched_tokens=256, token_buckets=[256])
    llm = LLM(model_dir, mlp_backend="pallas_gpu_mosaic", mlp_interpret=True,
              tensor_parallel_size=tp, **engine)
    runner = llm.llm_engine.engine_core.engine_core.model_runner
    assert (runner.swiglu.kernel, runner.swiglu.interpret) == (True, True)
    # Three tokens: the prefill step and two decode steps through the interpreted
    # kernels (each interpreted step is slow; more decodes test nothing new).
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [t[:3] for t in hf_tokens]
    inter = llm.llm_engine.model_config.hf_config.intermediate_size
    # Traced at the bucket's 256 rows, per shard under tp (the layers share one
    # nested program, so once per shape).
    assert traced and {x[0] for x, _ in traced} == {256}, traced
    assert {s[1] for _, s in traced} == {inter // tp}
    hf = llm.llm_engine.model_config.hf_config
    hidden, q_width = hf.hidden_size, hf.num_attention_heads * runner.kv_layout.head_dim
    want_add = {((256, q_width), (hidden, q_width)), ((256, inter), (hidden, inter))}
    assert set(traced_add) == (want_add if tp == 1 else set()), traced_add
