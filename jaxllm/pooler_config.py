"""How a model turns hidden states into one embedding, or a cross-encoder its logits into
probabilities and scores: the pooling and activations its checkpoint asks for.

A sentence-transformers checkpoint says it in `modules.json` (a `Pooling`
module whose folder holds `config.json`, and an optional `Normalize` module)
and caps its input in `sentence_bert_config.json` (`max_seq_length`). Without
those files an encoder pools its CLS token and a decoder its last token, both
normalized, as vLLM defaults them. A cross-encoder pools its first token; its
activations follow vLLM's (`classifier_pooler_config`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxllm.errors import ParameterError

POOLING_TYPES = ("MEAN", "CLS", "LAST")

# sentence-transformers' Pooling config key -> our pooling type.
_ST_MODES = {"pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS",
             "pooling_mode_lasttoken": "LAST"}
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                   "pooling_mode_weightedmean_tokens")
_ST_PREFIX = "sentence_transformers.models."


ACTIVATIONS = ("identity", "sigmoid", "softmax", "tanh")

# sentence-transformers' CrossEncoder activation (a torch.nn.modules class) -> ours; a
# Sigmoid or Softmax is the classify activation, as vLLM maps them.
_ST_ACTIVATIONS = {"torch.nn.modules.linear.Identity": "identity",
                   "torch.nn.modules.activation.Sigmoid": None,
                   "torch.nn.modules.activation.Softmax": None,
                   "torch.nn.modules.activation.Tanh": "tanh"}


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str  # MEAN | CLS | LAST
    normalize: bool  # the default of PoolingParams.normalize
    max_seq_length: int | None = None  # sentence-transformers' input cap, if it sets one
    # A cross-encoder's activations of its logits, one of ACTIVATIONS.
    classify_activation: str = "softmax"  # for "classify"
    score_activation: str = "sigmoid"  # for "score"


def classifier_pooler_config(hf_config: Any, num_labels: int) -> PoolerConfig:
    """A cross-encoder's pooling (its first token) and activations, as vLLM's: classify
    follows transformers' `problem_type` (regression: none; multi-label: sigmoid; else
    sigmoid for one label, softmax over several); score takes sentence-transformers'
    `activation_fn` (config.json `sentence_transformers` or
    `sbert_ce_default_activation_function`) where one is set, else the classify one."""
    problem = getattr(hf_config, "problem_type", None) or ""
    if problem == "regression":
        classify = "identity"
    elif problem == "multi_label_classification" or num_labels < 2:
        classify = "sigmoid"
    else:
        classify = "softmax"
    st = getattr(hf_config, "sentence_transformers", None)
    field, name = "config.json:sbert_ce_default_activation_function", None
    if isinstance(st, dict) and st.get("activation_fn"):
        field, name = "config.json:sentence_transformers.activation_fn", st["activation_fn"]
    else:
        name = getattr(hf_config, "sbert_ce_default_activation_function", None)
    score = classify
    if name:
        if name not in _ST_ACTIVATIONS:
            raise ParameterError(field, f"{name!r} is not supported; supported: "
                                 f"{', '.join(_ST_ACTIVATIONS)}")
        score = _ST_ACTIVATIONS[name] or classify
    return PoolerConfig("CLS", False, classify_activation=classify, score_activation=score)


def activate(kind: str, logits: np.ndarray) -> np.ndarray:
    """One request's logits `[num_labels]` under activation `kind` (ACTIVATIONS)."""
    x = np.asarray(logits, np.float64)
    if kind == "sigmoid":
        return 1.0 / (1.0 + np.exp(-x))
    if kind == "softmax":
        e = np.exp(x - x.max())
        return e / e.sum()
    if kind == "tanh":
        return np.tanh(x)
    return x


def _read_json(path: str) -> object:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ParameterError("model", f"cannot read {path}: {e}") from e


def load_pooler_config(model_dir: str, is_encoder: bool) -> PoolerConfig:
    """The checkpoint's pooling (sentence-transformers files), else the default."""
    default = PoolerConfig("CLS" if is_encoder else "LAST", True)
    modules_path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(modules_path):
        return default
    modules = _read_json(modules_path)
    if not isinstance(modules, list):
        raise ParameterError("modules.json", f"{modules_path} must hold a list of modules")
    pooling_type, normalize = default.pooling_type, False
    for module in modules:
        kind = str(module.get("type", "")).removeprefix(_ST_PREFIX)
        if kind == "Pooling":
            pooling_type = _st_pooling_type(os.path.join(model_dir, module.get("path", ""),
                                                         "config.json"))
        elif kind == "Normalize":
            normalize = True
        elif kind != "Transformer":
            raise ParameterError("modules.json", f"module {kind!r} is not supported; "
                                 "supported: Transformer, Pooling, Normalize")
    max_len = None
    st_path = os.path.join(model_dir, "sentence_bert_config.json")
    if os.path.isfile(st_path):
        st = _read_json(st_path)
        if isinstance(st, dict) and st.get("max_seq_length"):
            max_len = int(st["max_seq_length"])
    return PoolerConfig(pooling_type, normalize, max_len)


def _st_pooling_type(path: str) -> str:
    cfg = _read_json(path)
    if not isinstance(cfg, dict):
        raise ParameterError("1_Pooling/config.json", f"{path} must hold an object")
    if cfg.get("pooling_mode"):  # newer sentence-transformers name the mode directly
        mode = str(cfg["pooling_mode"]).lower()
        named = {"mean": "MEAN", "cls": "CLS", "lasttoken": "LAST"}
        if mode not in named:
            raise ParameterError("1_Pooling/config.json:pooling_mode",
                                 f"{mode!r} is not supported; supported: {sorted(named)}")
        return named[mode]
    bad = [k for k in _ST_UNSUPPORTED if cfg.get(k)]
    if bad:
        raise ParameterError(f"1_Pooling/config.json:{bad[0]}", "is not supported; "
                             f"supported: {', '.join(_ST_MODES)}")
    modes = [t for k, t in _ST_MODES.items() if cfg.get(k)]
    if len(modes) != 1:
        raise ParameterError("1_Pooling/config.json", f"{path} must enable exactly one of "
                             f"{', '.join(_ST_MODES)}, got {len(modes)}")
    return modes[0]


def supported_tasks(runner: str, task: str, is_encoder: bool,
                    labels: int | None) -> tuple[str, ...]:
    """What an engine serves (vLLM's task names) for EngineArgs' `runner` and `task`;
    `labels`: a cross-encoder's label count (None for any other model)."""
    runners = ("auto", "generate", "pooling")
    if runner not in runners:
        raise ParameterError("runner", f"must be one of {runners}, got {runner!r}")
    tasks = ("auto", "generate", "embed")
    if task not in tasks:
        raise ParameterError("task", f"must be one of {tasks}, got {task!r}")
    if runner == "auto" and task != "auto":
        runner = "pooling" if task == "embed" else "generate"
    if labels is not None:  # it scores pairs only with one logit, as vLLM's rule
        if runner == "generate" or task == "embed":
            raise ParameterError("runner" if runner == "generate" else "task",
                                 "this model is a cross-encoder: it classifies and "
                                 "scores (runner='pooling'); it cannot generate or embed")
        return ("classify", "score") if labels == 1 else ("classify",)
    if is_encoder:
        if runner == "generate":
            raise ParameterError("runner", "this model is an encoder: it only embeds "
                                 "(runner='pooling'); it cannot generate")
        return ("embed",)
    return {"auto": ("generate", "embed"), "generate": ("generate",),
            "pooling": ("embed",)}[runner]
