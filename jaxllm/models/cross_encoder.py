"""Cross-encoders (Hugging Face `BertForSequenceClassification`, `RobertaForSequenceClassification`,
`XLMRobertaForSequenceClassification`): the encoders of bert.py with a classification head.

The runner pools each request's first token (`[CLS]` / `<s>`) and hands it to `classify`,
which returns `num_labels` float32 logits. Both families' heads are a dense layer with
tanh, then a projection to the labels: BERT's are its pooler (`bert.pooler.dense`) and
`classifier`; RoBERTa's are `classifier.dense` and `classifier.out_proj`. Dropout is off
at inference. The head is small and replicated over the mesh.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxllm.errors import ParameterError
from jaxllm.layers.linear import make_param as _param
from jaxllm.models.bert import BertModel, RobertaModel, trunk_weight_map
from jaxllm.models.contract import WeightSource


def num_labels(hf_config: Any) -> int:
    """The classifier's output count: `id2label`'s size, as transformers derives it."""
    labels = getattr(hf_config, "id2label", None)
    count = len(labels) if labels else int(getattr(hf_config, "num_labels", 0) or 0)
    if count < 1:
        raise ParameterError("config.json:id2label", "a sequence classifier needs at least "
                             "one label")
    return count


class _Classifier:
    """The head shared by both families; a subclass names its checkpoint tensors."""

    is_classifier = True  # the runner pools CLS and runs `classify` (worker/encoder_runner.py)
    trunk_prefix = ""
    head_tensors: tuple[str, str] = ("", "")  # (dense, output projection) tensor stems

    def _init_head(self, hf_config: Any, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        h, labels = self.arch.hidden_size, num_labels(hf_config)
        self.num_labels = labels
        self.head_dense = _param(rngs, (h, h), dtype, P(None, None))
        self.head_dense_bias = _param(rngs, (h,), dtype, P(None), "zeros")
        self.head_out = _param(rngs, (labels, h), dtype, P(None, None))
        self.head_out_bias = _param(rngs, (labels,), dtype, P(None), "zeros")

    def classify(self, pooled: jax.Array) -> jax.Array:
        """Float32 logits `[R, num_labels]` of pooled first-token states `[R, hidden]`."""
        f32 = jnp.float32
        x = jnp.tanh(pooled.astype(f32) @ self.head_dense[...].astype(f32).T
                     + self.head_dense_bias[...].astype(f32))
        return x @ self.head_out[...].astype(f32).T + self.head_out_bias[...].astype(f32)

    @classmethod
    def hf_weight_map(cls, hf_config: Any, tensor_parallel_size: int = 1) -> list[WeightSource]:
        """The trunk under the task model's prefix, then the head."""
        dense, out = cls.head_tensors
        out_sources = trunk_weight_map(cls.arch_from_hf_config(hf_config), cls.trunk_prefix)
        for path, stem in (("head_dense", dense), ("head_out", out)):
            out_sources += [WeightSource((path,), (stem + ".weight",), lambda ts: ts[0]),
                            WeightSource((path + "_bias",), (stem + ".bias",), lambda ts: ts[0])]
        return out_sources

    @classmethod
    def hf_checkpoint_renames(cls, hf_config: Any, names: set[str]) -> dict[str, str]:
        """None: classifier checkpoints carry transformers' own names."""
        return {}

    @classmethod
    def hf_ignored_tensor(cls, hf_config: Any, name: str) -> bool:
        """The position and token-type buffers old exporters saved."""
        return name in (cls.trunk_prefix + "embeddings.position_ids",
                        cls.trunk_prefix + "embeddings.token_type_ids")


class BertForSequenceClassification(_Classifier, BertModel):
    """BERT with its pooler (dense + tanh on `[CLS]`) and a linear classifier."""

    trunk_prefix = "bert."
    head_tensors = ("bert.pooler.dense", "classifier")

    def __init__(self, hf_config: Any, *, dtype: str | jnp.dtype, rngs: nnx.Rngs,
                 **kwargs: Any):
        super().__init__(hf_config, dtype=dtype, rngs=rngs, **kwargs)
        self._init_head(hf_config, jnp.dtype(dtype), rngs)


class RobertaForSequenceClassification(_Classifier, RobertaModel):
    """RoBERTa / XLM-RoBERTa with its classification head (dense + tanh on `<s>`, then
    `out_proj`)."""

    trunk_prefix = "roberta."
    head_tensors = ("classifier.dense", "classifier.out_proj")

    def __init__(self, hf_config: Any, *, dtype: str | jnp.dtype, rngs: nnx.Rngs,
                 **kwargs: Any):
        super().__init__(hf_config, dtype=dtype, rngs=rngs, **kwargs)
        self._init_head(hf_config, jnp.dtype(dtype), rngs)
