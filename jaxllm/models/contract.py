"""The model contract: what the loader and the model runner may ask of a causal LM.

A model class (registered in models/registry.py) is built as
`cls(hf_config, *, dtype, rngs, attn_backend, swiglu, tensor_parallel_size=1)`
and offers what `CausalLM` lists: the forward over a ragged paged batch and its
two variants for the runner's step (`forward_rows`, `finish_states`), the
logits head (`logits_head`, a weight, and `head_logits`, a static function of
it, so the logits step takes one array), the checkpoint weight map and the KV
cache's shape. `models/decoder.py` implements all of it once for every decoder
family; a family only configures it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.layers.attention import AttentionMetadata
from jaxllm.layers.precision import products_at


class KVCacheSpec(NamedTuple):
    """What the runner needs to size and shape the KV cache (whole model, over every
    'model' shard; `num_kv_heads` counts replicated kv heads, see models/decoder.py)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    def bytes_per_token(self, dtype: str | jnp.dtype) -> int:
        """K and V of one token over all layers; per device divide by tensor_parallel_size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * jnp.dtype(dtype).itemsize


@dataclasses.dataclass(frozen=True)
class WeightSource:
    """How one parameter is built from checkpoint tensors (numpy, on the host)."""

    path: tuple[str | int, ...]  # the parameter's path in the module state
    tensors: tuple[str, ...]  # HF tensor names it is built from
    combine: Callable[[list[np.ndarray]], np.ndarray]


@dataclasses.dataclass(frozen=True)
class LogitsHead:
    """Float32 logits `[N, vocab]` (sharded over vocab on 'model') for hidden `[N, H]`
    from the `[vocab, H]` head matrix, times `scale` where the family scales them
    (Granite), soft-capped (`cap * tanh(logits / cap)`) where it caps them (Gemma 2).
    Hashable: the runner's compiled steps are cached per head function."""

    soft_cap: float | None = None
    scale: float = 1.0

    def __call__(self, head: jax.Array, hidden: jax.Array) -> jax.Array:
        with products_at(head.dtype):
            logits = jnp.einsum("nh,vh->nv", hidden.astype(head.dtype), head,
                                preferred_element_type=jnp.float32)
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.soft_cap is not None:
            logits = self.soft_cap * jnp.tanh(logits / self.soft_cap)
        return logits


class CausalLM(Protocol):
    """A decoder-only LM over a ragged, paged batch (one KV cache array for all
    layers, `num_layers` equal runs of pages along axis 0; layers/attention.py)."""

    head_logits: LogitsHead

    def __call__(self, input_ids: jax.Array, positions: jax.Array, kv_cache: jax.Array,
                 md: AttentionMetadata) -> tuple[jax.Array, jax.Array]:
        """Hidden states after the final norm `[T, hidden]` and the updated cache."""

    def forward_rows(self, input_ids: jax.Array, positions: jax.Array, kv_cache: jax.Array,
                     md: AttentionMetadata, rows: jax.Array
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Hidden states of `rows` only `[R, hidden]`, the updated cache, and the
        residual stream entering the last layer (for `finish_states`)."""

    def finish_states(self, states: jax.Array, positions: jax.Array, kv_cache: jax.Array,
                      md: AttentionMetadata) -> jax.Array:
        """Every row's hidden state from `forward_rows`' states and cache."""

    @property
    def logits_head(self) -> nnx.Param:
        """The `[vocab, H]` matrix the logits come from."""

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """`head_logits(logits_head, hidden)`."""

    @staticmethod
    def hf_weight_map(hf_config: Any, tensor_parallel_size: int = 1) -> list[WeightSource]:
        """Where each parameter comes from in a Hugging Face checkpoint."""

    @staticmethod
    def hf_ignored_tensor(hf_config: Any, name: str) -> bool:
        """Checkpoint tensors that are present but carry nothing the model needs."""

    @staticmethod
    def kv_cache_spec(hf_config: Any, tensor_parallel_size: int = 1) -> KVCacheSpec:
        """The KV cache's shape parameters."""
