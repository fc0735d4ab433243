"""`jaxllm compile`: the demo model's programs, compiled by libtpu for a v5e:2x2 slice on
this CPU host, and the runner loading what the compile step wrote.

The demo model (head_dim 32, float32) fits a v5e at default KV sizing: the TPU
backend's cache is lane-padded to 128 (`tpu.padded_kv_cache_shape`), the layout
the TPU keeps, so no step converts the cache (a per-step copy of it, padded to
128 lanes, is what a 32-wide cache cost before).
"""

from __future__ import annotations

import re

import jax
import pytest

from jaxllm.config import EngineArgs
from jaxllm.distributed.tpu_topology import libtpu_available, topology_devices
from jaxllm.entrypoints.cli import main
from jaxllm.worker import aot_cache
from jaxllm.worker.tpu_compile import ProgramCompileError, compile_programs

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not libtpu_available(),
                                 reason="libtpu (the TPU compiler) is not installed; "
                                        "pyproject's test extra installs it")]

# One token bucket, one request bucket: every kind of program, few of each.
FLAGS = ["--max-model-len", "256", "--max-num-seqs", "8", "--max-num-batched-tokens", "32",
         "--token-buckets", "32", "--request-buckets", "8"]
ENGINE = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32, token_buckets=[32],
              request_buckets=[8])
# forward, logits, 3 one-program samplers, 7 adjust stages (every non-empty mix of
# penalties, logit bias and the structured-output token bitmask), 3 draw stages,
# logprobs, prompt logprobs
NUM_PROGRAMS = 1 + 1 + 3 + (2**3 - 1) + 3 + 1 + 1


def test_demo_model_compiles_for_v5e_2x2_and_prints_the_summary(tmp_path, capsys):
    rc = main(["compile", "--tpu-topology", "v5e:2x2", *FLAGS,
               "--compilation-cache-dir", str(tmp_path)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    out = captured.out
    lines = out.strip().splitlines()
    line = re.compile(r"^\S+\[\d+\]: compiled in [\d.]+s \(CPU [\d.]+s\); "
                      r"argument [\d.]+, temp [\d.]+, "
                      r"output [\d.]+ GiB( \(the compiler's estimate: [\d.]+ ms a run\))?$")
    programs = [ln for ln in lines if line.match(ln)]
    assert len(programs) == NUM_PROGRAMS, out
    names = {ln.split(":")[0] for ln in programs}
    assert len(names) == NUM_PROGRAMS, out  # every program is named for what it is
    assert {"forward[32]", "prompt_logprobs[32]", "sample[greedy][8]",
            "sample[top_k_top_p][8]"} <= names
    assert re.match(r"KV cache: \d+ blocks of 16 tokens", lines[-2]), lines[-2]
    m = re.fullmatch(rf"compiled {NUM_PROGRAMS} programs for v5e:2x2: peak HBM ([\d.]+) GiB "
                     r"of 16.00 GiB per chip", lines[-1])
    assert m and 0.0 < float(m.group(1)) < 16.0, lines[-1]


def test_demo_model_forward_at_default_sizing_holds_no_copy_of_the_kv_cache():
    """At default sizing the cache takes most of the chip's HBM. The forward's
    temporaries stay under 1% of the cache's bytes: any copy or relayout of the
    cache (even unpadded, a quarter of the lane-padded cache) would be >= 25%."""
    config = EngineArgs(**ENGINE).create_engine_config()
    report = compile_programs(config, topology_devices("v5e:1x1"), "v5e:1x1")
    forward = next(p for p in report.programs if p.name == "forward")
    assert report.kv_cache_bytes_per_chip > 8 * 2**30  # sized against the 16 GiB chip
    assert forward.temp_bytes < report.kv_cache_bytes_per_chip // 100, forward
    assert forward.alias_bytes >= report.kv_cache_bytes_per_chip  # updated in place
    assert report.peak_bytes <= report.hbm_bytes_per_chip


def test_kv_cache_larger_than_the_hbm_does_not_fit_and_the_error_names_the_program():
    # 4 layers x 4 K/V heads x 16 tokens x 128 lanes x 4 bytes = 128 KiB a block:
    # 140000 blocks are ~17 GiB, more than a v5e chip's 16.
    config = EngineArgs(**ENGINE, num_kv_blocks=140000).create_engine_config()
    with pytest.raises(ProgramCompileError,
                       match=r"forward\[32\] does not fit v5e:1x1"):
        compile_programs(config, topology_devices("v5e:1x1"), "v5e:1x1")


def test_demo_model_compiles_at_tensor_parallel_2(tmp_path):
    """The kv heads (2) split over 2 chips, each running the Pallas body on its own."""
    config = EngineArgs(**ENGINE, tensor_parallel_size=2, num_kv_blocks=4096,
                        compilation_cache_dir=str(tmp_path)).create_engine_config()
    report = compile_programs(config, topology_devices("v5e:2x2"), "v5e:2x2")
    assert len(report.programs) == NUM_PROGRAMS
    forward = next(p for p in report.programs if p.name == "forward")
    # The cache (head_dim 32 lane-padded to 128) is split over the 2 chips: each
    # holds half of it.
    assert report.kv_cache_bytes_per_chip * 2 == pytest.approx(
        4097 * 4 * 2 * 2 * 16 * 128 * 4, rel=1e-9)
    assert forward.argument_bytes >= report.kv_cache_bytes_per_chip


def test_the_runner_loads_the_programs_the_compile_step_wrote(tmp_path, monkeypatch):
    """On the same devices (here the CPU), a runner started on the compile step's cache
    directory loads every forward and prompt-logprobs program from it: the compile step
    builds the runner's programs and their cache keys."""
    from jaxllm import LLM

    monkeypatch.setattr(aot_cache, "_compiled", {})
    engine = dict(ENGINE, num_kv_blocks=64, compilation_cache_dir=str(tmp_path))
    config = EngineArgs(**engine).create_engine_config()
    report = compile_programs(config, jax.devices()[:1], "cpu")
    assert len(report.programs) == NUM_PROGRAMS
    written = sorted(p.name for p in (tmp_path / "jaxllm-aot").glob("*.jaxexe"))
    assert len(written) == 2

    monkeypatch.setattr(aot_cache, "_compiled", {})  # as a fresh process
    llm = LLM(**engine, precompile=True)
    runner = llm.llm_engine.engine_core.engine_core.model_runner
    assert (runner.aot_cache.traced, runner.aot_cache.loaded) == (0, 2)
    assert sorted(p.name for p in (tmp_path / "jaxllm-aot").glob("*.jaxexe")) == written
