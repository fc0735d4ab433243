"""Peer: Hugging Face transformers `generate` with a static cache (PyTorch, bf16, random weights).

Runs in its own process so that JAX and PyTorch never hold the GPU at once.
Prints one JSON line per batch size: output tokens/s and ms per decode step.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="configs/llama-3-8b")
    ap.add_argument("--batch-sizes", default="64,256,512")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    args = ap.parse_args()

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(args.model)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config)
    model.eval()
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        ids = torch.randint(0, config.vocab_size, (b, args.input_len), device="cuda")
        kw = dict(do_sample=False, cache_implementation="static", pad_token_id=0,
                  eos_token_id=None)
        try:
            with torch.no_grad():
                # The warm-up is the timed call itself: a static cache sized for
                # another length would be a new shape (and a new compilation).
                for _ in range(2):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    out = model.generate(ids, max_new_tokens=args.output_len,
                                         min_new_tokens=args.output_len, **kw)
                    torch.cuda.synchronize()
                    total = time.perf_counter() - t0
        except torch.cuda.OutOfMemoryError:
            # The largest batch sizes may not fit: that bounds the peer's best.
            print(json.dumps({"peer": "transformers-static", "batch_size": b,
                              "out_of_memory": True}), flush=True)
            del ids
            torch.cuda.empty_cache()
            continue
        new = out.shape[1] - args.input_len
        print(json.dumps({"peer": "transformers-static", "batch_size": b,
                          "output_tokens_per_s": b * new / total,
                          "ms_per_step": total / new * 1e3}),
              flush=True)


if __name__ == "__main__":
    main()
