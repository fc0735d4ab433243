"""EAGLE and EAGLE-3 speculative decoding through the engine: the oracles are an independent
torch reference of each head's drafts (tests/engine/eagle_heads.py) and the same
engine without speculation.

The heads are tiny random ones saved in vLLM's layouts over a 4-layer tiny Llama
(EAGLE-3 reads the residual streams entering layers 1, 2 and 3). The drafts the
engine proposes must be the reference's, token for token, through chunked prefill
and prefix-cache hits (a wrong alignment of tokens and hidden states, a wrong
concatenation order or a stale hidden state changes them); greedy output must equal
no speculation's under chunked prefill, prefix caching and preemption; at
temperature 1 the verified tokens' distributions must equal it; nothing compiles
after warm-up; and a bad head is refused naming `speculative_config.model`. At
tensor_parallel_size 2 (fake CPU devices) the head splits like the target and its
drafts and greedy output must be the one-device engine's.
"""

from __future__ import annotations

import json

import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.config import EngineArgs
from jaxllm.errors import ParameterError
from jaxllm.spec_decode.config import SpeculativeConfig
from jaxllm.worker.step_inputs import pack_step_inputs
from tests.engine.eagle_heads import (
    H,
    make_eagle_head,
    record_proposals,
    reference_drafts_match,
)
from tests.engine.test_spec_decode import (
    BASE,
    WHOLE,
    _assert_same,
    _record_spec_stats,
    _run,
    _totals,
    assert_no_compilation_while_speculating,
    assert_same_token_distribution,
)
from tests.engine.test_spec_draft_model import _reference as draft_reference
from tests.engine.test_spec_draft_model import run_twice_with_prefix_hits
from tests.models.tiny_checkpoints import make_tiny_checkpoint
from tests.own_process import isolated, run_in_own_process

METHODS = ("eagle", "eagle3")



@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny float32 Llama of 4 layers (EAGLE-3 reads three of them)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), arch="llama",
                                num_key_value_heads=2, num_hidden_layers=4)


@pytest.fixture(scope="module")
def heads(tmp_path_factory, model_dir) -> dict[str, str]:
    """Per method a random head (nearly every draft rejected) and a copying one (runs of
    accepted drafts: eagle_heads.make_eagle_head's `copy_of`)."""
    root = tmp_path_factory.mktemp("heads")
    out = {m: make_eagle_head(root / m, m) for m in METHODS}
    out.update({f"{m}-copy": make_eagle_head(root / f"{m}-copy", m, copy_of=model_dir)
                for m in METHODS})
    return out


@pytest.fixture(scope="module")
def prompts(model_dir):
    from tests.engine.hf_reference import random_prompts

    rand = random_prompts(256, [7, 12, 30, 19, 5, 26], seed=3)
    return [rand[0] * 2, rand[1], rand[1] + rand[4], rand[2], rand[3], rand[5]]


def spec_config(method: str, head: str, k: int = 3) -> dict:
    return {"method": method, "model": head, "num_speculative_tokens": k}


def _reference(model_dir, prompts, extra_id, extra):
    """No speculation's greedy and early-stopping outputs on this module's engine settings
    (test_spec_draft_model's reference, shorter: the tiny target's context is smaller)."""
    return draft_reference(model_dir, prompts, extra_id, extra, base=BASE, max_tokens=24,
                           stops=(9, 17, 5, 20, 22, 13))


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("variant, extra", [("", {}), ("-copy", WHOLE)],
                         ids=["random-plain", "copying-whole-prompts"])
def test_proposed_drafts_equal_an_independent_reference(model_dir, heads, prompts, method,
                                                        variant, extra):
    """Random heads under chunked prefill; copying heads (accepted runs, so a request's
    next proposal starts past several verified drafts) on whole prompts."""
    head = heads[method + variant]
    llm = LLM(model_dir, **{**BASE, **extra}, speculative_config=spec_config(method, head))
    recorded = record_proposals(llm)
    stats = _record_spec_stats(llm)
    _run(llm, prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    if variant:
        assert _totals(stats)[2] > 0
    assert reference_drafts_match(head, model_dir, recorded) >= 60


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("variant, extra_id, extra", [
    ("", "plain", {}),
    ("-copy", "plain", {}),
    ("-copy", "whole-prompts", WHOLE),
    ("-copy", "preemption", {"num_kv_blocks": 20}),
], ids=lambda v: {"": "random", "-copy": "copying"}.get(v, v) if isinstance(v, str) else None)
def test_greedy_output_equals_no_speculation(model_dir, heads, prompts, method, variant,
                                             extra_id, extra):
    greedy, want, mixed, want_mixed = _reference(model_dir, prompts, extra_id, extra)
    llm = LLM(model_dir, **{**BASE, **extra},
              speculative_config=spec_config(method, heads[method + variant]))
    stats = _record_spec_stats(llm)
    _assert_same(_run(llm, prompts, greedy), want)
    _assert_same(_run(llm, prompts, mixed), want_mixed)
    num_drafts, draft_tokens, accepted = _totals(stats)
    assert num_drafts > 0 and draft_tokens >= num_drafts  # the spec metrics count them
    if variant:  # runs of accepted drafts, and rejections
        assert 0 < accepted < draft_tokens
    core = llm.llm_engine.engine_core.engine_core
    if "num_kv_blocks" in extra:
        assert core.scheduler.num_preemptions > 0
    assert core.scheduler.kv_cache_manager.usage == 0.0  # every block came back


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_prefix_cache_hits_keep_greedy_output_and_the_reference_drafts(model_dir, heads,
                                                                       prompts, method):
    """A cached prompt skips the head's forward over its hit blocks: the drafts then read
    the head's KV and hidden states the earlier requests left in those blocks."""
    greedy, want, _, _ = _reference(model_dir, prompts, "plain", {})
    head = heads[f"{method}-copy"]
    llm = LLM(model_dir, **BASE, speculative_config=spec_config(method, head))
    recorded = run_twice_with_prefix_hits(llm, prompts, greedy, want, record_proposals)
    assert reference_drafts_match(head, model_dir, recorded[::3]) >= 60


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_temperature_one_distribution_equals_no_speculation(tmp_path, method):
    """The second and third tokens (the first verify step's two drafts) over many seeds,
    a two-sample chi-square test against the engine without speculation. A copying
    head: its drafts are accepted at times and rejected at others, so both the
    accepted drafts and the residual draws shape the counts."""
    model_dir = make_tiny_checkpoint(tmp_path, init_std=0.5, vocab_size=64,
                                     num_hidden_layers=4)
    head = make_eagle_head(tmp_path / "head", method, vocab_size=64, copy_of=model_dir)
    n = 1000
    params = [SamplingParams(temperature=1.0, max_tokens=4, seed=s, ignore_eos=True)
              for s in range(n)]
    kw = dict(BASE, max_num_seqs=32, request_buckets=[32], token_buckets=[32, 64],
              max_num_batched_tokens=64, max_model_len=40)
    num_drafts, draft_tokens, accepted = assert_same_token_distribution(
        model_dir, kw, spec_config(method, head, k=2), list(range(8, 24)), params,
        vocab_size=64)
    assert num_drafts >= n and 0 < accepted < draft_tokens, (num_drafts, draft_tokens,
                                                              accepted)


@pytest.mark.slow
def test_no_compilation_after_warmup_with_eagle_heads():
    """In a process of its own, as the ngram test (test_spec_decode.py) says why."""
    run_in_own_process(
        f"{__file__}::test_no_compilation_after_warmup_with_eagle_heads_in_this_process")


@isolated
# Each method at one mesh size and each mesh size with one method: the programs a
# method adds and those a mesh splits are warmed by the same precompile.
@pytest.mark.parametrize("method, tp", [("eagle", 1), ("eagle3", 2)])
def test_no_compilation_after_warmup_with_eagle_heads_in_this_process(model_dir, heads,
                                                                      prompts, method, tp):
    llm = LLM(model_dir, **BASE, tensor_parallel_size=tp, precompile=True,
              speculative_config=spec_config(method, heads[method]))
    assert_no_compilation_while_speculating(llm, prompts)


@pytest.mark.slow
# The interpreted Pallas TPU body with eagle3 passed here too, in ~4 minutes on two CPU
# cores; it is left out for the suite's time (the head's attention runs through the same
# shard_attention as the target's, which test_tensor_parallel_engine.py runs on every body).
@pytest.mark.parametrize("backend, method", [("reference", "eagle"), ("reference", "eagle3")])
def test_at_tp2_drafts_and_greedy_output_equal_one_devices(model_dir, heads, prompts, method,
                                                          backend):
    """The head split over 2 devices (its kv heads, MLP and tables, its KV cache on kv
    heads) proposes the one-device engine's drafts (on the reference body), step for
    step, and keeps greedy output equal to no speculation's. The target's captured
    states and the head's hidden-state cache sit whole on every device."""
    greedy, want, _, _ = _reference(model_dir, prompts, "plain", {})
    head = heads[f"{method}-copy"]
    recorded = {}
    for tp, body in ((1, "reference"), (2, backend)):
        llm = LLM(model_dir, **BASE, tensor_parallel_size=tp, attention_backend=body,
                  attention_interpret=body != "reference",
                  speculative_config=spec_config(method, head))
        recorded[tp] = record_proposals(llm)
        stats = _record_spec_stats(llm)
        _assert_same(_run(llm, prompts, greedy), want)
        assert 0 < _totals(stats)[2] < _totals(stats)[1]  # accepted and rejected drafts
    runner = llm.llm_engine.engine_core.engine_core.model_runner
    drafter = runner.spec.drafter
    assert runner.mesh.shape["model"] == 2
    assert drafter.kv_cache.addressable_shards[0].data.nbytes * 2 == drafter.kv_cache.nbytes
    assert drafter.hidden_cache.sharding.is_fully_replicated
    programs = runner.programs
    runner.kv_cache, *_, captured = programs.run_forward(runner.state, runner.kv_cache,
                                                         programs.dummy_inputs(16),
                                                         runner._no_prev)
    assert captured.sharding.is_fully_replicated
    assert len(recorded[2]) == len(recorded[1]) > 20
    for (ctx2, drafts2), (ctx1, drafts1) in zip(recorded[2], recorded[1], strict=True):
        assert (ctx2, drafts2.tolist()) == (ctx1, drafts1.tolist())
    assert reference_drafts_match(head, model_dir, recorded[2][::4]) >= 15


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_head_programs_at_tp2_all_reduce_rows_and_gather_no_state_or_cache(model_dir, heads,
                                                                           method):
    """The head's `follow` and `propose` at tp 2: the only collectives are all-reduces
    of `[tokens, H]` rows (the vocab-parallel embedding lookups; in `propose` also the
    row-parallel output and down projections) and, for the greedy drafts, each
    device's best logit and id per request (`[R, 2]`). Nothing gathers the captured
    or cached hidden states, the KV cache, the weights or the `[R, vocab]` logits."""
    from tests.sample.test_sampler_tp_collectives import _collectives

    llm = LLM(model_dir, **{**BASE, "precompile": False}, tensor_parallel_size=2,
              speculative_config=spec_config(method, heads[method]))
    runner = llm.llm_engine.engine_core.engine_core.model_runner
    drafter, b = runner.spec.drafter, runner.buckets
    h, r = H, b.max_num_seqs
    follow = drafter.follow_fn.lower(
        drafter.state, drafter.kv_cache, drafter.hidden_cache, runner.programs.dummy_inputs(16),
        runner.spec.no_drafts, drafter.dummy_hidden(16)).compile().as_text()
    assert {(kind, tuple(dims)) for kind, dims in _collectives(follow)} == {
        ("all-reduce", (16, h)), ("all-reduce", (r, h))}
    propose = drafter.propose_fn.lower(
        drafter.state, drafter.kv_cache, drafter.hidden_cache,
        pack_step_inputs(r, r, b.max_blocks_per_req)[0]).compile().as_text()
    assert sorted((kind, tuple(dims)) for kind, dims in _collectives(propose)) == [
        *[("all-gather", (r, 2))] * 2, *[("all-reduce", (r, h))] * 3]


def test_a_head_whose_heads_do_not_split_over_the_devices_is_refused(model_dir, tmp_path):
    """The target's 4 q heads split over 4 devices; a head of 2 cannot."""
    head = make_eagle_head(tmp_path / "head", "eagle",
                           extra={"num_attention_heads": 2, "num_key_value_heads": 2})
    with pytest.raises(ParameterError, match="num_attention_heads=2") as err:
        EngineArgs(model=model_dir, dtype="float32", max_model_len=64, tensor_parallel_size=4,
                   speculative_config=spec_config("eagle", head)).create_engine_config()
    assert err.value.field == "speculative_config.model"


def _engine_config(model_dir: str, spec: dict):
    return EngineArgs(model=model_dir, dtype="float32", max_model_len=64,
                      speculative_config=spec).create_engine_config()


@pytest.mark.parametrize("method", METHODS)
def test_the_cli_flag_reads_a_head_with_what_it_captures(model_dir, heads, method):
    import argparse

    from jaxllm.entrypoints.arg_utils import add_engine_args, engine_args_from

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(["--dtype", "float32", "--max-model-len", "64",
                            "--speculative-config",
                            json.dumps(spec_config(method, heads[method]))])
    ns.model = model_dir
    config = engine_args_from(ns).create_engine_config()
    head = config.eagle_head
    assert (config.speculative_config.method, head.method) == (method, method)
    assert head.capture == ((1, 2, 3) if method == "eagle3" else ())
    assert config.draft_model_config is None


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("bad", ["hidden-size", "no-fc", "architecture", "fc-width"])
def test_a_bad_head_is_refused_naming_the_field(model_dir, tmp_path, method, bad):
    kw = {"hidden-size": dict(extra={"hidden_size": 32}),
          "no-fc": dict(drop=("fc.weight",)),
          "architecture": dict(extra={"architectures": ["MistralForCausalLM"]}),
          # EAGLE-3: an fc over three layers, told to read two; EAGLE: an EAGLE-3 fc.
          "fc-width": dict(aux_layers=(1, 2)) if method == "eagle3" else
          dict(extra={"architectures": ["EagleLlamaForCausalLM"]})}[bad]
    layout = "eagle3" if bad == "fc-width" else method
    head = make_eagle_head(tmp_path / "head", layout, **kw)
    says = {"hidden-size": "hidden_size 32", "no-fc": "missing tensor 'fc.weight'",
            "architecture": "MistralForCausalLM", "fc-width": "fc.weight has shape"}[bad]
    with pytest.raises(ParameterError, match=says) as err:
        _engine_config(model_dir, spec_config(method, head))
    assert err.value.field == "speculative_config.model"


def test_eagle_methods_parse_as_vllm_spells_them(tmp_path):
    for method in METHODS:
        spec = SpeculativeConfig.from_dict(json.dumps(spec_config(method, str(tmp_path), k=2)))
        assert (spec.method, spec.model, spec.num_speculative_tokens) == (method,
                                                                          str(tmp_path), 2)
        with pytest.raises(ParameterError) as err:
            SpeculativeConfig.from_dict({"method": method, "num_speculative_tokens": 2})
        assert err.value.field == "speculative_config.model"
