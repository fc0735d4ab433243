"""XLA options per step program (layers/quant.py's `xla_compiler_options`): on GPU an
fp8 program whose products run W8A8 compiles with Triton GEMMs off, and the engine
compiles each token bucket's forward and prompt-logprobs programs with its own options,
through the on-disk program cache and without it."""

from __future__ import annotations

import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.layers.quant import WEIGHT_ONLY_ENV, xla_compiler_options
from jaxllm.worker import aot_cache, programs
from tests.models.tiny_checkpoints import make_tiny_checkpoint

TRITON_OFF = {"xla_gpu_enable_triton_gemm": False}


def test_only_w8a8_fp8_programs_on_gpu_turn_triton_gemms_off(monkeypatch):
    monkeypatch.delenv(WEIGHT_ONLY_ENV, raising=False)
    assert xla_compiler_options("fp8", 65, "gpu") == TRITON_OFF
    assert xla_compiler_options("fp8_static", 8192, "gpu") == TRITON_OFF
    # Weight-only buckets keep Triton, which fuses the weight's upcast into the GEMM.
    assert xla_compiler_options("fp8", 64, "gpu") == {}
    for quantization in (None, "int8"):
        assert xla_compiler_options(quantization, 8192, "gpu") == {}
    assert xla_compiler_options("fp8", 8192, "tpu") == {}
    assert xla_compiler_options("fp8", 8192, "cpu") == {}
    monkeypatch.setenv(WEIGHT_ONLY_ENV, "0")
    assert xla_compiler_options("fp8", 1, "gpu") == TRITON_OFF


ENGINE = dict(dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
              block_size=8, token_buckets=[16, 64], request_buckets=[4], seed=0,
              num_kv_blocks=64, precompile=True)  # the programs the cache holds
PROMPTS = [{"prompt_token_ids": [5, 9, 11, 40, 7]}, {"prompt_token_ids": list(range(3, 40))}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.mark.slow
@pytest.mark.parametrize("aot", ["1", "0"])
def test_each_bucket_compiles_with_its_own_options_and_generates_the_same(aot, tmp_path,
                                                                          monkeypatch):
    model_dir = make_tiny_checkpoint(tmp_path, arch="llama")
    monkeypatch.setenv("JAXLLM_AOT_CACHE", aot)
    monkeypatch.setattr(aot_cache, "_compiled", {})

    def generate():
        llm = LLM(model_dir, compilation_cache_dir=str(tmp_path / "cache"), **ENGINE)
        runner = llm.llm_engine.engine_core.engine_core.model_runner
        out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        return runner, out

    _, want = generate()
    seen = []
    monkeypatch.setattr(programs, "xla_compiler_options",
                        lambda q, rows, platform: seen.append(rows) or
                        (TRITON_OFF if rows > 16 else {}))
    import jax

    compiled_with = []
    lowered = type(jax.jit(lambda x: x).lower(1.0))
    real = lowered.compile
    monkeypatch.setattr(lowered, "compile", lambda self, compiler_options=None:
                        compiled_with.append(compiler_options) or real(self, compiler_options))
    monkeypatch.setattr(aot_cache, "_compiled", {})
    runner, got = generate()
    assert sorted(set(seen)) == [16, 64]
    assert got == want
    # The 64-token bucket's forward and prompt-logprobs programs took the options.
    assert compiled_with.count(TRITON_OFF) == 2
    for name in ("forward", "prompt_logprobs"):
        assert ((name, runner.programs.dummy_inputs(64).shape[0])
                in runner.programs.executables)
