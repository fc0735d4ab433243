"""The whole engine under tensor parallelism on fake CPU devices, for every attention body.

A GQA checkpoint with 4 q heads over 2 kv heads: at tp 2 each device holds one kv
head, at tp 4 each kv head is replicated on two devices. At tp 8 a checkpoint with
the 70B's 8 kv heads (four q heads to each) puts one kv head on each device.
The workload is chunked (a 16-token budget), shares a prefix, runs twice (prefix-cache
hits) and fits a KV cache too small for all of it (preemption). Greedy tokens must be
transformers' (float32) at every tp and on every body, with no compilation
after start-up. The Pallas bodies run in interpret mode. The Gemma families
(sliding windows shorter than the prompts, attention and final soft-caps, local
and global ropes) and DeepSeek-V3 (latent attention) run the same workload at tp 2
on every body, the mixture-of-experts ones (Mixtral, Qwen3-MoE: experts split over
the devices; plain GQA attention) on the reference body.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.layers import row_reduce
from jaxllm.sample.metadata import variant_metadata
from tests.compilations import generate_recording_compilations
from tests.engine.hf_reference import hf_greedy, random_prompts
from tests.jaxprs import equations
from tests.models.tiny_checkpoints import checkpoint_vocab_size, make_tiny_checkpoint

NEW_TOKENS = 6
HEADS, KV_HEADS, LAYERS = 4, 2, 2
ENGINE = dict(dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
              block_size=8, token_buckets=[16], request_buckets=[4], seed=0,
              enable_prefix_caching=True, num_kv_blocks=7)
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
_COLLECTIVE = re.compile(r"= (\S+) (all-reduce|all-gather|reduce-scatter|all-to-all|"
                         r"collective-permute)(?:-start)?\(")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), arch="llama",
                                num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                                num_hidden_layers=LAYERS)


FAMILIES = {
    "gemma2": dict(arch="gemma2", sliding_window=8, attn_logit_softcapping=2.0,
                   final_logit_softcapping=3.0, query_pre_attn_scalar=24,
                   tie_word_embeddings=True),
    "gemma3": dict(arch="gemma3", sliding_window=8,
                   layer_types=["sliding_attention", "full_attention"],
                   rope_parameters={"sliding_attention": dict(rope_type="default",
                                                              rope_theta=10.0),
                                    "full_attention": dict(rope_type="linear",
                                                           rope_theta=10000.0, factor=4.0)}),
    # q/k norms over every head (a sum across the shards), norms after attention and
    # MLP only, a sliding layer then a full one.
    "olmo3": dict(arch="olmo3", sliding_window=8,
                  layer_types=["sliding_attention", "full_attention"]),
    # Attention and MLP side by side on one LayerNorm, interleaved rope, NoPE full layers.
    "cohere2": dict(arch="cohere2", sliding_window=8, logit_scale=0.25,
                    layer_types=["sliding_attention", "full_attention"]),
    # Expert parallel: each device holds 2 of Mixtral's 4 experts, 4 of Qwen3-MoE's 8
    # (its layer 1 a dense MLP, column/row parallel).
    "mixtral": dict(arch="mixtral"),
    "qwen3_moe": dict(arch="qwen3_moe", num_experts=8, mlp_only_layers=[1]),
    # DeepSeek-V3's latent attention: the one latent kv head copied on both devices, the
    # query heads (and their kv_b_proj slices) split; experts split, the shared one
    # column/row parallel.
    "deepseek_v3": dict(arch="deepseek_v3", num_key_value_heads=HEADS),
}


def workload(model_dir: str) -> list[list[int]]:
    vocab = checkpoint_vocab_size(model_dir)
    shared = random_prompts(vocab, [24], seed=3)[0]
    tails = random_prompts(vocab, [16, 6, 5], seed=4)
    return [shared + tails[0], shared + tails[1], tails[2]]


@pytest.fixture(scope="module")
def prompts(model_dir):
    return workload(model_dir)


@pytest.fixture(scope="module")
def hf_tokens(model_dir, prompts):
    return hf_greedy(model_dir, prompts, NEW_TOKENS)[0]


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.engine_core.model_runner


@pytest.mark.slow
@pytest.mark.parametrize("backend,tp", [
    ("reference", 1), ("reference", 2), ("reference", 4),
    ("pallas_gpu", 2), ("pallas_gpu", 4), ("pallas_tpu", 2), ("pallas_tpu", 4)])
def test_greedy_under_tensor_parallelism_matches_transformers_with_chunks_hits_and_preemption(
        backend, tp, model_dir, prompts, hf_tokens, monkeypatch):
    # The GPU body's decode-shaped steps take the QKV product as split-K partials
    # (`qkv_parts`), sharded by kv head as the projection is; the tiny width splits too.
    monkeypatch.setattr(row_reduce, "MIN_SPLIT_WIDTH", 8)
    # Warmed up at tp 2 on each body: then nothing compiles while it serves.
    runner = _runner(_run_case((model_dir, prompts, hf_tokens), backend, tp,
                               precompile=tp == 2))
    programs = runner.programs
    args = (runner.state, runner.kv_cache, programs.dummy_inputs(16), runner._no_prev)
    traced = programs.forward.trace(*args[:4], programs.out_buffers(*args))
    split = [e for e in equations(traced.jaxpr.jaxpr, kernels=False)
             if e.primitive.name == "dot_general" and e.outvars[0].aval.ndim == 5]
    assert len(split) == (LAYERS if backend == "pallas_gpu" else 0)

    # Each device holds its own kv heads: 1/tp of the one-device cache where the kv
    # heads divide, one (replicated) head of the two where they do not.
    shard = runner.kv_cache.addressable_shards[0].data
    one_device = runner.kv_cache.nbytes * KV_HEADS // max(KV_HEADS, tp)
    assert shard.nbytes == one_device // min(tp, KV_HEADS)


@pytest.fixture(scope="module")
def gqa8_model(tmp_path_factory):
    """Llama-3-70B's 8 kv heads in small (four q heads to each, where the 70B has eight):
    at tp 8 each device holds one kv head and its q heads, as run_multi_gpu.sh's 70B
    tp 8 steps would, which no eight-GPU machine has run."""
    return _case(make_tiny_checkpoint(tmp_path_factory.mktemp("gqa8"), hidden_size=128,
                                      head_dim=16, intermediate_size=256,
                                      num_attention_heads=32, num_key_value_heads=8,
                                      num_hidden_layers=LAYERS))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["reference", "pallas_gpu", "pallas_tpu"])
def test_tp8_one_kv_head_a_device_matches_transformers_with_chunks_hits_and_preemption(
        backend, gqa8_model):
    runner = _runner(_run_case(gqa8_model, backend, 8))
    assert runner.kv_cache.addressable_shards[0].data.nbytes == runner.kv_cache.nbytes // 8


@pytest.fixture(scope="module")
def family(request, tmp_path_factory) -> tuple[str, list[list[int]], list[list[int]]]:
    """(checkpoint, prompts, transformers' greedy tokens) of a tiny model per family."""
    fields = dict(num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                  num_hidden_layers=LAYERS) | FAMILIES[request.param]
    return _case(make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), **fields))


# The mixture-of-experts families' attention is the Llama checkpoint's (plain GQA, whose
# Pallas bodies run at tp 2 above): on the reference body they check the experts' split.
_PLAIN_ATTENTION = ("mixtral", "qwen3_moe")


@pytest.mark.slow
@pytest.mark.parametrize("family, backend", [
    (f, b) for f in FAMILIES for b in ("reference", "pallas_gpu", "pallas_tpu")
    if b == "reference" or f not in _PLAIN_ATTENTION], indirect=["family"])
def test_other_families_at_tp2_match_transformers_with_chunks_hits_and_preemption(
        backend, family):
    _run_case(family, backend, 2)


def _case(model_dir: str) -> tuple[str, list[list[int]], list[list[int]]]:
    """(checkpoint, its workload's prompts, transformers' greedy tokens for them)."""
    case_prompts = workload(model_dir)
    return model_dir, case_prompts, hf_greedy(model_dir, case_prompts, NEW_TOKENS)[0]


def _run_case(case: tuple[str, list[list[int]], list[list[int]]], backend: str,
              tp: int, precompile: bool = False) -> LLM:
    """An engine on `case`'s checkpoint at `tp`, checked on its workload (below)."""
    model_dir, case_prompts, want = case
    llm = LLM(model_dir, attention_backend=backend, attention_interpret=backend != "reference",
              tensor_parallel_size=tp, **{**ENGINE, "precompile": precompile})
    _check_workload(llm, case_prompts, want, tp, precompile)
    return llm


def _check_workload(llm: LLM, prompts: list[list[int]], hf_tokens: list[list[int]],
                    tp: int, precompiled: bool) -> None:
    """The workload twice: transformers' tokens both times, with prefix-cache hits and
    preemptions on the way. Nothing compiles on the second pass, nor on the first
    after a precompiled start-up."""
    assert _runner(llm).mesh.shape["model"] == tp
    runs, compiles = generate_recording_compilations(llm, prompts, GREEDY)
    for outs in runs:
        assert [o.outputs[0].token_ids for o in outs] == hf_tokens
    stats = llm.llm_engine.last_stats
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert compiles[1] == [] and (compiles[0] == [] or not precompiled)


def _collectives(hlo: str) -> Counter:
    return Counter(kind for _, kind in _COLLECTIVE.findall(hlo))


def test_tp2_forward_writes_its_outputs_over_its_last_ones(model_dir):
    """A moved result makes XLA update every device's command buffers before a launch,
    so the forward writes its outputs over the bucket's previous ones, placed whole on
    every device (programs.step_functions): from the second run on they keep their
    addresses, and the previous run's arrays are consumed."""
    llm = LLM(model_dir, tensor_parallel_size=2, **{**ENGINE, "precompile": False})
    runner = _runner(llm)

    def run():
        runner.kv_cache, *outs = runner.programs.run_forward(
            runner.state, runner.kv_cache, runner.programs.dummy_inputs(16), runner._no_prev)
        assert all(len(o.sharding.device_set) == 2 and o.sharding.is_fully_replicated
                   for o in outs)
        return outs

    outs = run()
    addresses = [o.addressable_shards[0].data.unsafe_buffer_pointer() for o in outs]
    again = run()
    assert all(o.is_deleted() for o in outs)
    assert [o.addressable_shards[0].data.unsafe_buffer_pointer() for o in again] == addresses


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["reference", "pallas_gpu"])
def test_compiled_step_at_tp2_has_two_all_reduces_per_layer_and_no_kv_gather(
        backend, model_dir):
    """Per layer one all-reduce after the attention's output projection and one after
    the MLP's down projection (both row parallel), plus one for the vocab-parallel
    embedding (each device looks up its vocab rows, zeros elsewhere, summed). Nothing
    gathers the KV cache or the activations. Greedy sampling gathers each device's
    best logit and its id per request (`[R, tp]`), never the `[R, vocab]` logits."""
    llm = LLM(model_dir, attention_backend=backend, attention_interpret=backend != "reference",
              tensor_parallel_size=2, **{**ENGINE, "precompile": False})
    runner = _runner(llm)
    programs = runner.programs
    args = (runner.state, runner.kv_cache, programs.dummy_inputs(16), runner._no_prev)
    forward = programs.forward.lower(*args[:4], programs.out_buffers(*args)
                                     ).compile().as_text()
    assert _collectives(forward) == {"all-reduce": 2 * LAYERS + 1}
    for shape, _ in _COLLECTIVE.findall(forward):
        assert shape.startswith("f32[16,64]") or shape.startswith("f32[4,64]"), shape

    runner.kv_cache, _, last_hidden, out_index = programs.run_forward(*args)
    s = runner.buckets.max_num_seqs
    greedy = next(md for md in variant_metadata(s, runner.vocab_size,
                                                runner.input_batch.sampling.device_put,
                                                out_index) if md.all_greedy)
    sample = programs.sample_fn.lower(programs.head, last_hidden, greedy, size=s)
    gathered = _COLLECTIVE.findall(sample.compile().as_text())
    assert gathered and all(kind == "all-gather" and re.match(rf"[fs]32\[{s},2\]", shape)
                            for shape, kind in gathered), gathered


@pytest.mark.slow
def test_compiled_moe_step_at_tp2_all_reduces_like_a_dense_one_and_gathers_no_expert(
        tmp_path):
    """Expert parallel: the experts' partial outputs meet in one all-reduce per layer,
    where a dense MLP's down projection has its own; no expert weight, activation or
    routing is gathered (each device reads only its own experts)."""
    model_dir = make_tiny_checkpoint(tmp_path, num_attention_heads=HEADS,
                                     num_key_value_heads=KV_HEADS, num_hidden_layers=LAYERS,
                                     **FAMILIES["mixtral"])
    llm = LLM(model_dir, attention_backend="reference", tensor_parallel_size=2,
              **{**ENGINE, "precompile": False})
    runner = _runner(llm)
    programs = runner.programs
    args = (runner.state, runner.kv_cache, programs.dummy_inputs(16), runner._no_prev)
    forward = programs.forward.lower(*args[:4], programs.out_buffers(*args)
                                     ).compile().as_text()
    assert _collectives(forward) == {"all-reduce": 2 * LAYERS + 1}
    for shape, _ in _COLLECTIVE.findall(forward):
        assert shape.startswith("f32[16,64]") or shape.startswith("f32[4,64]"), shape


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_row_parallel_sums_under_shard_map_match_transformers(arch, tmp_path, monkeypatch):
    """The route the peer all-reduce takes on GPUs (layers/row_reduce.py): the output
    and down projections, and the experts' partial outputs, summed inside `shard_map`
    for the steps the kernel takes (here every step: `psum` stands in for the kernel on
    CPU devices), and the vocab-parallel embedding's lookup. The workload's tokens are
    still transformers', and the forward's program holds one explicit sum per
    row-parallel product and one for the lookup. Each dense product's sum takes the
    residual add and the next norm with it (`product_add_norm`, one kernel on GPUs),
    its product as split-K float32 partials that the sum adds (here the tiny shapes
    split too); the experts' float32 partial sums do not."""
    monkeypatch.setenv(row_reduce.ENV, "psum")
    monkeypatch.setattr(row_reduce, "MIN_SPLIT_WIDTH", 8)
    case = _case(make_tiny_checkpoint(tmp_path, num_attention_heads=HEADS,
                                      num_key_value_heads=KV_HEADS, num_hidden_layers=LAYERS,
                                      **FAMILIES.get(arch, {})))
    runner = _runner(_run_case(case, "reference", 2))
    assert runner.row_reduce.mode == "psum"
    programs = runner.programs
    args = (runner.state, runner.kv_cache, programs.dummy_inputs(16), runner._no_prev)
    traced = programs.forward.trace(*args[:4], programs.out_buffers(*args))
    assert str(traced.jaxpr).count("psum") == 2 * LAYERS + 1
    # A sum with its add and norm: a shard_map holding the sum and the norm's rsqrt.
    fused = [e for e in equations(traced.jaxpr.jaxpr) if e.primitive.name == "shard_map"
             and {"psum", "rsqrt"} <= {i.primitive.name for i in equations(
                 e.params["jaxpr"])}]
    # Every layer's output projection, and each dense MLP's down projection (Qwen3-MoE's
    # layer 1).
    assert len(fused) == LAYERS + (LAYERS if arch == "llama" else 1)
    for e in fused:  # each product as row_reduce.SPLIT_K partials, summed before the psum
        dots = [i for i in equations(e.params["jaxpr"]) if i.primitive.name == "dot_general"]
        assert [d.outvars[0].aval.shape[0] for d in dots] == [row_reduce.SPLIT_K]
        assert dots[0].outvars[0].aval.ndim == 3
