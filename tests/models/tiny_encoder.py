"""Tiny random encoder checkpoints: embedding models laid out as sentence-transformers saves
one, and cross-encoders as transformers saves a sequence classifier.

`make_tiny_bert(tmp_path, pooling)` writes a transformers `BertModel` (hidden 64,
2 layers, vocab 256, float32), the char-level tokenizer of tiny_checkpoints.py,
and `modules.json` with a `1_Pooling/config.json` for `pooling` ("mean", "cls"
or "lasttoken") and, when `normalize`, a Normalize module. `make_tiny_roberta` does
the same for `RobertaModel` / `XLMRobertaModel` (pad id 1, one token type) with a
RoBERTa-style tokenizer. `make_tiny_cross_encoder(tmp_path, family, num_labels)`
writes a `*ForSequenceClassification` of "bert", "roberta" or "xlm-roberta" with a
tokenizer whose pair encoding is that family's: BERT's `[CLS] a [SEP] b [SEP]` with
token types 0/1, RoBERTa's `<s> a </s></s> b </s>`.
"""

from __future__ import annotations

import json
import os
import string
import tempfile

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    BertModel,
    PreTrainedTokenizerFast,
    RobertaConfig,
    RobertaForSequenceClassification,
    RobertaModel,
    XLMRobertaConfig,
    XLMRobertaForSequenceClassification,
    XLMRobertaModel,
)

from tests.models.tiny_checkpoints import make_tiny_tokenizer

_MODES = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token",
          "lasttoken": "pooling_mode_lasttoken"}
_FIELDS = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, hidden_act="gelu", layer_norm_eps=1e-12)
# family -> (config, embedding model, sequence classifier)
FAMILIES = {
    "bert": (BertConfig, BertModel, BertForSequenceClassification),
    "roberta": (RobertaConfig, RobertaModel, RobertaForSequenceClassification),
    "xlm-roberta": (XLMRobertaConfig, XLMRobertaModel, XLMRobertaForSequenceClassification),
}
BERT_SPECIALS = ["[PAD]", "[CLS]", "[SEP]", "[UNK]"]  # ids 0..3
ROBERTA_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]  # ids 0..3: the pad id is 1


def _family_fields(family: str, overrides: dict) -> dict:
    fields = dict(_FIELDS, max_position_embeddings=128)
    if family == "bert":
        fields.update(type_vocab_size=2, pad_token_id=0)
    else:  # RoBERTa's position table holds padding_idx + 1 rows more than it uses
        fields.update(type_vocab_size=1, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                      max_position_embeddings=130)
    fields.update(overrides)
    return fields


def _widen(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights wider than the default init, so that rows and scores differ clearly."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm.weight" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
    return model.eval()


def pair_tokenizer(family: str, vocab_size: int = 256) -> PreTrainedTokenizerFast:
    """A char-level tokenizer whose single and pair encodings are `family`'s."""
    specials = BERT_SPECIALS if family == "bert" else ROBERTA_SPECIALS
    chars = list(" " + string.ascii_letters + string.digits + string.punctuation + "\n")
    tokens = specials + chars
    tokens += [f"<|extra_{i}|>" for i in range(vocab_size - len(tokens))]
    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(tokens)},
                                     unk_token=specials[3]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    if family == "bert":
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", 1), ("[SEP]", 2)])
        return PreTrainedTokenizerFast(
            tokenizer_object=tok, cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]",
            unk_token="[UNK]", model_input_names=["input_ids", "token_type_ids",
                                                  "attention_mask"])
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", cls_token="<s>",
        sep_token="</s>", pad_token="<pad>", unk_token="<unk>",
        model_input_names=["input_ids", "attention_mask"])


def _write_pooling(out: str, pooling: str, normalize: bool, hidden: int) -> None:
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
    cfg = {"word_embedding_dimension": hidden}
    cfg.update({key: mode == pooling for mode, key in _MODES.items()})
    with open(os.path.join(out, "1_Pooling", "config.json"), "w") as f:
        json.dump(cfg, f)


def make_tiny_bert(tmp_path, pooling: str = "mean", normalize: bool = True,
                   seed: int = 0, **overrides) -> str:
    fields = _family_fields("bert", overrides)
    model = _widen(BertModel(BertConfig(**fields), add_pooling_layer=True), seed)
    out = tempfile.mkdtemp(prefix=f"bert-{pooling}-", dir=str(tmp_path))
    model.save_pretrained(out)
    make_tiny_tokenizer(fields["vocab_size"]).save_pretrained(out)
    _write_pooling(out, pooling, normalize, fields["hidden_size"])
    return out


def make_tiny_roberta(tmp_path, family: str = "xlm-roberta", pooling: str = "mean",
                      normalize: bool = True, seed: int = 0, **overrides) -> str:
    """A `RobertaModel` ("roberta") or `XLMRobertaModel` ("xlm-roberta") embedding model."""
    config_cls, model_cls, _ = FAMILIES[family]
    fields = _family_fields(family, overrides)
    model = _widen(model_cls(config_cls(**fields), add_pooling_layer=True), seed)
    out = tempfile.mkdtemp(prefix=f"{family}-{pooling}-", dir=str(tmp_path))
    model.save_pretrained(out)
    pair_tokenizer(family, fields["vocab_size"]).save_pretrained(out)
    _write_pooling(out, pooling, normalize, fields["hidden_size"])
    return out


def make_tiny_cross_encoder(tmp_path, family: str = "bert", num_labels: int = 1,
                            seed: int = 0, **overrides) -> str:
    """A `*ForSequenceClassification` of `family` with `num_labels` labels."""
    config_cls, _, model_cls = FAMILIES[family]
    fields = _family_fields(family, overrides)
    fields.setdefault("id2label", {i: f"label_{i}" for i in range(num_labels)})
    model = _widen(model_cls(config_cls(**fields)), seed)
    with torch.no_grad():  # a wider output projection spreads the logits over a few units
        for name, p in model.named_parameters():
            if name in ("classifier.weight", "classifier.out_proj.weight"):
                p.normal_(0.0, 0.5)
    out = tempfile.mkdtemp(prefix=f"{family}-ce{num_labels}-", dir=str(tmp_path))
    model.save_pretrained(out)
    pair_tokenizer(family, fields["vocab_size"]).save_pretrained(out)
    return out
