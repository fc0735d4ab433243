#!/usr/bin/env python
"""Train jaxllm's embedded demo model: a tiny Llama that counts, reverses and sorts.

    .venv/bin/python scripts/train_demo_model.py            # writes jaxllm/assets/demo-model

The model is a character-level Llama (RoPE, RMSNorm, SiLU MLP, grouped-query attention)
trained from scratch with JAX + optax on the CPU, on the three tasks of jaxllm/demo_tasks.py
drawn on the fly, in both formats of demo_tasks: half the examples are conversations rendered
by the checkpoint's own chat template, half raw completions `<s>count 1 2<|assistant|> 3 4 5 6
7</s>`, where the model itself writes the <|assistant|> marker (a special token, so decoded text
skips it) before the answer: without that marker `<s>count 1 2 3 4 5 6 7` would be ambiguous,
as nothing else marks where the prompt ends. The loss counts only the tokens the model writes.
The run is a pure function of --seed.

The output is a plain Hugging Face checkpoint. After training, the script loads it back with
transformers, runs greedy generation on held-out prompts, and checks that (a) each task is
answered exactly in >= 95% of cases in each format and (b) the JAX model's greedy tokens equal
transformers'.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import partial

# The shipped checkpoint is trained on the CPU; results on another backend differ in the bits.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402


def _load_demo_tasks():
    """jaxllm/demo_tasks.py by path: the script needs the tasks, not the engine's imports."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "jaxllm", "demo_tasks.py")
    spec = importlib.util.spec_from_file_location("jaxllm_demo_tasks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


demo_tasks = _load_demo_tasks()

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]
FORMATS = ("chat", "raw")
RAW_SHARE = 0.5  # share of training examples in the raw-completion format
# Digits, letters and space are what the tasks use; the four spare characters round the
# vocabulary to 48 (divisible by 8 and 16, so a sharded embedding splits evenly).
CHARACTERS = list(" 0123456789abcdefghijklmnopqrstuvwxyz") + ["\n", ".", ",", "?"]
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

# One turn is <|role|>content</s>; </s> ends a turn, so it is also the eos that stops generation.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('demo model roles are system, user and assistant, got '"
    " + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

REPO = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
DEFAULT_OUT = os.path.join(REPO, "jaxllm", "assets", "demo-model")
SEQ_LEN = 48  # longest example is 46 tokens
ROW_LEN = 128  # packed training row
MAX_NEW_TOKENS = 32


@dataclass(frozen=True)
class ModelShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 256

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


# ----------------------------------------------------------------------------- tokenizer


def build_tokenizer():
    """Character-level tokenizer: a BPE model with no merges splits text into characters."""
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.decoder = decoders.Fuse()  # characters join with nothing between them
    # Like Llama: a plain prompt gets <s>; the chat template writes its own <s> and is
    # tokenized without special tokens.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        unk_token="<unk>", chat_template=CHAT_TEMPLATE, model_max_length=256,
        padding_side="left")


def render(tokenizer, prompt: str, fmt: str = "chat") -> tuple[str, str]:
    """(prompt text, full text) of one example: as the chat template renders it, or raw."""
    answer = demo_tasks.expected_answer(prompt)
    if fmt == "raw":
        head = tokenizer.bos_token + prompt
        return head, head + demo_tasks.RAW_ANSWER_MARKER + answer + tokenizer.eos_token
    messages = demo_tasks.chat(prompt)
    head = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template(
        messages + [{"role": "assistant", "content": answer}], tokenize=False)
    assert full == head + answer + "</s>", (head, full)
    return head, full


class Batcher:
    """Endless stream of packed training batches.

    Examples are packed end to end into rows of ROW_LEN + 1 tokens (two fifths of a padded
    row would be padding); `segments` numbers the examples within a row so that attention
    stays inside one example, and `positions` restart at 0 for each, as they are at inference.
    """

    def __init__(self, tokenizer, seed: int, rows: int):
        self.tokenizer = tokenizer
        self.rng = random.Random(seed)
        self.rows = rows
        self.pending: tuple[list[int], int] | None = None

    def example(self) -> tuple[list[int], int]:
        """(token ids, number of prompt tokens) of a fresh training example."""
        task = self.rng.choice(demo_tasks.TASKS)
        prompt = demo_tasks.make_prompt(task, self.rng, "train")
        fmt = "raw" if self.rng.random() < RAW_SHARE else "chat"
        head, full = render(self.tokenizer, prompt, fmt)
        tok = self.tokenizer.backend_tokenizer
        n_head = len(tok.encode(head, add_special_tokens=False).ids)
        return tok.encode(full, add_special_tokens=False).ids, n_head

    def __call__(self) -> dict[str, np.ndarray]:
        shape = (self.rows, ROW_LEN + 1)
        batch = {"ids": np.full(shape, PAD_ID, np.int32), "mask": np.zeros(shape, np.float32),
                 "segments": np.zeros(shape, np.int32), "positions": np.zeros(shape, np.int32)}
        for r in range(self.rows):
            fill, segment = 0, 1
            while True:
                if self.pending is None:
                    self.pending = self.example()
                ids, n_head = self.pending
                if fill + len(ids) > ROW_LEN + 1:
                    break
                end = fill + len(ids)
                batch["ids"][r, fill:end] = ids
                batch["mask"][r, fill + n_head : end] = 1.0
                batch["segments"][r, fill:end] = segment
                batch["positions"][r, fill:end] = np.arange(len(ids))
                fill, segment, self.pending = end, segment + 1, None
        return batch


# ----------------------------------------------------------------------------- model


def init_params(shape: ModelShape, key: jax.Array) -> dict[str, jax.Array]:
    """Weights under their Hugging Face names, in HF layout ([out, in])."""
    d, f, hd = shape.hidden_size, shape.intermediate_size, shape.head_dim
    shapes = {"model.embed_tokens.weight": (shape.vocab_size, d),
              "lm_head.weight": (shape.vocab_size, d)}
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (shape.num_heads * hd, d),
                   p + "self_attn.k_proj.weight": (shape.num_kv_heads * hd, d),
                   p + "self_attn.v_proj.weight": (shape.num_kv_heads * hd, d),
                   p + "self_attn.o_proj.weight": (d, shape.num_heads * hd),
                   p + "mlp.gate_proj.weight": (f, d),
                   p + "mlp.up_proj.weight": (f, d),
                   p + "mlp.down_proj.weight": (d, f)}
    keys = jax.random.split(key, len(shapes))
    params = {name: 0.02 * jax.random.normal(k, s, jnp.float32)
              for (name, s), k in zip(sorted(shapes.items()), keys, strict=True)}
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        params[p + "input_layernorm.weight"] = jnp.ones((d,), jnp.float32)
        params[p + "post_attention_layernorm.weight"] = jnp.ones((d,), jnp.float32)
    params["model.norm.weight"] = jnp.ones((d,), jnp.float32)
    return params


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    return w * (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps))


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """HF Llama's default rotary embedding (rotate_half layout); x [B, T, H, D]."""
    dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    half = dim // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * jnp.cos(angles) + rotated * jnp.sin(angles)


def forward(params: dict[str, jax.Array], ids: jax.Array, shape: ModelShape,
            positions: jax.Array | None = None, segments: jax.Array | None = None) -> jax.Array:
    """Logits [B, T, V]. Without segments a row is one right-padded sequence (causal
    attention keeps the padding from leaking backwards); with them, several packed ones."""
    b, t = ids.shape
    hd, nh, nkv = shape.head_dim, shape.num_heads, shape.num_kv_heads
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    allowed = jnp.tril(jnp.ones((t, t), bool))[None]
    if segments is not None:
        allowed = allowed & (segments[:, :, None] == segments[:, None, :])
    allowed = allowed[:, None, None]  # [B, kv head, group, T, S]
    h = params["model.embed_tokens.weight"][ids]
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        x = rms_norm(h, params[p + "input_layernorm.weight"], shape.rms_norm_eps)
        q = (x @ params[p + "self_attn.q_proj.weight"].T).reshape(b, t, nh, hd)
        k = (x @ params[p + "self_attn.k_proj.weight"].T).reshape(b, t, nkv, hd)
        v = (x @ params[p + "self_attn.v_proj.weight"].T).reshape(b, t, nkv, hd)
        q, k = rope(q, positions, shape.rope_theta), rope(k, positions, shape.rope_theta)
        q = q.reshape(b, t, nkv, nh // nkv, hd)  # query heads grouped by their kv head
        scores = jnp.einsum("btkgd,bskd->bkgts", q, k) / math.sqrt(hd)
        scores = jnp.where(allowed, scores, -1e30)
        att = jnp.einsum("bkgts,bskd->btkgd", jax.nn.softmax(scores, axis=-1), v)
        h = h + att.reshape(b, t, nh * hd) @ params[p + "self_attn.o_proj.weight"].T
        x = rms_norm(h, params[p + "post_attention_layernorm.weight"], shape.rms_norm_eps)
        gate = jax.nn.silu(x @ params[p + "mlp.gate_proj.weight"].T)
        up = x @ params[p + "mlp.up_proj.weight"].T
        h = h + (gate * up) @ params[p + "mlp.down_proj.weight"].T
    h = rms_norm(h, params["model.norm.weight"], shape.rms_norm_eps)
    return h @ params["lm_head.weight"].T


def answer_loss(params, batch, shape: ModelShape):
    ids = batch["ids"]
    logits = forward(params, ids[:, :-1], shape, batch["positions"][:, :-1],
                     batch["segments"][:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
    m = batch["mask"][:, 1:]
    return jnp.sum(nll * m) / jnp.sum(m)


@partial(jax.jit, static_argnames=("shape",))
def argmax_agrees(params, ids, mask, shape: ModelShape):
    """Per row: does greedy decoding reproduce the masked tokens of `ids` exactly?

    Greedy generation emits a sequence iff every token of it is the argmax given the tokens
    before it, so one teacher-forced pass checks a whole greedy answer. Also returns the
    smallest top-1/top-2 logit gap over those tokens (how far from a tie greedy was).
    """
    logits = forward(params, ids[:, :-1], shape)
    m = mask[:, 1:] > 0
    hit = jnp.argmax(logits, axis=-1) == ids[:, 1:]
    top2 = jax.lax.top_k(logits, 2)[0]
    gap = jnp.where(m, top2[..., 0] - top2[..., 1], jnp.inf)
    return jnp.all(hit | ~m, axis=-1), jnp.min(gap, axis=-1)


def make_train_step(shape: ModelShape, optimizer):
    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(answer_loss)(params, batch, shape)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


# ----------------------------------------------------------------------------- evaluation


def prompt_ids(tokenizer, prompts: list[str], fmt: str) -> list[list[int]]:
    """Token ids of each prompt awaiting its answer, as a conversation or raw."""
    heads = [render(tokenizer, p, fmt)[0] for p in prompts]
    return [e.ids for e in tokenizer.backend_tokenizer.encode_batch(heads,
                                                                    add_special_tokens=False)]


def right_padded(heads: list[list[int]], tails: list[list[int]]):
    """ids [N, T+1] of head + tail per row, right-padded, and a mask over the tails."""
    width = max(SEQ_LEN, max(len(h) + len(t) for h, t in zip(heads, tails, strict=True))) + 1
    ids = np.full((len(heads), width), PAD_ID, np.int32)
    mask = np.zeros((len(heads), width), np.float32)
    for i, (h, t) in enumerate(zip(heads, tails, strict=True)):
        ids[i, : len(h) + len(t)] = h + t
        mask[i, len(h) : len(h) + len(t)] = 1.0
    return jnp.asarray(ids), jnp.asarray(mask)


def jax_accuracy(params, shape, tokenizer, prompts: list[str], fmt: str = "chat") -> float:
    """Share of prompts whose greedy answer is exactly the expected one (answer, then eos)."""
    marker = demo_tasks.RAW_ANSWER_MARKER if fmt == "raw" else ""
    answers = [tokenizer(marker + demo_tasks.expected_answer(p) + "</s>",
                         add_special_tokens=False).input_ids for p in prompts]
    ok, _ = argmax_agrees(params, *right_padded(prompt_ids(tokenizer, prompts, fmt), answers),
                          shape)
    return float(np.mean(np.asarray(ok)))


def hf_greedy(model_dir: str, prompts: list[str], fmt: str) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, eos included, padding stripped."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if fmt == "raw":  # what a plain completion sends: the prompt after <s>
        texts = [tokenizer.bos_token + p for p in prompts]
    else:
        texts = [tokenizer.apply_chat_template(demo_tasks.chat(p), add_generation_prompt=True,
                                               tokenize=False) for p in prompts]
    enc = tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, do_sample=False, max_new_tokens=MAX_NEW_TOKENS,
                             pad_token_id=PAD_ID, eos_token_id=EOS_ID)
    result = []
    for row in out[:, enc["input_ids"].shape[1]:].tolist():
        result.append(row[: row.index(EOS_ID) + 1] if EOS_ID in row else row)
    return result


def verify_with_transformers(params, shape, model_dir, prompts_by_task):
    """Per (task, format): (transformers accuracy, JAX greedy == transformers greedy, min
    logit gap)."""
    tokenizer = build_tokenizer()
    report = {}
    for task, prompts in prompts_by_task.items():
        for fmt in FORMATS:
            gens = hf_greedy(model_dir, prompts, fmt)
            texts = [tokenizer.decode(g, skip_special_tokens=True) for g in gens]
            acc = np.mean([t == demo_tasks.expected_answer(p)
                           for t, p in zip(texts, prompts, strict=True)])
            same, gap = argmax_agrees(
                params, *right_padded(prompt_ids(tokenizer, prompts, fmt), gens), shape)
            report[task, fmt] = (float(acc), bool(np.all(np.asarray(same))), float(np.min(gap)))
    return report


# ----------------------------------------------------------------------------- checkpoint


def save_checkpoint(out_dir: str, params, shape: ModelShape, tokenizer) -> None:
    from safetensors.numpy import save_file
    from transformers import GenerationConfig, LlamaConfig

    tmp = tempfile.mkdtemp(prefix=".demo-model-", dir=os.path.dirname(os.path.abspath(out_dir)))
    config = LlamaConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim, max_position_embeddings=shape.max_position_embeddings,
        rms_norm_eps=shape.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        tie_word_embeddings=False, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
        pad_token_id=PAD_ID, architectures=["LlamaForCausalLM"], dtype="float32")
    config.save_pretrained(tmp)
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                     max_new_tokens=MAX_NEW_TOKENS).save_pretrained(tmp)
    # The chat template goes inside tokenizer_config.json (not chat_template.jinja), and the
    # class is named by its transformers 4 name too, so older loaders read the same files.
    tokenizer.save_pretrained(tmp, save_jinja_files=False)
    tok_cfg_path = os.path.join(tmp, "tokenizer_config.json")
    with open(tok_cfg_path) as f:
        tok_cfg = json.load(f)
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(tok_cfg_path, "w") as f:
        json.dump(tok_cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    save_file({k: np.asarray(v, np.float32) for k, v in sorted(params.items())},
              os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the files ship in the package
    for name in os.listdir(tmp):
        os.chmod(os.path.join(tmp, name), 0o644)
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)


# ----------------------------------------------------------------------------- main


def cpu_seconds() -> float:
    """CPU time of this process (wall time says little on a shared machine)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def train(args, tokenizer, heldout: dict[str, list[str]]):
    """Train from scratch; returns (params, shape)."""
    shape = ModelShape(
        vocab_size=len(tokenizer), hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size, num_layers=args.layers,
        num_heads=args.heads, num_kv_heads=args.kv_heads)
    params = init_params(shape, jax.random.key(args.seed))
    n_params = sum(int(v.size) for v in params.values())
    print(f"model: {n_params:,} parameters ({4 * n_params / 2**20:.2f} MiB in float32), "
          f"{shape}", flush=True)

    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, args.warmup, args.steps, end_value=args.lr * 0.02)
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.98, weight_decay=args.weight_decay))
    opt_state = optimizer.init(params)
    train_step = make_train_step(shape, optimizer)
    batches = Batcher(tokenizer, args.seed, args.rows)

    batch = batches()
    losses = []
    t_train = time.time()
    for step in range(1, args.steps + 1):
        params, opt_state, loss = train_step(params, opt_state, batch)
        batch = batches()  # built while the step runs (dispatch is asynchronous)
        losses.append(loss)
        if step % args.eval_every == 0 or step == args.steps:
            mean_loss = float(np.mean(np.asarray(jnp.stack(losses))))
            losses = []
            accs = " ".join(f"{t}/{f}={jax_accuracy(params, shape, tokenizer, p[:100], f):.2f}"
                            for t, p in heldout.items() for f in FORMATS)
            print(f"step {step:5d}  loss {mean_loss:.4f}  lr {float(schedule(step)):.2e}  "
                  f"held-out {accs}  {time.time() - t_train:6.0f}s", flush=True)
    train_seconds = time.time() - t_train
    print(f"\ntrained {args.steps} steps in {train_seconds:.0f}s "
          f"({train_seconds / args.steps * 1000:.0f} ms/step); CPU so far {cpu_seconds():.0f}s")
    return params, shape


def load_checkpoint(model_dir: str):
    """(params, shape) of a checkpoint this script wrote."""
    from safetensors.numpy import load_file

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    shape = ModelShape(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
        num_heads=cfg["num_attention_heads"], num_kv_heads=cfg["num_key_value_heads"],
        rope_theta=cfg["rope_parameters"]["rope_theta"], rms_norm_eps=cfg["rms_norm_eps"],
        max_position_embeddings=cfg["max_position_embeddings"])
    weights = load_file(os.path.join(model_dir, "model.safetensors"))
    return {k: jnp.asarray(v) for k, v in weights.items()}, shape


def verify(params, shape, tokenizer, model_dir: str | None, heldout) -> bool:
    """Print held-out accuracies (and, given a checkpoint, transformers' agreement); ok?"""
    ok = True
    for task, prompts in heldout.items():
        for fmt in FORMATS:
            acc = jax_accuracy(params, shape, tokenizer, prompts, fmt)
            print(f"JAX greedy held-out exact accuracy {task:8s} {fmt:4s} {acc:.3f} "
                  f"({len(prompts)} prompts)")
            ok &= acc >= 0.95
    if model_dir is None:
        return ok
    report = verify_with_transformers(params, shape, model_dir, heldout)
    for (task, fmt), (acc, same, gap) in report.items():
        print(f"transformers greedy held-out exact accuracy {task:8s} {fmt:4s} {acc:.3f}  "
              f"JAX greedy == transformers greedy: {same}  min top-2 logit gap {gap:.2f}")
        ok &= acc >= 0.95 and same
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--rows", type=int, default=12, help=f"packed rows of {ROW_LEN} tokens")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--hidden-size", type=int, default=128)
    ap.add_argument("--intermediate-size", type=int, default=384)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--heldout", type=int, default=200, help="held-out prompts per task")
    ap.add_argument("--skip-transformers", action="store_true",
                    help="do not write or verify the checkpoint (for sweeps)")
    ap.add_argument("--verify-only", action="store_true",
                    help="train nothing: check the checkpoint at --out")
    args = ap.parse_args()

    t_start = time.time()
    tokenizer = build_tokenizer()
    heldout = {t: demo_tasks.heldout_prompts(t, args.heldout, seed=args.seed)
               for t in demo_tasks.TASKS}
    if args.verify_only:
        params, shape = load_checkpoint(args.out)
    else:
        params, shape = train(args, tokenizer, heldout)
        if not args.skip_transformers:
            save_checkpoint(args.out, params, shape, tokenizer)
            size = os.path.getsize(os.path.join(args.out, "model.safetensors"))
            print(f"wrote {args.out} (model.safetensors {size / 2**20:.2f} MiB)")
    ok = verify(params, shape, tokenizer, None if args.skip_transformers else args.out, heldout)
    print(f"total {time.time() - t_start:.0f}s wall, {cpu_seconds():.0f}s CPU; "
          f"{'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
