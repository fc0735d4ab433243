"""Greedy decoding with transformers (PyTorch, float32): the oracle for engine parity."""

from __future__ import annotations

import numpy as np
import torch


def _model(model_dir: str, model_cls: type | None) -> torch.nn.Module:
    """`model_cls` (default: AutoModelForCausalLM) from `model_dir`, float32, eval mode."""
    from transformers import AutoModelForCausalLM

    cls = model_cls or AutoModelForCausalLM
    return cls.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int,
              top_k: int = 5, model_cls: type | None = None
              ) -> tuple[list[list[int]], list[list[dict[int, float]]]]:
    """Per prompt: greedy token ids and, per step, the top-k logprobs {token: logprob}."""
    model = _model(model_dir, model_cls)
    tokens, tops = [], []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out, top = [], []
            past = None
            step_ids = ids
            for _ in range(max_new_tokens):
                res = model(step_ids, past_key_values=past, use_cache=True)
                past = res.past_key_values
                lp = torch.log_softmax(res.logits[0, -1].double(), -1)
                nxt = int(torch.argmax(lp))
                vals, idx = torch.topk(lp, top_k)
                top.append({int(i): float(v) for i, v in zip(idx, vals, strict=True)})
                out.append(nxt)
                step_ids = torch.tensor([[nxt]])
            tokens.append(out)
            tops.append(top)
    return tokens, tops


def random_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    # Stay clear of the special ids at the bottom of the tiny vocabularies.
    return [rng.integers(8, vocab, size=n).tolist() for n in lengths]


def hf_prompt_logprobs(model_dir: str, prompts: list[list[int]],
                       model_cls: type | None = None) -> list[list[float]]:
    """Per prompt: the logprob transformers gives each prompt token after the first."""
    model = _model(model_dir, model_cls)
    out = []
    with torch.no_grad():
        for prompt in prompts:
            logits = model(torch.tensor([prompt])).logits[0, :-1].double()
            lp = torch.log_softmax(logits, -1)
            out.append([float(lp[i, t]) for i, t in enumerate(prompt[1:])])
    return out
