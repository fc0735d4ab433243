"""Benchmark: the cost of structured outputs (a JSON schema) on decode steps at batch 64.

Decodes `--batch-size` requests (random prompts, greedy, ignore_eos) four ways
on the same engine: unconstrained with async scheduling (the baseline),
unconstrained with synchronous steps (what a constrained batch falls back
to), every request under a JSON schema, and half of them. Reports ms per
decode step (median of `--num-iters` runs, prefill subtracted as in
bench_latency), the overhead over the baseline, and the host time per step
spent filling bitmasks and advancing matchers. Prints a table; writes JSON
to $OUT/bench_structured.json when $OUT is set.

Checkpoints without a tokenizer (the default `configs/llama-3-8b`) get a
synthetic vocabulary of the model's size (256 bytes, then random ASCII
pieces), so that llguidance's mask computation walks a trie of that size.

    PYTHONPATH=. python3 scripts/bench_structured.py [--batch-size 64] [--output-len 128]
"""

from __future__ import annotations

import argparse
import string
import time

import numpy as np

from jaxllm.benchmarks.common import add_model_args, print_table, write_json

SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": {
    "type": "object", "properties": {
        "id": {"type": "integer"}, "name": {"type": "string"},
        "score": {"type": "number"}, "tags": {"type": "array", "items": {"type": "string"}},
        "kind": {"enum": ["a", "b", "c"]}},
    "required": ["id", "name", "score", "tags", "kind"], "additionalProperties": False}}},
    "required": ["items"], "additionalProperties": False}


def synthetic_tokenizer(vocab_size: int, seed: int = 0):
    """An LLTokenizer of `vocab_size` ids: the 256 bytes, random ASCII pieces, EOS last."""
    import llguidance

    rng = np.random.default_rng(seed)
    alphabet = np.array(list(string.ascii_letters + string.digits + string.punctuation + " "))
    tokens = [bytes([b]) for b in range(min(256, vocab_size - 1))]
    pieces = set(tokens)
    while len(tokens) < vocab_size - 1:
        piece = "".join(rng.choice(alphabet, rng.integers(2, 9))).encode()
        if rng.random() < 0.4:
            piece = b" " + piece
        if piece not in pieces:
            pieces.add(piece)
            tokens.append(piece)
    eos = len(tokens)
    tokens.append(b"\xff<eos>")

    class Vocab:
        eos_token_id, bos_token_id, special_token_ids = eos, None, [eos]

        def __init__(self) -> None:
            self.tokens = tokens

        def __call__(self, text: str) -> list[int]:  # greedy bytes: enough for grammars
            return list(text.encode())

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Vocab()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    add_model_args(ap)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-iters", type=int, default=3)
    args = ap.parse_args()

    try:
        import llguidance  # noqa: F401
    except ModuleNotFoundError:
        raise SystemExit("llguidance is missing: pip install llguidance (a wheel with no "
                         "dependencies)") from None
    from jaxllm import LLM, SamplingParams
    from jaxllm.sampling_params import StructuredOutputsParams
    from jaxllm.structured_output.grammar import validate
    from jaxllm.structured_output.manager import StructuredOutputManager

    b, n_in, n_out = args.batch_size, args.input_len, args.output_len
    max_len = -(-(n_in + n_out + 16) // 128) * 128

    llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype,
              skip_tokenizer_init=True, max_model_len=max_len, max_num_seqs=b,
              max_num_batched_tokens=n_in * b, token_buckets=[b, n_in * b],
              request_buckets=[b], enable_prefix_caching=False)
    vocab = llm.llm_engine.model_config.vocab_size
    t0 = time.perf_counter()
    lltok = synthetic_tokenizer(vocab)
    tokenizer_s = time.perf_counter() - t0
    core = llm.llm_engine.engine_core.engine_core
    core.structured = manager = StructuredOutputManager(lambda: lltok, vocab)
    # No HF tokenizer to validate with at the frontend: validate with the synthetic one.
    llm.llm_engine.input_processor._check_structured = \
        lambda p: validate(p.structured_outputs, lltok)
    host = {"fill": 0.0, "accept": 0.0}

    def timed(name, fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                host[name] += time.perf_counter() - t
        return wrapper

    manager.fill_bitmask = timed("fill", manager.fill_bitmask)
    manager.accept = timed("accept", manager.accept)

    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(0, vocab, n_in).tolist()} for _ in range(b)]
    structured = StructuredOutputsParams(json=SCHEMA)

    def params(max_tokens: int, constrained: int) -> list[SamplingParams]:
        return [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                               detokenize=False,
                               structured_outputs=structured if i < constrained else None)
                for i in range(b)]

    def step_ms(constrained: int, async_scheduling: bool = True) -> tuple[float, float]:
        core.async_scheduling = async_scheduling

        def run(max_tokens: int) -> float:
            t = time.perf_counter()
            llm.generate(prompts, params(max_tokens, constrained), use_tqdm=False)
            return time.perf_counter() - t

        run(4)  # warm-up (and the grammar's compilation)
        prefill = float(np.median([run(1) for _ in range(args.num_iters)]))
        host["fill"] = host["accept"] = 0.0
        total = float(np.median([run(n_out) for _ in range(args.num_iters)]))
        host_ms = (host["fill"] + host["accept"]) / args.num_iters / n_out * 1e3
        return (total - prefill) / (n_out - 1) * 1e3, host_ms

    rows = {"none": step_ms(0), "none, sync": step_ms(0, async_scheduling=False),
            "json (all)": step_ms(b), "json (half)": step_ms(b // 2)}
    base = rows["none"][0]
    result = {"batch_size": b, "input_len": n_in, "output_len": n_out, "vocab_size": vocab,
              "synthetic_tokenizer_s": tokenizer_s,
              "modes": {k: {"ms_per_step": ms, "host_grammar_ms_per_step": h,
                            "overhead_vs_none": ms / base - 1} for k, (ms, h) in rows.items()}}
    write_json("bench_structured", result)
    print_table([("mode", "ms/step   overhead   host grammar ms/step")] + [
        (k, f"{ms:7.2f}   {ms / base - 1:+7.1%}   {h:.2f}") for k, (ms, h) in rows.items()])


if __name__ == "__main__":
    main()
