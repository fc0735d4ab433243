"""Command-line flags for EngineArgs, shared by every `jaxllm` command that builds an engine.

Its own module so that the serve parser and the server read it without importing
the CLI or each other.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing

from jaxllm.config import EngineArgs

# The HTTP server's request size limit: `jaxllm serve --max-request-bytes` and
# ServerOptions both default to it.
DEFAULT_MAX_REQUEST_BYTES = 32 * 1024 * 1024
DEFAULT_RESPONSES_STORE_SIZE = 1000  # finished /v1/responses the server keeps

_SKIP = {"model", "token_buckets", "request_buckets", "gpu_memory_utilization",
         "speculative_config"}
_SHORT = {"tensor_parallel_size": "-tp", "data_parallel_size": "-dp"}  # vLLM's short flags
_HELP = {"data_parallel_size": "engine cores, each a full replica on its own "
                               "tensor-parallel-size devices, behind this one server",
         "distributed_coordinator_address": "multi-host: host 0's host:port for "
                                            "jax.distributed (else JAX_COORDINATOR_ADDRESS)",
         "distributed_num_processes": "multi-host: the number of hosts (processes); 0 has "
                                      "JAX find the job on a TPU VM slice",
         "distributed_process_id": "multi-host: this host's index; 0 serves, any other "
                                   "follows host 0 in lockstep",
         "num_kv_blocks": "the KV cache's memory, in blocks of every layer",
         "reasoning_parser": "split the model's thinking from its answer (deepseek_r1, "
                             "glm45, olmo3, qwen3, seed_oss): the chat server's "
                             "message.reasoning, and grammars that start once the "
                             "thinking has ended",
         "num_gpu_blocks_override": "vLLM's: the KV block pool's size, the null block "
                                    "included; with sliding-window KV cache groups each "
                                    "block is a page in each layer of one group"}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One --flag per EngineArgs field (vLLM spelling: dashes, --no-x for booleans)."""
    parser.add_argument("--model", default=None,
                        help="Hugging Face checkpoint directory (default: the embedded demo model)")
    hints = typing.get_type_hints(EngineArgs)
    for f in dataclasses.fields(EngineArgs):
        if f.name in _SKIP:
            continue
        flag = "--" + f.name.replace("_", "-")
        hint = hints[f.name]
        if hint is bool or hint == bool | None:  # None: the field's own default rule
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
            continue
        base = next((t for t in typing.get_args(hint) if t is not type(None)), hint)
        flags = (flag, _SHORT[f.name]) if f.name in _SHORT else (flag,)
        parser.add_argument(*flags, type=base if base in (int, float, str) else str,
                            default=f.default, help=_HELP.get(f.name))
    parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="alias of --hbm-utilization")
    parser.add_argument("--token-buckets", type=lambda s: [int(x) for x in s.split(",")],
                        default=None, help="comma-separated token bucket sizes")
    parser.add_argument("--request-buckets", type=lambda s: [int(x) for x in s.split(",")],
                        default=None, help="comma-separated request bucket sizes")
    parser.add_argument("--speculative-config", default=None,
                        help='speculative decoding as JSON (vLLM\'s fields), e.g. '
                             '\'{"method": "ngram", "num_speculative_tokens": 3}\'')


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    names = EngineArgs.field_names()
    return EngineArgs(**{k: v for k, v in vars(ns).items() if k in names})
