"""The on-disk program cache: a second start loads every forward instead of tracing it,
computes the same tokens, still donates the KV cache, and survives a damaged file."""

from __future__ import annotations

import logging

import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.worker import aot_cache

ENGINE = dict(dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
              block_size=8, token_buckets=[16, 64], request_buckets=[4], seed=0,
              num_kv_blocks=64, precompile=True)  # the programs the cache holds
PROMPTS = [{"prompt_token_ids": [5, 9, 11, 40, 7]}, {"prompt_token_ids": list(range(3, 40))}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _start(model_dir, cache_dir, monkeypatch):
    # A fresh process would have no compiled programs in memory: start without them.
    monkeypatch.setattr(aot_cache, "_compiled", {})
    llm = LLM(model_dir, compilation_cache_dir=str(cache_dir), **ENGINE)
    runner = llm.llm_engine.engine_core.engine_core.model_runner
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    return llm, runner, tokens


@pytest.mark.slow
def test_a_restart_loads_the_forward_programs_and_generates_the_same(model_dir, tmp_path,
                                                                     monkeypatch, caplog):
    _, first, want = _start(model_dir, tmp_path, monkeypatch)
    # One forward and one prompt-logprobs program per token bucket.
    assert (first.aot_cache.traced, first.aot_cache.loaded) == (4, 0)
    files = sorted((tmp_path / "jaxllm-aot").glob("forward-*.jaxexe"))
    assert len(files) == 2
    assert len(list((tmp_path / "jaxllm-aot").glob("prompt_logprobs-*.jaxexe"))) == 2

    _, second, got = _start(model_dir, tmp_path, monkeypatch)
    assert (second.aot_cache.traced, second.aot_cache.loaded) == (0, 4)
    assert got == want
    assert sorted((tmp_path / "jaxllm-aot").glob("forward-*.jaxexe")) == files

    # The loaded program still updates the KV cache in place (donation kept).
    kv0 = second.kv_cache
    ptr = kv0.unsafe_buffer_pointer()
    programs = second.programs
    args = (second.state, second.kv_cache, programs.dummy_inputs(16), second._no_prev)
    # the loaded program runs
    assert programs.executables.get(("forward", args[2].shape[0])) is not None
    second.kv_cache, *outs = programs.run_forward(*args)
    assert kv0.is_deleted()
    assert second.kv_cache.unsafe_buffer_pointer() == ptr

    # Its outputs are written over the bucket's previous ones: one address each, run
    # after run (programs.step_functions).
    ptrs = [o.unsafe_buffer_pointer() for o in outs]
    args = (second.state, second.kv_cache, programs.dummy_inputs(16), second._no_prev)
    second.kv_cache, *again = programs.run_forward(*args)
    assert all(o.is_deleted() for o in outs)
    assert [o.unsafe_buffer_pointer() for o in again] == ptrs

    # A damaged file is traced again (and rewritten); the other one still loads.
    files[0].write_bytes(b"not a program")
    with caplog.at_level(logging.WARNING, logger="jaxllm.worker.aot_cache"):
        _, third, again = _start(model_dir, tmp_path, monkeypatch)
    assert (third.aot_cache.traced, third.aot_cache.loaded) == (1, 3)
    assert "could not load the cached program" in caplog.text
    assert again == want
    assert files[0].read_bytes() != b"not a program"


def test_the_key_follows_code_context_and_shapes(tmp_path, monkeypatch):
    import jax
    import jax.numpy as jnp

    devices = jax.devices()[:1]

    def cache(context):
        return aot_cache.ExecutableCache(str(tmp_path), context, devices)

    x8, x16 = (jnp.zeros(8),), (jnp.zeros(16),)
    a = cache({"model": 1})
    assert a.path("f", x8) == cache({"model": 1}).path("f", x8)
    paths = {a.path("f", x8), a.path("f", x16), a.path("g", x8), a.path("f", (x8[0] > 0,)),
             cache({"model": 2}).path("f", x8)}
    monkeypatch.setattr(aot_cache, "code_fingerprint", lambda: "edited source")
    paths.add(cache({"model": 1}).path("f", x8))
    assert len(paths) == 6


def test_it_can_be_turned_off(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXLLM_AOT_CACHE", "0")
    assert aot_cache.ExecutableCache.create(str(tmp_path), {}, []) is None


@pytest.mark.slow
def test_the_mosaic_gpu_backend_keeps_the_caches_on(model_dir, tmp_path):
    """Its programs reload (the backend loads the Mosaic GPU runtime when made; see
    test_backend_loads_the_mosaic_gpu_runtime_when_made), so a warm start with it
    skips tracing and compiling like the others."""
    import jax

    from jaxllm.config import EngineArgs
    from jaxllm.worker.model_runner import ModelRunner

    # The Mosaic GPU backend on this CPU host: its interpret-mode build.
    config = EngineArgs(model=model_dir, compilation_cache_dir=str(tmp_path),
                        attention_backend="pallas_gpu_mosaic", attention_interpret=True,
                        **{**ENGINE, "precompile": False}).create_engine_config()
    runner = ModelRunner(config)
    assert runner.attn_backend.name == "pallas_gpu_mosaic"
    assert runner.aot_cache is not None
    assert runner.aot_cache.directory == str(tmp_path / "jaxllm-aot")
    assert jax.config.jax_enable_compilation_cache
    assert jax.config.jax_compilation_cache_dir == str(tmp_path)


def test_the_context_follows_the_moe_fp8_and_qkv_knobs(model_dir, monkeypatch):
    """Programs traced under another grouped-matmul body, small-step expert limit or body, fp8
    weight-only threshold, or with the qkv_rope kernel off are other programs: a run with a
    changed knob must not load them (a benchmark's A/B once timed the same program twice)."""
    import types

    import jax
    import numpy as np

    from jaxllm import EngineArgs
    from jaxllm.worker.programs import aot_context

    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("model",))
    attn = types.SimpleNamespace(name="xla", interpret=False)
    mlp = types.SimpleNamespace(name="xla", kernel=False, interpret=False, min_tokens=0)

    def context(quantization=None):
        config = EngineArgs(model=model_dir, quantization=quantization).create_engine_config()
        return aot_context(config, attn, mlp, mesh)

    for monkeypatch_env, quantization in [
            ({"JAXLLM_MOE_SMALL_TOKENS": "0"}, None),
            ({"JAXLLM_MOE_SMALL_KERNEL": "pallas"}, None),
            ({"JAXLLM_MOE_KERNEL": "tiled"}, None),
            ({"JAXLLM_QKV_KERNEL": "0"}, None),
            ({"JAXLLM_FP8_WEIGHT_ONLY_TOKENS": "0"}, "fp8")]:
        before = context(quantization)
        with monkeypatch.context() as m:
            for k, v in monkeypatch_env.items():
                m.setenv(k, v)
            assert context(quantization) != before, monkeypatch_env
