"""`jaxllm serve [MODEL]`: vLLM's flag names, plus `--config FILE.yaml`.

Precedence: flags on the command line > values in the YAML file > defaults.
To tell a flag given on the command line from its default, every serve flag
defaults to a sentinel; the real defaults are applied in `resolve_args`.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from jaxllm.entrypoints.arg_utils import (
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_RESPONSES_STORE_SIZE,
    add_engine_args,
    engine_args_from,
)
from jaxllm.entrypoints.openai.supervisor import DEFAULT_ENGINE_RESTARTS
from jaxllm.entrypoints.openai.tool_parsers import TOOL_PARSERS
from jaxllm.errors import ParameterError
from jaxllm.sampling_params import DEFAULT_MAX_N_SEQUENCES, max_n_sequences

_UNSET: Any = type("Unset", (), {"__repr__": lambda self: "<unset>"})()
# Left with its real default: cli.main() reads it before the command runs.
_KEEP_DEFAULT = {"gpu_memory_utilization", "func", "command"}
DEMO_MODEL_NAME = "demo"


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server",
        description="Serve MODEL (a Hugging Face checkpoint directory; default: the embedded "
                    "demo model) over an OpenAI-compatible HTTP API.")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="checkpoint directory (same as --model)")
    p.add_argument("--config", default=None,
                   help="YAML file of flag values (keys as flag names, with - or _)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes "
                        "(default: $JAXLLM_API_KEY)")
    p.add_argument("--chat-template", default=None,
                   help="Jinja chat template, as a file path or inline text")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="larger request bodies get 413")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM")
    p.add_argument("--log-stats-interval", type=float, default=10.0,
                   help="seconds between the one-line stat logs")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    p.add_argument("--disable-uvicorn-access-log", action="store_true", default=False)
    p.add_argument("--enable-tokenizer-info-endpoint", action="store_true", default=False,
                   help="serve GET /tokenizer_info (the tokenizer's configuration, chat "
                        "template included), as vLLM")
    p.add_argument("--engine-restarts", type=int, default=DEFAULT_ENGINE_RESTARTS,
                   help="restart a dead engine core up to N times in a row (/health is 503 "
                        "meanwhile), then exit with status 1; 0 exits at once")
    p.add_argument("--exit-on-engine-death", action="store_true", default=False,
                   help="exit with status 1 as soon as the engine core dies (vLLM's "
                        "behaviour; same as --engine-restarts 0)")
    p.add_argument("--max-n-sequences", type=int, default=None,
                   help="the largest n (and best_of) a request may ask for (default "
                        f"$JAXLLM_MAX_N_SEQUENCES or {DEFAULT_MAX_N_SEQUENCES}, as vLLM's "
                        "VLLM_MAX_N_SEQUENCES)")
    p.add_argument("--enable-auto-tool-choice", action="store_true", default=False,
                   help='let the model choose to call tools (tool_choice "auto"); needs '
                        "--tool-call-parser")
    p.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="how tool calls are read from the model's output (as vLLM's parsers "
                        "of these names)")
    p.add_argument("--responses-store-size", type=int, default=DEFAULT_RESPONSES_STORE_SIZE,
                   help="finished /v1/responses kept in memory for previous_response_id and "
                        "GET /v1/responses/{id}, the oldest dropped first (at most 64 MiB "
                        "of them); 0 keeps none")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters to serve (with --enable-lora): name=path, or JSON "
                        "{\"name\": ..., \"path\": ..., \"base_model_name\": ...}")
    add_engine_args(p)
    # The server logs its stats by default (the offline API does not).
    p.set_defaults(disable_log_stats=False)
    defaults = {a.dest: a.default for a in p._actions if a.dest != "help"}
    p.set_defaults(**{d: _UNSET for d in defaults if d not in _KEEP_DEFAULT},
                   func=cmd_serve, _serve_defaults=defaults)
    return p


def load_yaml_config(path: str, known: set[str]) -> dict[str, Any]:
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except OSError as e:
        raise ParameterError("config", f"cannot read {path!r}: {e}") from e
    except yaml.YAMLError as e:
        raise ParameterError("config", f"{path!r} is not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ParameterError("config", f"{path!r} must hold a mapping of flag names to values")
    out: dict[str, Any] = {}
    for key, value in data.items():
        dest = str(key).replace("-", "_")
        if dest == "model_tag":
            dest = "model"
        if dest not in known or dest in ("config", "func"):
            raise ParameterError(f"config:{key}", f"unknown option in {path!r}")
        if dest in ("token_buckets", "request_buckets") and isinstance(value, str):
            value = [int(x) for x in value.split(",")]
        out[dest] = value
    return out


def resolve_args(ns: argparse.Namespace) -> argparse.Namespace:
    """Command line > --config YAML > defaults; MODEL and --model are one setting."""
    defaults: dict[str, Any] = ns._serve_defaults
    config_path = ns.config if ns.config is not _UNSET else None
    from_file = load_yaml_config(config_path, set(defaults)) if config_path else {}
    resolved = argparse.Namespace()
    for dest, default in defaults.items():
        value = getattr(ns, dest, _UNSET)
        if value is _UNSET:
            value = from_file.get(dest, default)
        setattr(resolved, dest, value)
    tag = resolved.model_tag
    if tag is not None:
        if resolved.model is not None and resolved.model != tag:
            raise ParameterError("model", f"given twice: {tag!r} and --model {resolved.model!r}")
        resolved.model = tag
    if resolved.gpu_memory_utilization is None and "gpu_memory_utilization" in from_file:
        resolved.gpu_memory_utilization = from_file["gpu_memory_utilization"]
    if resolved.gpu_memory_utilization:
        resolved.hbm_utilization = resolved.gpu_memory_utilization
    if resolved.max_n_sequences is None:
        resolved.max_n_sequences = max_n_sequences()
    if resolved.max_n_sequences < 1:
        raise ParameterError("max_n_sequences", f"must be at least 1, got "
                             f"{resolved.max_n_sequences}")
    if resolved.engine_restarts < 0:
        raise ParameterError("engine_restarts", f"must be non-negative, got "
                             f"{resolved.engine_restarts}")
    if resolved.api_key is None:
        resolved.api_key = os.environ.get("JAXLLM_API_KEY") or None
    if resolved.served_model_name is None:
        resolved.served_model_name = resolved.model or DEMO_MODEL_NAME
    return resolved


def cmd_serve(ns: argparse.Namespace) -> int:
    try:
        from jaxllm.entrypoints.openai.api_server import run_server
    except ImportError as e:
        sys.exit(f"jaxllm serve needs the server dependencies ({e}); "
                 "reinstall jaxllm with its dependencies: pip install jaxllm")

    # A ParameterError is printed in one line by the CLI's main(), as for every command.
    args = resolve_args(ns)
    spec = engine_args_from(args).distributed_spec()
    if spec is not None and not spec.is_leader:  # a follower host of a multi-host engine
        return run_follower_process(spec)
    if spec is not None:  # a multi-host core cannot come back alone: its followers left
        args.engine_restarts = 0
    return run_server(args)


def run_follower_process(spec: Any) -> int:
    """A follower host (engine/lockstep.py), then a quick exit: the interpreter's teardown
    would wait on a `jax.distributed` job whose host 0 is gone."""
    import logging

    from jaxllm.engine.lockstep import run_follower

    code = run_follower(spec)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
