"""An EAGLE / EAGLE-3 head checkpoint (vLLM's llama_eagle / llama_eagle3 layout), checked
against its target before anything loads.

The head is one Llama decoder layer over the target's hidden states. EAGLE's
`fc` (2H -> H) reads concat(embed(token), target final hidden); its layer has no
input norm, and it shares the target's embedding and logits head. EAGLE-3's
`fc` (3H -> H) reads the residual stream entering three target layers
(ascending, as vLLM's loop collects them; `eagle_aux_hidden_state_layer_ids`,
else vLLM's default (2, L // 2, L - 3)); its layer attends over
concat(input_layernorm(embeds), hidden_norm(hidden)) (2H wide), and it has its
own final `norm`, an `lm_head` over `draft_vocab_size` ids and `d2t` (draft id
+ d2t[draft id] = target id). Checkpoint names come bare (`fc.weight`,
`layers.0.*`), under `model.`, or with EAGLE-3's `midlayer.*`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from jaxllm.distributed.mesh import validate_tensor_parallel
from jaxllm.errors import ParameterError

EAGLE_METHODS = ("eagle", "eagle3")
# The config `architectures` each method reads (vLLM's names, and plain Llama's).
ARCHITECTURES = {
    "eagle": ("EagleLlamaForCausalLM", "LlamaForCausalLMEagle", "LlamaForCausalLM"),
    "eagle3": ("Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3", "LlamaForCausalLM"),
}
FIELD = "speculative_config.model"


@dataclass(frozen=True)
class EagleHeadSpec:
    """What the runner needs to build and load a head."""

    method: str  # "eagle" | "eagle3"
    model_dir: str
    hf_config: Any  # transformers' LlamaConfig of the head
    names: dict[str, str]  # canonical name (`fc.weight`, `layers.0.*`) -> checkpoint name
    fc_in: int  # fc's input width
    aux_layers: tuple[int, ...]  # EAGLE-3: target layers whose input residual feeds fc
    draft_vocab_size: int
    own_embed: bool  # the checkpoint carries `embed_tokens` (else the target's)
    fc_bias: bool
    norm_before_residual: bool

    @property
    def eagle3(self) -> bool:
        return self.method == "eagle3"

    @property
    def capture(self) -> tuple[int, ...]:
        """What the target forward hands the head (`forward_captured`'s `layers`): the
        aux layers' input residuals, or () for the final hidden states."""
        return self.aux_layers


def _bad(msg: str) -> ParameterError:
    return ParameterError(FIELD, msg)


def _checkpoint_shapes(model_dir: str) -> dict[str, list[int]]:
    """Tensor name -> shape, from the headers of the directory's safetensors files."""
    shapes: dict[str, list[int]] = {}
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise _bad(f"no safetensors weights in head {model_dir!r}")
    for name in files:
        try:
            with open(os.path.join(model_dir, name), "rb") as f:
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        except (OSError, ValueError) as e:
            raise _bad(f"head {model_dir!r}: {name} is not a safetensors file: {e}") from e
        header.pop("__metadata__", None)
        shapes.update({n: list(e["shape"]) for n, e in header.items()})
    return shapes


def canonical(name: str) -> str:
    """A checkpoint tensor's name in the bare layout."""
    name = name.removeprefix("model.")
    return "layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's default EAGLE-3 aux layers for a target of `num_layers`."""
    return (2, num_layers // 2, num_layers - 3)


def read_eagle_head(spec: Any, target_hf_config: Any,
                    tensor_parallel_size: int = 1) -> EagleHeadSpec | None:
    """The head of a SpeculativeConfig `spec` whose method is an EAGLE one (else None),
    checked against the target's config."""
    if spec is None or spec.method not in EAGLE_METHODS:
        return None
    return _read(spec.method, spec.model, target_hf_config, tensor_parallel_size)


def _read(method: str, model_dir: str, target_hf_config: Any,
          tensor_parallel_size: int) -> EagleHeadSpec:
    from transformers import LlamaConfig

    cfg_path = os.path.join(model_dir, "config.json")
    try:
        with open(cfg_path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _bad(f"head {model_dir!r} has no readable config.json: {e}") from e
    archs = raw.get("architectures") or []
    if not any(a in ARCHITECTURES[method] for a in archs):
        raise _bad(f"head architectures {archs} are not an {method} head; expected one of "
                   f"{list(ARCHITECTURES[method])}")
    if raw.get("add_para_norm"):
        raise _bad("HASS heads (add_para_norm) are not supported")
    try:
        # Plain attributes: the config travels to the engine core's process (pickled).
        cfg = SimpleNamespace(**LlamaConfig(**raw).to_dict())
    except Exception as e:  # transformers raises many types for bad configs
        raise _bad(f"head config {cfg_path}: {e}") from e
    h, th = int(cfg.hidden_size), int(target_hf_config.hidden_size)
    if int(getattr(cfg, "num_hidden_layers", 1)) != 1:
        raise _bad(f"the head has {cfg.num_hidden_layers} layers; one is supported")
    if h != th:
        raise _bad(f"the head's hidden_size {h} differs from the target's {th}")
    if int(cfg.vocab_size) != int(target_hf_config.vocab_size):
        raise _bad(f"the head's vocab_size {cfg.vocab_size} differs from the target's "
                   f"{target_hf_config.vocab_size}")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise _bad(f"hidden_act {cfg.hidden_act!r} is not supported; supported: 'silu'")
    try:  # the head's attention splits over the devices as the target's does
        validate_tensor_parallel(cfg, tensor_parallel_size)
    except ParameterError as e:
        raise _bad(f"the head's heads do not split over the devices: {e.message}") from e
    found = _checkpoint_shapes(model_dir)
    names = {canonical(n): n for n in found}
    shapes = {canonical(n): s for n, s in found.items()}
    eagle3 = method == "eagle3"
    aux: tuple[int, ...] = ()
    if eagle3:
        eagle_cfg = raw.get("eagle_config") or {}
        if eagle_cfg.get("use_aux_hidden_state") is False:
            raise _bad("EAGLE-3 heads without aux hidden states are not supported")
        ids = (raw.get("eagle_aux_hidden_state_layer_ids")
               or eagle_cfg.get("eagle_aux_hidden_state_layer_ids"))
        n = int(target_hf_config.num_hidden_layers)
        ids = tuple(ids) if ids else default_aux_layers(n)
        aux = tuple(sorted(set(i for i in ids if isinstance(i, int) and 0 <= i < n)))
        if len(aux) != len(ids):
            raise _bad(f"aux hidden state layers {list(ids)} are not distinct layers of the "
                       f"{n}-layer target")
    fc_in = (len(aux) if eagle3 else 2) * th
    required = ["fc.weight", "layers.0.post_attention_layernorm.weight",
                *(f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"),
                *(f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down"))]
    if eagle3:
        required += ["layers.0.input_layernorm.weight", "layers.0.hidden_norm.weight",
                     "norm.weight", "lm_head.weight"]
    missing = [n for n in required if n not in names]
    if missing:
        raise _bad(f"head {model_dir!r} is missing tensor {missing[0]!r} ({method} layout)")
    if shapes["fc.weight"] != [h, fc_in]:
        raise _bad(f"fc.weight has shape {tuple(shapes['fc.weight'])}; the target's hidden "
                   f"size {th} implies {(h, fc_in)}")
    draft_vocab = int(getattr(cfg, "draft_vocab_size", None) or cfg.vocab_size)
    if eagle3 and shapes["lm_head.weight"] != [draft_vocab, h]:
        raise _bad(f"lm_head.weight has shape {tuple(shapes['lm_head.weight'])}; "
                   f"draft_vocab_size {draft_vocab} implies {(draft_vocab, h)}")
    if eagle3 and draft_vocab != int(cfg.vocab_size) and "d2t" not in names:
        raise _bad(f"draft_vocab_size {draft_vocab} differs from vocab_size without a d2t map")
    return EagleHeadSpec(method, model_dir, cfg, names, fc_in, aux, draft_vocab,
                         "embed_tokens.weight" in names, "fc.bias" in names,
                         bool(getattr(cfg, "norm_before_residual", False)))
