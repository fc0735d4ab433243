"""Tiny random multimodal checkpoints (Gemma 3, Mistral 3, Qwen2.5-VL and Qwen3-VL with a
vision tower) for tests.

`make_tiny_multimodal_checkpoint(tmp_path, family, **text_overrides)` writes what
transformers' `save_pretrained` writes for `Gemma3ForConditionalGeneration` (a
tiny SigLIP tower) or `Mistral3ForConditionalGeneration` (a tiny Pixtral tower):
the hub's layout, `language_model.model.*`. `to_module_layout` renames a copy's
tensors to transformers' module tree (`model.language_model.*`, `lm_head.weight`).
The language model follows tests/models/tiny_checkpoints.py: its shape, its
tokenizer and its init (Gemma's norms around 0).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import torch
from safetensors.torch import load_file, save_file
from transformers import (
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    PixtralVisionConfig,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    SiglipVisionConfig,
)

from tests.models.tiny_checkpoints import BOS_ID, EOS_ID, PAD_ID, make_tiny_tokenizer

TINY_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                   num_attention_heads=2, image_size=16, patch_size=8)
MODEL_CLASSES = {"gemma3": Gemma3ForConditionalGeneration,
                 "mistral3": Mistral3ForConditionalGeneration,
                 "qwen2_vl": Qwen2VLForConditionalGeneration,
                 "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
                 "qwen3_vl": Qwen3VLForConditionalGeneration}
# Qwen's vision towers, as small as they build; the text rope's three sections (time,
# height, width) over head_dim 16's 8 frequencies.
QWEN_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                   out_hidden_size=64, patch_size=4, spatial_merge_size=2, temporal_patch_size=2)
MROPE = dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3])


def _config(family: str, text: dict, tie_word_embeddings: bool):
    if family == "gemma3":
        # Two patches a side pooled to 2x2 = mm_tokens_per_image soft tokens.
        return Gemma3Config(text_config=dict(text),
                            vision_config=SiglipVisionConfig(**TINY_VISION).to_dict(),
                            mm_tokens_per_image=4, tie_word_embeddings=tie_word_embeddings)
    if family == "qwen2_vl":
        return Qwen2VLConfig(
            text_config={"rope_parameters": MROPE, **text},
            vision_config=dict(depth=1, embed_dim=16, hidden_size=64, mlp_ratio=2, num_heads=2,
                               patch_size=4, spatial_merge_size=2, temporal_patch_size=2),
            tie_word_embeddings=tie_word_embeddings)
    if family == "qwen2_5_vl":  # the releases' layout: `model.*`, `visual.*`
        return Qwen2_5_VLConfig(
            text_config={"rope_parameters": MROPE, **text},
            vision_config=dict(QWEN_VISION, fullatt_block_indexes=[0], window_size=16),
            tie_word_embeddings=tie_word_embeddings)
    if family == "qwen3_vl":  # the module tree: `model.language_model.*`, `model.visual.*`
        return Qwen3VLConfig(
            text_config={"rope_parameters": dict(MROPE, mrope_interleaved=True), **text},
            vision_config=dict(QWEN_VISION, deepstack_visual_indexes=[0],
                               num_position_embeddings=16),
            tie_word_embeddings=tie_word_embeddings)
    return Mistral3Config(text_config={"model_type": "mistral", **text},
                          vision_config=PixtralVisionConfig(head_dim=8, **TINY_VISION).to_dict(),
                          tie_word_embeddings=tie_word_embeddings)


def make_tiny_multimodal_checkpoint(tmp_path, family: str = "gemma3", *, seed: int = 0,
                                    tie_word_embeddings: bool | None = None,
                                    **text_overrides) -> str:
    """Saves a random `family` (a MODEL_CLASSES key) wrapper model and returns its
    directory. The head is tied for Gemma 3 and untied for the others unless
    `tie_word_embeddings` says; `text_overrides` are text_config fields."""
    text = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=BOS_ID,
                eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    text.update(text_overrides)
    tied = family == "gemma3" if tie_word_embeddings is None else tie_word_embeddings
    config = _config(family, text, tied)
    torch.manual_seed(seed)
    model = MODEL_CLASSES[family](config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((0.0 if family == "gemma3" else 1.0) + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
    model.config.dtype = "float32"
    out = tempfile.mkdtemp(prefix=f"{family}-mm-", dir=str(tmp_path))
    model.save_pretrained(out)
    make_tiny_tokenizer(text["vocab_size"]).save_pretrained(out)
    return out


# The hub's prefixes -> transformers' module tree.
_MODULE_LAYOUT = (("language_model.model.", "model.language_model."),
                  ("language_model.lm_head.", "lm_head."),
                  ("vision_tower.", "model.vision_tower."),
                  ("multi_modal_projector.", "model.multi_modal_projector."))


def module_layout_name(name: str) -> str:
    for hub, module in _MODULE_LAYOUT:
        if name.startswith(hub):
            return module + name[len(hub):]
    raise AssertionError(f"no layout rule for {name!r}")


def to_module_layout(model_dir: str, tmp_path) -> str:
    """A copy of `model_dir` with its tensors under transformers' module-tree names."""
    out = tempfile.mkdtemp(prefix="module-layout-", dir=str(tmp_path))
    for name in os.listdir(model_dir):
        if name != "model.safetensors":
            shutil.copy2(os.path.join(model_dir, name), out)
    tensors = load_file(os.path.join(model_dir, "model.safetensors"))
    save_file({module_layout_name(k): v for k, v in tensors.items()},
              os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return out
