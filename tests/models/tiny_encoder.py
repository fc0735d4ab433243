"""A tiny random BERT checkpoint laid out as sentence-transformers saves one.

`make_tiny_bert(tmp_path, pooling)` writes a transformers `BertModel` (hidden 64,
2 layers, vocab 256, float32), the char-level tokenizer of tiny_checkpoints.py,
and `modules.json` with a `1_Pooling/config.json` for `pooling` ("mean", "cls"
or "lasttoken") and, when `normalize`, a Normalize module.
"""

from __future__ import annotations

import json
import os
import tempfile

import torch
from transformers import BertConfig, BertModel

from tests.models.tiny_checkpoints import make_tiny_tokenizer

_MODES = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token",
          "lasttoken": "pooling_mode_lasttoken"}


def make_tiny_bert(tmp_path, pooling: str = "mean", normalize: bool = True,
                   seed: int = 0, **overrides) -> str:
    fields = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=128, type_vocab_size=2,
                  hidden_act="gelu", layer_norm_eps=1e-12, pad_token_id=0)
    fields.update(overrides)
    torch.manual_seed(seed)
    model = BertModel(BertConfig(**fields), add_pooling_layer=True).eval()
    with torch.no_grad():  # wider than the default init, so that rows differ clearly
        for name, p in model.named_parameters():
            if "LayerNorm.weight" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
    out = tempfile.mkdtemp(prefix=f"bert-{pooling}-", dir=str(tmp_path))
    model.save_pretrained(out)
    make_tiny_tokenizer(fields["vocab_size"]).save_pretrained(out)
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    with open(os.path.join(out, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(out, "1_Pooling"))
    cfg = {"word_embedding_dimension": fields["hidden_size"]}
    cfg.update({key: mode == pooling for mode, key in _MODES.items()})
    with open(os.path.join(out, "1_Pooling", "config.json"), "w") as f:
        json.dump(cfg, f)
    return out
