"""Tiny random EAGLE / EAGLE-3 heads saved in vLLM's layout, and an independent torch
reference of their drafts (written from the layouts' definitions, not from jaxllm).

The reference runs the target (transformers) over a request's whole context, then
the head over every position p < c with token p + 1 and the target's hidden state
at p (EAGLE: the final normed state; EAGLE-3: the residual streams entering the aux
layers, through `fc`), with plain causal attention, and drafts k tokens greedily
from position c - 1, each step feeding the head's hidden output to the next.
"""

from __future__ import annotations

import json
import os

import numpy as np

H, HEADS, KV_HEADS, INTER = 64, 4, 2, 128


def make_eagle_head(out_dir, method: str, *, vocab_size: int = 256, seed: int = 0,
                    aux_layers=(1, 2, 3), draft_vocab_size: int = 128, std: float = 0.15,
                    prefix: str = "", extra: dict | None = None,
                    drop: tuple[str, ...] = (), copy_of: str | None = None) -> str:
    """A random `method` head ("eagle" | "eagle3") for a target of hidden size 64,
    saved as vLLM reads it (EAGLE-3's layer under `midlayer.` when `prefix` is empty).

    `copy_of` (the target's directory) makes a head whose attention and MLP add only
    `std`-scaled noise to the hidden state it is handed: EAGLE's then drafts about
    what the target predicted at that position (accepted where the target repeats a
    token), EAGLE-3's reads the last aux layer through the target's own final norm
    and logits head (draft vocabulary = the target's). Their drafts are often
    accepted, so runs of accepted drafts occur."""
    import torch
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    if copy_of is not None:  # the target's logits head: its whole vocabulary
        draft_vocab_size = vocab_size

    def rand(*shape, scale=std):
        return (scale * torch.randn(*shape, generator=g)).float()

    def norm():
        return 1.0 + rand(H, scale=0.1)

    eagle3 = method == "eagle3"
    d = H // HEADS
    layer = prefix + ("midlayer." if eagle3 and not prefix else "layers.0.")
    attn_in = 2 * H if eagle3 else H
    t = {prefix + "fc.weight": rand(H, (3 if eagle3 else 2) * H),
         layer + "self_attn.q_proj.weight": rand(HEADS * d, attn_in),
         layer + "self_attn.k_proj.weight": rand(KV_HEADS * d, attn_in),
         layer + "self_attn.v_proj.weight": rand(KV_HEADS * d, attn_in),
         layer + "self_attn.o_proj.weight": rand(H, HEADS * d),
         layer + "mlp.gate_proj.weight": rand(INTER, H),
         layer + "mlp.up_proj.weight": rand(INTER, H),
         layer + "mlp.down_proj.weight": rand(H, INTER),
         layer + "post_attention_layernorm.weight": norm()}
    cfg = dict(architectures=["Eagle3LlamaForCausalLM" if eagle3 else "EagleLlamaForCausalLM"],
               model_type="llama", hidden_size=H, intermediate_size=INTER,
               num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, num_hidden_layers=1,
               vocab_size=vocab_size, rms_norm_eps=1e-6, max_position_embeddings=256,
               rope_theta=10000.0, hidden_act="silu", tie_word_embeddings=False)
    if eagle3:
        perm = torch.randperm(vocab_size, generator=g)[:draft_vocab_size].sort().values
        t.update({layer + "input_layernorm.weight": norm(),
                  layer + "hidden_norm.weight": norm(), prefix + "norm.weight": norm(),
                  prefix + "lm_head.weight": rand(draft_vocab_size, H, scale=0.5),
                  prefix + "d2t": (perm - torch.arange(draft_vocab_size)).long(),
                  prefix + "t2d": torch.zeros(vocab_size, dtype=torch.bool).index_fill(
                      0, perm, True)})
        cfg.update(draft_vocab_size=draft_vocab_size,
                   eagle_aux_hidden_state_layer_ids=list(aux_layers))
    if copy_of is not None:
        _make_copying(t, layer, prefix, eagle3, copy_of, vocab_size, len(aux_layers), std)
    cfg.update(extra or {})
    save_file({k: v.contiguous() for k, v in t.items() if k not in drop},
              os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(out_dir)


def _make_copying(t: dict, layer: str, prefix: str, eagle3: bool, target_dir: str,
                  vocab_size: int, num_aux: int, std: float) -> None:
    """`make_eagle_head`'s `copy_of` head, in place of `t`'s random tensors."""
    import torch
    from safetensors.torch import load_file

    target = load_file(os.path.join(target_dir, "model.safetensors"))
    t[layer + "self_attn.o_proj.weight"] *= std
    t[layer + "mlp.down_proj.weight"] *= std
    eye = torch.eye(H)
    if not eagle3:  # fc keeps the hidden half of concat(embeds, hidden)
        t[prefix + "fc.weight"] = torch.cat([torch.zeros(H, H), eye], dim=1)
        return
    t[prefix + "fc.weight"] = torch.cat([torch.zeros(H, (num_aux - 1) * H), eye], dim=1)
    t[prefix + "norm.weight"] = target["model.norm.weight"].float().clone()
    t[prefix + "lm_head.weight"] = target["lm_head.weight"].float().clone()
    t[prefix + "d2t"] = torch.zeros(vocab_size, dtype=torch.long)
    t[prefix + "t2d"] = torch.ones(vocab_size, dtype=torch.bool)


def _rope(x, pos, theta: float = 10000.0):
    """Llama's rotate-half rope over `x` [T, heads, d] at integer positions `pos` [T]."""
    import torch

    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).double() / d)
    ang = pos.double()[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class ReferenceHead:
    """A head's forward over whole sequences, in float64 torch."""

    def __init__(self, head_dir: str, target_dir: str):
        import torch
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        with open(os.path.join(head_dir, "config.json")) as f:
            self.cfg = json.load(f)
        self.eagle3 = "Eagle3" in self.cfg["architectures"][0]
        raw = load_file(os.path.join(head_dir, "model.safetensors"))
        self.w = {k.replace("midlayer.", "layers.0.").removeprefix("model."): v.double()
                  for k, v in raw.items()}
        self.target = AutoModelForCausalLM.from_pretrained(target_dir).double().eval()
        self.embed = self.target.model.embed_tokens.weight.detach()
        self.lm_head = self.target.lm_head.weight.detach()
        self.torch = torch

    def _norm(self, x, name):
        return x * (x.pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt() * self.w[name + ".weight"]

    def _layer(self, x_attn, residual, pos):
        """Attention over `x_attn` [T, in] (causal, rope at `pos`) plus `residual`, then
        the MLP with its residual."""
        torch, w, d = self.torch, self.w, H // HEADS
        p = "layers.0.self_attn."
        q = (x_attn @ w[p + "q_proj.weight"].T).view(-1, HEADS, d)
        k = (x_attn @ w[p + "k_proj.weight"].T).view(-1, KV_HEADS, d)
        v = (x_attn @ w[p + "v_proj.weight"].T).view(-1, KV_HEADS, d)
        q, k = _rope(q, pos), _rope(k, pos)
        k, v = (a.repeat_interleave(HEADS // KV_HEADS, dim=1) for a in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5
        t = x_attn.shape[0]
        scores = scores.masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf"))
        o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, -1)
        y = residual + o @ w[p + "o_proj.weight"].T
        m = self._norm(y, "layers.0.post_attention_layernorm")
        act = torch.nn.functional.silu(m @ w["layers.0.mlp.gate_proj.weight"].T)
        return y + (act * (m @ w["layers.0.mlp.up_proj.weight"].T)) @ \
            w["layers.0.mlp.down_proj.weight"].T

    def _step(self, tokens, hidden, pos):
        """(next hidden, logits) of the head over a whole sequence."""
        e = self.embed[tokens]
        if not self.eagle3:
            x = self.torch.cat([e, hidden], -1) @ self.w["fc.weight"].T
            out = self._layer(x, x, pos)
            return out, out @ self.lm_head.T
        normed = self._norm(hidden, "layers.0.hidden_norm")
        x = self.torch.cat([self._norm(e, "layers.0.input_layernorm"), normed], -1)
        pre = self._layer(x, hidden, pos)
        return pre, self._norm(pre, "norm") @ self.w["lm_head.weight"].T

    def _to_target(self, ids):
        if not self.eagle3:
            return ids
        return ids + self.w["d2t"].long()[ids]

    def drafts(self, context: list[int], k: int) -> list[int]:
        """The k greedy drafts after `context` (its last token is the one at c)."""
        torch = self.torch
        with torch.no_grad():
            ids = torch.tensor([context])
            out = self.target(ids, output_hidden_states=True)
            if self.eagle3:
                layers = self.cfg["eagle_aux_hidden_state_layer_ids"]
                aux = torch.cat([out.hidden_states[i][0] for i in sorted(layers)], -1)
                hidden = aux[:-1] @ self.w["fc.weight"].T
            else:
                hidden = out.hidden_states[-1][0, :-1]
            tokens = ids[0, 1:]  # position p takes token p + 1
            pos = torch.arange(len(context) - 1)
            drafts = []
            for _ in range(k):
                nxt_hidden, logits = self._step(tokens, hidden, pos)
                d = int(self._to_target(logits[-1].argmax()).item())
                drafts.append(d)
                tokens = torch.cat([tokens, torch.tensor([d])])
                hidden = torch.cat([hidden, nxt_hidden[-1:]])
                pos = torch.arange(len(tokens))
        return drafts


def reference_drafts_match(head_dir: str, target_dir: str, recorded) -> int:
    """Asserts every recorded (context, drafts) proposal equals the reference's; returns
    how many drafts were compared."""
    ref = ReferenceHead(head_dir, target_dir)
    compared = 0
    for context, drafts in recorded:
        want = ref.drafts(context, len(drafts))
        assert list(drafts) == want, (len(context), list(drafts), want)
        compared += len(drafts)
    return compared


def record_proposals(llm) -> list[tuple[list[int], np.ndarray]]:
    """Wraps the engine's proposer: each proposal's (context up to token c, its drafts)."""
    runner = llm.llm_engine.engine_core.engine_core.model_runner
    drafter = runner.spec.drafter
    recorded = []
    propose = drafter.propose

    def recording(ib, rows, inputs, num_drafts):
        drafts = propose(ib, rows, inputs, num_drafts)
        got = np.asarray(drafts)
        for i, row in enumerate(rows):
            if num_drafts[i]:
                c = int(inputs.computed[i])
                recorded.append((ib.token_ids[row, :c + 1].tolist(), got[i, :num_drafts[i]]))
        return drafts

    drafter.propose = recording
    return recorded
