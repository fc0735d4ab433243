"""The device-side adapter tables and the batched LoRA product of one `Linear`.

Each LoRA-enabled `Linear` carries a `LoRA` module with two tables, A and B (B
pre-scaled); a slot never written is zeros. A fused projection has P parts
(qkv's q/k/v along its group axis, gate/up along axis 0): A is `[max_loras, P, r,
*in]`, one input map per part. B holds each part's rows only over that part's own
output columns, so it has no zero blocks: `[max_loras, r, E, *rest]`, where E is
the entries of the part axis (qkv: G query entries, then k, then v; gate_up: 2)
and `rest` the other output axes. A one-part projection (o, down) keeps
`[max_loras, 1, r, *out]`.

Per step the runner sets `masks`: for the step's rows, a one-hot `[rows,
max_loras]` of each row's slot (all zeros for a row without an adapter). The term
is two dense products over every slot at once: `xa = (x @ A.T) * mask`, then for a
fused projection one product batched over the E entries, each contracting its
part's `max_loras * r` columns of `xa` with its own columns of B (qkv's query
entries all read the q part: a gather of the small `xa` along its part axis), so
the output comes out `[T, *out]` with no concatenation. B's slot and rank axes
lead its entry axis so that each entry's contracted axes sit together: a GEMM
reads them in place as one strided matrix, where the entry axis between them
would call for a transposed copy of B. Fixed shapes, no gather of per-token
weights and no loop. A and B shard as the base weight: B along its output axes
(column-parallel), A along its input axes (row-parallel).
"""

from __future__ import annotations

import string

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxllm.errors import ParameterError
from jaxllm.layers.linear import Linear

# A fused projection's PEFT parts, in the order they sit along its part axis.
LORA_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
              "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",),
              "up_proj": ("up_proj",)}  # a non-gated MLP's (Arcee)


def _placed(mesh: jax.sharding.Mesh, shape: tuple[int, ...], dtype: jnp.dtype,
            spec: P) -> nnx.Param:
    value = jax.device_put(np.zeros(shape, dtype), NamedSharding(mesh, spec))
    return nnx.Param(value, out_sharding=spec, eager_sharding=False)


class LoRA(nnx.Module):
    """Every slot's adapter for one projection with weight `[*out, *in]` sharded `spec`;
    `parts`: each part's entries along the output axis `part_axis`."""

    def __init__(self, mesh: jax.sharding.Mesh, max_loras: int, rank: int,
                 out_shape: tuple[int, ...], in_shape: tuple[int, ...], spec: tuple,
                 parts: tuple[int, ...], part_axis: int, dtype: jnp.dtype):
        n_out = len(out_shape)
        out_spec, in_spec = spec[:n_out], spec[n_out:]
        self.in_dims, self.out_dims = len(in_shape), n_out
        self.out_shape = tuple(out_shape)
        # Part p's output entries along `part_axis` (the PEFT module it stands for).
        self.part_bounds = tuple(int(x) for x in np.cumsum((0,) + tuple(parts)))
        self.part_axis = part_axis
        self.a = _placed(mesh, (max_loras, len(parts), rank, *in_shape), dtype,
                         P(None, None, None, *in_spec))
        if len(parts) == 1:
            self.entry_part = None
            b_shape, b_spec = (max_loras, 1, rank, *out_shape), out_spec
        else:
            if self.part_bounds[-1] != out_shape[part_axis] or out_spec[part_axis] is not None:
                raise ValueError(f"LoRA parts {parts} must tile the unsharded output axis "
                                 f"{part_axis} of {out_shape} (spec {out_spec})")
            # Which part each entry of the part axis belongs to.
            self.entry_part = tuple(p for p, n in enumerate(parts) for _ in range(n))
            rest = [i for i in range(n_out) if i != part_axis]
            b_shape = (max_loras, rank, out_shape[part_axis], *(out_shape[i] for i in rest))
            b_spec = tuple(out_spec[i] for i in rest)
        self.b = _placed(mesh, b_shape, dtype, P(None, None, None, *b_spec))
        self.masks: dict[int, jax.Array] | None = nnx.data(None)  # set per step

    def __call__(self, x: jax.Array) -> jax.Array:
        """The adapters' term for `x [T, *in]` (each row its own slot): `[T, *out]`."""
        mask = self.masks[x.shape[0]]
        ins = string.ascii_lowercase[:self.in_dims]
        outs = string.ascii_lowercase[self.in_dims:self.in_dims + self.out_dims]
        xa = jnp.einsum(f"T{ins},LPR{ins}->TLPR", x, self.a[...])
        xa = xa * mask.astype(xa.dtype)[:, :, None, None]
        if self.entry_part is None:
            return jnp.einsum(f"TLPR,LPR{outs}->T{outs}", xa, self.b[...])
        if self.entry_part != tuple(range(len(self.entry_part))):
            xa = xa[:, :, np.asarray(self.entry_part, np.int32)]  # [T, L, E, R]
        rest = outs[:self.part_axis] + outs[self.part_axis + 1:]
        out = outs[:self.part_axis] + "E" + outs[self.part_axis + 1:]
        return jnp.einsum(f"TLER,LRE{rest}->T{out}", xa, self.b[...])

    def part_shape(self, p: int) -> tuple[int, ...]:
        """Part p's output shape: `out` with only its own entries along the part axis."""
        shape = list(self.out_shape)
        shape[self.part_axis] = self.part_bounds[p + 1] - self.part_bounds[p]
        return tuple(shape)

    def b_slot(self, parts: list[np.ndarray | None]) -> np.ndarray:
        """One slot's B table (`b.shape[1:]`, float32) from each part's `[r_p,
        *part_shape(p)]` (None: the adapter leaves the part out); a rank below the
        table's is zero-padded."""
        value = np.zeros(self.b[...].shape[1:], np.float32)
        for p, part in enumerate(parts):
            if part is None:
                continue
            if part.shape[1:] != self.part_shape(p):
                raise ValueError(f"LoRA B part {p} has shape {part.shape[1:]}; the table "
                                 f"wants {self.part_shape(p)}")
            r = part.shape[0]
            if self.entry_part is None:
                value[0, :r] = part
            else:  # the entry axis after the rank: [r, E_p, *rest]
                lo, hi = self.part_bounds[p], self.part_bounds[p + 1]
                value[:r, lo:hi] = np.moveaxis(part, 1 + self.part_axis, 1)
        return value


def lora_linears(model: nnx.Module) -> list[tuple[int, str, nnx.Module]]:
    """(layer, projection name, Linear) of every projection an adapter may target."""
    out = []
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if not hasattr(attn, "qkv_proj"):  # DeepSeek's latent attention (models/mla.py)
            raise ParameterError("enable_lora", "LoRA is not supported for models with "
                                 "multi-head latent attention (DeepSeek-V2/V3)")
        out += [(i, "qkv_proj", attn.qkv_proj), (i, "o_proj", attn.o_proj)]
        if isinstance(getattr(mlp, "gate_up_proj", None), Linear):  # dense, not experts
            out += [(i, "gate_up_proj", mlp.gate_up_proj), (i, "down_proj", mlp.down_proj)]
        elif isinstance(getattr(mlp, "up_proj", None), Linear):  # non-gated
            out += [(i, "up_proj", mlp.up_proj), (i, "down_proj", mlp.down_proj)]
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
