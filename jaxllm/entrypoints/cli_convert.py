"""`jaxllm convert MODEL OUT [--tensor-parallel-size N] [--dtype D] [--quantization Q]`: a
Hugging Face safetensors checkpoint rewritten as a jaxllm orbax checkpoint (models/orbax_io.py).

The weights are loaded as the engine loads them (fused, cast to the dtype, sharded
over N devices) and saved in that layout, so `LLM(model=OUT)` and `jaxllm serve OUT`
restore every array straight into its sharding, each process reading only its own
shards.
"""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any


def add_convert_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "convert", help="write a safetensors checkpoint as a sharded orbax checkpoint",
        description="Load MODEL (a Hugging Face safetensors directory) as the engine does and "
                    "write its laid-out weights to OUT as an orbax checkpoint, with MODEL's "
                    "config and tokenizer files. OUT then loads with `--model OUT` at the "
                    "tensor-parallel size it was converted for (or any with the same kv-head "
                    "replication).")
    p.add_argument("model", metavar="MODEL", help="Hugging Face checkpoint directory")
    p.add_argument("out", metavar="OUT", help="directory to write (created; must not hold a "
                                              "jaxllm orbax checkpoint already)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="the tensor-parallel size to lay the weights out for (default 1)")
    p.add_argument("--dtype", default="auto",
                   help="dtype to store: auto (config.json's), float32, bfloat16, float16")
    p.add_argument("--quantization", default=None, choices=["fp8", "int8"],
                   help="store the projections quantized (loads back quantized)")
    p.set_defaults(func=cmd_convert)
    return p


def convert(model: str, out: str, tensor_parallel_size: int = 1, dtype: str = "auto",
            quantization: str | None = None) -> None:
    """Writes the orbax checkpoint of `model` (laid out for `tensor_parallel_size`) to `out`."""
    from jaxllm.config import EngineArgs
    from jaxllm.distributed.mesh import make_mesh
    from jaxllm.layers.attention import get_attention_backend
    from jaxllm.models.loader import load_model
    from jaxllm.models.orbax_io import save_orbax

    config = EngineArgs(model=model, tensor_parallel_size=tensor_parallel_size, dtype=dtype,
                        load_format="safetensors", quantization=quantization,
                        skip_tokenizer_init=True).create_engine_config()
    mc = config.model_config
    mesh = make_mesh(tensor_parallel_size, hf_config=mc.hf_config)
    # The attention body shapes no weight; the reference one builds on every platform.
    loaded = load_model(mc, mesh, get_attention_backend("xla"))
    save_orbax(loaded, mc.hf_config, model, out, mc.dtype, tensor_parallel_size,
               mc.quantization)


def cmd_convert(ns: argparse.Namespace) -> int:
    # orbax logs every save phase at INFO through absl; the command prints its own summary.
    logging.getLogger("absl").setLevel(logging.WARNING)
    t0 = time.perf_counter()
    convert(ns.model, ns.out, ns.tensor_parallel_size, ns.dtype, ns.quantization)
    print(f"wrote {ns.out} (tensor_parallel_size={ns.tensor_parallel_size}) in "
          f"{time.perf_counter() - t0:.1f}s")
    return 0
