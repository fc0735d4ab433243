"""`jaxllm compile [MODEL] --tpu-topology v5e:2x2`: the engine's programs, compiled by the
TPU compiler for a TPU slice, on a host with no TPU (jaxllm/worker/tpu_compile.py).

Prints one line per program (compile time; argument, temp and output bytes per
chip from the compiler's memory analysis), the KV cache the runner would
allocate on that chip, and a summary line. A program the compiler rejects, or
one that does not fit the chip's HBM, fails with its name and bucket.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import Any

from jaxllm.entrypoints.arg_utils import add_engine_args, engine_args_from
from jaxllm.errors import ParameterError


def add_compile_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "compile", help="compile the engine's programs for a TPU slice (no TPU needed)",
        description="Build every program `jaxllm serve` precompiles on a TPU slice (each token "
                    "bucket's forward, the sampler, the prompt-logprobs program), with the KV "
                    "cache sized for the chip's HBM, and compile them with libtpu's TPU "
                    "compiler on this host. Needs the libtpu wheel (pip install 'jax[tpu]').")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="checkpoint directory (same as --model; only config.json is read)")
    p.add_argument("--tpu-topology", required=True,
                   help="the slice, as <generation>:<chips>: v5e:2x2, v6e:1x1, v6e:2x4, "
                        "v5p:2x2x1, v4:2x2x1")
    add_engine_args(p)
    p.set_defaults(func=cmd_compile)
    return p


def cmd_compile(ns: argparse.Namespace) -> int:
    if ns.model_tag is not None:
        if ns.model is not None and ns.model != ns.model_tag:
            raise ParameterError("model", f"given twice: {ns.model_tag!r} and {ns.model!r}")
        ns.model = ns.model_tag
    # The programs run on the slice's compile-only devices; this host's own backend
    # only traces, so it need not (and on a host without a TPU cannot) be a TPU.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])
    # A compile-only client can write the persistent cache but not load from it: an
    # entry found there is compiled again, which is all this command does anyway.
    warnings.filterwarnings("ignore", message="Error reading persistent compilation cache")
    from jaxllm.distributed.tpu_topology import topology_devices
    from jaxllm.worker.tpu_compile import ProgramCompileError, compile_programs

    devices = topology_devices(ns.tpu_topology)
    config = engine_args_from(ns).create_engine_config()

    def show(report: Any) -> None:
        print(report.line(), flush=True)

    try:
        report = compile_programs(config, devices, ns.tpu_topology, on_program=show)
    except ProgramCompileError as e:
        print(f"jaxllm compile: error: {e}", file=sys.stderr)
        return 1
    gib = 1 << 30
    print(f"KV cache: {report.num_kv_blocks} blocks of {report.block_size} tokens, "
          f"{report.kv_cache_bytes_per_chip / gib:.2f} GiB per chip (weights "
          f"{report.weight_bytes_per_chip / gib:.2f} GiB, activation reserve "
          f"{report.activation_reserve_bytes / gib:.2f} GiB per chip)")
    print(report.summary())
    return 0
