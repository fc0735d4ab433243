"""`jaxllm generate | chat | serve | compile | convert | bench`, with vLLM's flag names."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from jaxllm.entrypoints.arg_utils import add_engine_args, engine_args_from
from jaxllm.errors import ParameterError


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--sampling-seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=None)


def _params(ns: argparse.Namespace):
    from jaxllm.sampling_params import SamplingParams

    return SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p,
                          top_k=ns.top_k, min_p=ns.min_p, n=ns.n, seed=ns.sampling_seed,
                          stop=ns.stop)


def _has_chat_template(llm: Any) -> bool:
    return bool(getattr(llm.get_tokenizer(), "chat_template", None))


def _use_chat_template(llm: Any, chat: bool | None) -> bool:
    """--chat / --no-chat as given; unset, wrap only when the tokenizer has a template."""
    has_template = _has_chat_template(llm)
    if chat and not has_template:
        raise ParameterError("chat", "the model's tokenizer has no chat template; "
                             "drop --chat (or pass --no-chat) to send prompts as plain text")
    return has_template if chat is None else chat


def cmd_generate(ns: argparse.Namespace) -> int:
    from jaxllm.entrypoints.llm import LLM

    prompts = list(ns.prompts)
    if ns.prompts_file:
        try:
            with open(ns.prompts_file) as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except OSError as e:
            raise ParameterError("prompts_file", f"cannot read {ns.prompts_file!r}: {e}") from e
    if not prompts:
        raise ParameterError("prompts", "give prompts as arguments or --prompts-file")
    params = _params(ns)  # before the model loads: a bad flag fails at once
    llm = LLM(**vars(engine_args_from(ns)))
    if _use_chat_template(llm, ns.chat):
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        for comp in out.outputs:
            if ns.json:
                print(json.dumps({"prompt": prompt, "text": comp.text,
                                  "finish_reason": comp.finish_reason}))
            else:
                print(f"{prompt!r} -> {comp.text!r}")
    return 0


def cmd_chat(ns: argparse.Namespace) -> int:
    from jaxllm.entrypoints.llm import LLM

    params = _params(ns)
    llm = LLM(**vars(engine_args_from(ns)))
    if not _has_chat_template(llm):
        raise ParameterError("model", "its tokenizer has no chat template, which `jaxllm chat` "
                             "needs; use `jaxllm generate --no-chat` for plain completions")
    history: list[dict[str, Any]] = []
    print("jaxllm chat: type a message, an empty line or Ctrl-D to quit.")
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if not line:
            break
        history.append({"role": "user", "content": line})
        out = llm.chat(history, params, use_tqdm=False)[0].outputs[0].text
        print(out.strip())
        history.append({"role": "assistant", "content": out})
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxllm", description="JAX LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="offline generation for prompts")
    gen.add_argument("prompts", nargs="*")
    gen.add_argument("--prompts-file", default=None)
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                     help="wrap each prompt in the model's chat template "
                          "(default: on when the tokenizer has one)")
    gen.add_argument("--json", action="store_true", help="one JSON object per completion")
    add_engine_args(gen)
    _sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat in the terminal")
    add_engine_args(chat)
    _sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    from jaxllm.entrypoints.openai.cli_serve import add_serve_parser

    add_serve_parser(sub)

    from jaxllm.entrypoints.cli_compile import add_compile_parser

    add_compile_parser(sub)

    from jaxllm.entrypoints.cli_convert import add_convert_parser

    add_convert_parser(sub)

    bench = sub.add_parser(
        "bench", help="benchmarks: " + ", ".join(BENCHMARKS),
        description="Run a benchmark; its own flags follow the name "
                    "(`jaxllm bench latency --help`). Each prints a table and writes JSON "
                    "($OUT or the current directory).")
    bench.add_argument("benchmark", choices=list(BENCHMARKS))
    bench.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's flags")
    bench.set_defaults(func=cmd_bench)
    return parser


# `jaxllm bench NAME` -> module under jaxllm.benchmarks with a main(argv).
BENCHMARKS = {"latency": "latency", "throughput": "throughput", "prefix": "prefix",
              "serving": "serving", "host-overhead": "host_overhead"}


def cmd_bench(ns: argparse.Namespace) -> int:
    import importlib

    module = importlib.import_module(f"jaxllm.benchmarks.{BENCHMARKS[ns.benchmark]}")
    prog, sys.argv[0] = sys.argv[0], f"jaxllm bench {ns.benchmark}"
    try:
        module.main(ns.args)
    finally:
        sys.argv[0] = prog
    return 0


def main(argv: list[str] | None = None) -> int:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    ns = build_parser().parse_args(argv)
    if getattr(ns, "gpu_memory_utilization", None):
        ns.hbm_utilization = ns.gpu_memory_utilization
    try:
        return ns.func(ns)
    except ParameterError as e:  # bad input: one line naming the field, no traceback
        print(f"jaxllm {ns.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
