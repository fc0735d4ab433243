"""The device-side adapter tables and the batched LoRA product of one `Linear`.

Each LoRA-enabled `Linear` carries a `LoRA` module with two tables: `a [max_loras,
P, r, *in]` and `b [max_loras, P, r, *out]` (B pre-scaled). A fused projection
has P parts (qkv's q/k/v along its group axis, gate/up along axis 0); part p's
rows of `b` are zero outside its own output columns, so one product covers every
part and no per-part slice or concatenation runs. A slot never written is zeros.
Per step the runner sets `masks`: for the step's rows, a one-hot `[rows,
max_loras]` of each row's slot (all zeros for a row without an adapter), so
`y += ((x @ A.T) * mask) @ B` over every slot at once: two dense products (the
second contracting `max_loras * P * r`, its leading axes), fixed shapes, no gather
of per-token weights and no loop. A and B shard as the base weight: B along its
output axes (column-parallel), A along its input axes (row-parallel).
"""

from __future__ import annotations

import string

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxllm.layers.linear import Linear

# A fused projection's PEFT parts, in the order they sit along its part axis.
LORA_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
              "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def _placed(mesh: jax.sharding.Mesh, shape: tuple[int, ...], dtype: jnp.dtype,
            spec: P) -> nnx.Param:
    value = jax.device_put(np.zeros(shape, dtype), NamedSharding(mesh, spec))
    return nnx.Param(value, out_sharding=spec, eager_sharding=False)


class LoRA(nnx.Module):
    """Every slot's adapter for one projection with weight `[*out, *in]` sharded `spec`."""

    def __init__(self, mesh: jax.sharding.Mesh, max_loras: int, rank: int,
                 out_shape: tuple[int, ...], in_shape: tuple[int, ...], spec: tuple,
                 parts: tuple[int, ...], part_axis: int, dtype: jnp.dtype):
        n_out = len(out_shape)
        out_spec, in_spec = spec[:n_out], spec[n_out:]
        self.in_dims, self.out_dims = len(in_shape), n_out
        # Part p's output columns along `part_axis` (the PEFT module it stands for).
        self.part_bounds = tuple(int(x) for x in np.cumsum((0,) + tuple(parts)))
        self.part_axis = part_axis
        self.a = _placed(mesh, (max_loras, len(parts), rank, *in_shape), dtype,
                         P(None, None, None, *in_spec))
        self.b = _placed(mesh, (max_loras, len(parts), rank, *out_shape), dtype,
                         P(None, None, None, *out_spec))
        self.masks: dict[int, jax.Array] | None = nnx.data(None)  # set per step

    def __call__(self, x: jax.Array) -> jax.Array:
        """The adapters' term for `x [T, *in]` (each row its own slot): `[T, *out]`."""
        mask = self.masks[x.shape[0]]
        ins = string.ascii_lowercase[:self.in_dims]
        outs = string.ascii_lowercase[self.in_dims:self.in_dims + self.out_dims]
        xa = jnp.einsum(f"T{ins},LPR{ins}->TLPR", x, self.a[...])
        xa = xa * mask.astype(xa.dtype)[:, :, None, None]
        return jnp.einsum(f"TLPR,LPR{outs}->T{outs}", xa, self.b[...])


def lora_linears(model: nnx.Module) -> list[tuple[int, str, nnx.Module]]:
    """(layer, projection name, Linear) of every projection an adapter may target."""
    out = []
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        out += [(i, "qkv_proj", attn.qkv_proj), (i, "o_proj", attn.o_proj)]
        if isinstance(getattr(mlp, "gate_up_proj", None), Linear):  # dense, not experts
            out += [(i, "gate_up_proj", mlp.gate_up_proj), (i, "down_proj", mlp.down_proj)]
    return out


def attach_lora(model: nnx.Module, mesh: jax.sharding.Mesh, max_loras: int, rank: int) -> None:
    """Gives every targetable projection of a loaded decoder its (zero) adapter table."""
    group = model.arch.group
    for _, name, linear in lora_linears(model):
        w = linear.weight[...]
        out_shape, in_shape = w.shape[:w.ndim - linear.in_dims], w.shape[w.ndim - linear.in_dims:]
        spec = tuple(getattr(w.sharding, "spec", ())) + (None,) * w.ndim
        parts, axis = {"qkv_proj": ((group, 1, 1), 1),
                       "gate_up_proj": ((1, 1), 0)}.get(name, ((out_shape[0],), 0))
        linear.lora = LoRA(mesh, max_loras, rank, out_shape, in_shape, spec[:w.ndim], parts,
                           axis, w.dtype)


def set_lora_masks(model: nnx.Module, slots: jax.Array, cu_q_lens: jax.Array,
                   num_tokens: int) -> None:
    """Hands every adapter table this step's row-to-slot one-hots (`step_lora_masks`)."""
    linears = lora_linears(model)
    masks = step_lora_masks(slots, cu_q_lens, num_tokens, linears[0][2].lora.a.shape[0])
    for _, _, linear in linears:
        linear.lora.masks = masks


def step_lora_masks(slots: jax.Array, cu_q_lens: jax.Array, num_tokens: int,
                    max_loras: int) -> dict[int, jax.Array]:
    """One-hots `[rows, max_loras]` by row count: for the step's `num_tokens` tokens,
    and for its requests' last rows (`slots [num_reqs]`, -1 for none; the last layer
    may run on those rows alone). A token's slot is its request's, found from
    `cu_q_lens`; padding tokens get none."""
    # Compared with every request's end in one pass: the default binary search is a
    # loop, launched step by step.
    req = jnp.searchsorted(cu_q_lens[1:], jnp.arange(num_tokens, dtype=jnp.int32),
                           side="right", method="compare_all")
    padded = jnp.concatenate([slots, jnp.full((1,), -1, slots.dtype)])
    tok = padded[jnp.minimum(req, slots.shape[0])]
    ids = jnp.arange(max_loras, dtype=slots.dtype)
    masks = {num_tokens: (tok[:, None] == ids).astype(jnp.float32)}
    # Equal counts never take the rows-only path (programs.last_layer_on_rows).
    masks.setdefault(slots.shape[0], (slots[:, None] == ids).astype(jnp.float32))
    return masks
