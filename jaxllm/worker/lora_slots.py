"""Which adapter sits in which slot of the device's LoRA tables, and loading them there.

The runner asks, per step, for the slot of each scheduled request's adapter
(-1: none). An adapter not in a slot is read from its PEFT directory (once;
kept on the host) and written into a free slot, else into the least recently
used slot that no request of this step uses (the scheduler admits at most
`max_loras` distinct adapters among running requests, so one always exists).
A write is one jitted program over every table, compiled at start-up.
"""

from __future__ import annotations

import collections
import math
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxllm.core.sched_output import SchedulerOutput
from jaxllm.lora.config import LoRAConfig
from jaxllm.lora.layers import LORA_PARTS, attach_lora, lora_linears
from jaxllm.lora.peft import PeftAdapter, load_peft_adapter
from jaxllm.lora.request import LoRARequest
from jaxllm.models.decoder_weights import rope_order


def adapter_tables(linears: list[tuple[int, str, nnx.Module]], adapter: PeftAdapter,
                   name: str, residual_scale: float = 1.0,
                   rope_order: np.ndarray | None = None) -> list[np.ndarray]:
    """The adapter's value for one slot of every table (in `table_leaves` order): per
    projection its A `[P, r, *in]` then its B (`LoRA.b_slot`: each part's rows over
    its own output columns only); zeros where the adapter leaves a module out. Ranks
    below the tables' are zero-padded. `residual_scale`: what the model's o_proj and
    down_proj weights carry (`DecoderArch.residual_scale`), which their B takes too;
    `rope_order`: the head dimensions' order the q and k weights were loaded in
    (models/decoder_weights.py `rope_order`), which their B rows take too."""
    out = []
    served = {(layer, m) for layer, proj, _ in linears for m in (proj, *LORA_PARTS[proj])}
    extra = sorted(set(adapter.weights) - served)
    if extra:  # e.g. an MoE layer's expert MLP, which takes no adapter
        layer, module = extra[0]
        raise ValueError(f"LoRA adapter {name!r}: {module} of layer {layer} has no LoRA "
                         "table in this model")
    for layer, proj, linear in linears:
        lora = linear.lora
        a = lora.a[...]
        in_shape = a.shape[3:]
        a_val = np.zeros(a.shape[1:], np.float32)
        b_parts: list[np.ndarray | None] = []
        by_part = _parts_of(adapter, layer, proj, lora, name)
        for p, module in enumerate(LORA_PARTS[proj]):
            ab = by_part[p]
            if ab is None:
                b_parts.append(None)
                continue
            A, B = ab
            r = A.shape[0]
            if A.shape[1] != math.prod(in_shape):
                raise ValueError(f"LoRA adapter {name!r}: {module} of layer {layer} has lora_A "
                                 f"{A.shape}; the model wants in={math.prod(in_shape)}")
            a_val[p, :r] = A.reshape(r, *in_shape)
            out_p = lora.part_shape(p)
            per_head = math.prod(out_p[1:])
            if B.shape[0] % per_head or out_p[0] % (B.shape[0] // per_head):
                raise ValueError(f"LoRA adapter {name!r}: {module} of layer {layer} has lora_B "
                                 f"{B.shape}; the model wants out={math.prod(out_p)}")
            if proj in ("o_proj", "down_proj"):
                B = B * np.float32(residual_scale)
            if rope_order is not None and module in ("q_proj", "k_proj"):
                B = B.reshape(-1, rope_order.size, r)[:, rope_order].reshape(B.shape)
            src = B.shape[0] // per_head
            # kv heads replicated over tensor-parallel shards (models/decoder.py)
            b_parts.append(np.repeat(B.T.reshape(r, src, *out_p[1:]), out_p[0] // src, axis=1))
        out += [a_val, lora.b_slot(b_parts)]
    return out


def _parts_of(adapter: PeftAdapter, layer: int, proj: str, lora: Any,
              name: str) -> list[tuple[np.ndarray, np.ndarray] | None]:
    """Each PEFT part's `(A, B)` of a projection (None: left out). An adapter of a
    checkpoint that fuses the parts itself (Phi-3's `qkv_proj`, `gate_up_proj`) has one
    A for all and B's rows stacked: q's, then k's and v's equal shares; gate's, up's."""
    parts = LORA_PARTS[proj]
    fused = adapter.weights.get((layer, proj)) if len(parts) > 1 else None
    if fused is None:
        return [adapter.weights.get((layer, m)) for m in parts]
    if any((layer, m) in adapter.weights for m in parts):
        raise ValueError(f"LoRA adapter {name!r}: layer {layer} has both {proj} and its parts")
    a, b = fused
    rows = b.shape[0]
    first = math.prod(lora.part_shape(0)) if len(parts) == 3 else rows // 2
    cuts = [first, (rows + first) // 2][:len(parts) - 1]
    if (rows - first) % (len(parts) - 1):
        raise ValueError(f"LoRA adapter {name!r}: {proj} of layer {layer} has lora_B "
                         f"{b.shape}, which does not split into {', '.join(parts)}")
    return [(a, piece) for piece in np.split(b, cuts, axis=0)]


def table_leaves(linears: list[tuple[int, str, nnx.Module]]) -> list[jax.Array]:
    return [arr for _, _, linear in linears
            for arr in (linear.lora.a[...], linear.lora.b[...])]


class LoRASlots:
    """The slot table of one runner; writes adapters into `state` (the runner's weight
    list, updated in place)."""

    @staticmethod
    def attach(model: nnx.Module, mesh: jax.sharding.Mesh, config: LoRAConfig | None) -> None:
        """Gives the loaded model its (zero) adapter tables when LoRA is on."""
        if config is not None:
            attach_lora(model, mesh, config.max_loras, config.max_lora_rank)

    @classmethod
    def create(cls, model: nnx.Module, state: list[jax.Array], config: LoRAConfig | None,
               programs: Any) -> LoRASlots | None:
        """The slot table of a runner whose model has tables (None when LoRA is off); it
        gives the step programs their LoRA argument for precompiling (no adapter) and
        compiles its slot write now, so that serving never compiles."""
        if config is None:
            return None
        slots = cls(model, state, config.max_loras, config.max_lora_rank,
                    programs.buckets.max_num_seqs)
        # Host arrays, as the packed step inputs: the step's call copies them with its
        # launch, where a separate device_put would wait for the step in flight.
        programs.lora_args = (np.full(slots.num_rows, -1, np.int32),)
        slots.precompile()
        return slots

    def __init__(self, model: nnx.Module, state: list[jax.Array], max_loras: int,
                 max_lora_rank: int, num_rows: int):
        self.num_rows = num_rows
        self.last_args: tuple = ()  # the last step's program argument (prompt logprobs)
        self.linears = lora_linears(model)
        self.residual_scale = model.arch.residual_scale
        self.rope_order = rope_order(model.arch)
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.state = state
        position = {id(leaf): i for i, leaf in enumerate(state)}
        self.indices = [position[id(t)] for t in table_leaves(self.linears)]
        shardings = [state[i].sharding for i in self.indices]
        self._write = jax.jit(lambda tables, values, slot: [
            t.at[slot].set(v.astype(t.dtype)) for t, v in zip(tables, values, strict=True)],
            donate_argnums=0, out_shardings=shardings)
        self.slot_of: collections.OrderedDict[int, int] = collections.OrderedDict()  # LRU first
        self.host: dict[int, list[np.ndarray]] = {}
        self.req_lora: dict[str, LoRARequest] = {}
        self.loads = 0  # adapters written into slots (tests, metrics)

    def precompile(self) -> None:
        """Compiles the slot write (zeros into slot 0, which no adapter holds yet)."""
        self._store([np.zeros(self.state[i].shape[1:], self.state[i].dtype)
                     for i in self.indices], 0)

    def step_args(self, so: SchedulerOutput) -> tuple:
        """The forward's LoRA argument for step `so`: each request's slot `[num_rows]`
        (a host array, like the step's other inputs), its adapters loaded first. Also
        follows the requests that start and end."""
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.req_lora.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            if new.lora_request is not None:
                self.req_lora[new.req_id] = new.lora_request
        slots = self.step_slots(so.req_ids, self.num_rows)
        self.last_args = (slots,)
        return self.last_args

    def remove_adapter(self, lora_int_id: int) -> None:
        """Forgets an unloaded adapter (its slot becomes free; its host copy goes)."""
        self.slot_of.pop(lora_int_id, None)
        self.host.pop(lora_int_id, None)

    def step_slots(self, req_ids: list[str], num_rows: int) -> np.ndarray:
        """`[num_rows]` int32: each request's slot, loading adapters as needed; -1 for
        requests without one and padding rows."""
        slots = np.full(num_rows, -1, np.int32)
        if not self.req_lora:
            return slots
        get = self.req_lora.get
        wanted = [get(r) for r in req_ids]
        # Each distinct adapter once (a step holds at most max_loras of them).
        distinct = {lr.lora_int_id: lr for lr in wanted if lr is not None}
        in_step = set(distinct)
        slot = {key: self._slot(lr, in_step) for key, lr in distinct.items()}
        slots[:len(req_ids)] = [-1 if lr is None else slot[lr.lora_int_id] for lr in wanted]
        return slots

    def _slot(self, lr: LoRARequest, in_step: set[int]) -> int:
        key = lr.lora_int_id
        if key in self.slot_of:
            self.slot_of.move_to_end(key)
            return self.slot_of[key]
        taken = set(self.slot_of.values())
        free = [s for s in range(self.max_loras) if s not in taken]
        if free:
            slot = free[0]
        else:
            victim = next((k for k in self.slot_of if k not in in_step), None)
            if victim is None:
                raise RuntimeError(f"more than max_loras={self.max_loras} adapters in one step")
            slot = self.slot_of.pop(victim)
            self.host.pop(victim, None)  # read again from disk if it comes back
        if key not in self.host:
            adapter = load_peft_adapter(lr.lora_path, self.max_lora_rank)
            self.host[key] = adapter_tables(self.linears, adapter, lr.lora_name,
                                            self.residual_scale, self.rope_order)
        self._store(self.host[key], slot)
        self.slot_of[key] = slot
        self.loads += 1
        return slot

    def _store(self, values: list[np.ndarray], slot: int) -> None:
        tables = [self.state[i] for i in self.indices]
        for i, t in zip(self.indices, self._write(tables, values, np.int32(slot)), strict=True):
            self.state[i] = t


def lora_args(slots: LoRASlots | None) -> tuple:
    """The last step's LoRA program argument; none when LoRA is off."""
    return () if slots is None else slots.last_args
