"""How a token picks its experts from the router's logits (layers/moe.py's SparseMoE).

`route`: softmax over all experts' logits in float32, the `top_k` largest,
renormalized to sum to one when `renormalize` (Mixtral always; that equals a softmax
over the top-k logits; Qwen2/3-MoE iff `norm_topk_prob`).

`grouped_route`, by sigmoid scores within expert groups (DeepSeek-V3's scheme,
GLM-4.5's): each expert scores `sigmoid(logit)` in float32. Choice uses the scores
plus a learned per-expert correction bias: the experts split into `groups` equal
groups, each group ranks by the sum of its two best biased scores, the `topk_groups`
best groups stay, and the `top_k` best biased scores among their experts are the
token's experts. Their weights are the unbiased scores, renormalized to sum to one
where `renormalize`, then times `scale` (the routed scaling factor), so they need not
sum to one. DeepSeek-V2's variant (`softmax`): the scores are the softmax over every
expert's logits, a group ranks by its best score, and there is no correction bias.

Under expert parallelism a device serves only some of the picks: `local_keys` names
each (token, choice) pair's expert among the device's own (padding tokens' and other
devices' pairs: none), and `routed_experts` / `routed_slots` list the distinct ones the
step's real tokens reached, the form the small-step expert paths read.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxllm.errors import ParameterError


def route(logits: jax.Array, top_k: int, renormalize: bool) -> tuple[jax.Array, jax.Array]:
    """(weights `[T, k]` float32, expert ids `[T, k]` int32) for router logits `[T, E]`."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


@dataclass(frozen=True)
class GroupedRouting:
    """The static settings of grouped sigmoid routing."""

    top_k: int
    renormalize: bool
    groups: int = 1
    topk_groups: int = 1
    scale: float = 1.0
    softmax: bool = False  # DeepSeek-V2's softmax scores, groups ranked by their best

    @property
    def bias(self) -> bool:
        """Whether the choice adds a learned per-expert correction bias (sigmoid scores)."""
        return not self.softmax

    def check(self, num_experts: int) -> None:
        """Clear errors for settings the experts cannot take, naming the config field."""
        if self.groups < 1 or num_experts % self.groups:
            raise ParameterError("config.json:n_group", f"{self.groups} groups do not split "
                                 f"the {num_experts} experts evenly")
        if not 1 <= self.topk_groups <= self.groups:
            raise ParameterError("config.json:topk_group",
                                 f"must be in [1, {self.groups}], got {self.topk_groups}")
        per_group = num_experts // self.groups
        if per_group < 2 and self.groups > 1 and not self.softmax:
            raise ParameterError("config.json:n_group", "each group needs at least 2 experts "
                                 "(a group ranks by its two best scores)")
        if self.top_k > self.topk_groups * per_group:
            raise ParameterError("config.json:num_experts_per_tok",
                                 f"{self.top_k} exceeds the {self.topk_groups * per_group} "
                                 "experts the kept groups hold")


def grouped_route(logits: jax.Array, bias: jax.Array | None, routing: GroupedRouting
                  ) -> tuple[jax.Array, jax.Array]:
    """(weights `[T, k]` float32, expert ids `[T, k]` int32) for router logits `[T, E]`
    and the correction bias `[E]` (an array or a parameter; None: zero)."""
    if routing.softmax:
        scores = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    else:
        scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    choice = scores if bias is None else scores + bias[...].astype(jnp.float32)
    t, e = choice.shape
    if routing.groups > 1:
        by_group = choice.reshape(t, routing.groups, e // routing.groups)
        if routing.softmax:
            group_score = jnp.max(by_group, axis=-1)  # [T, groups]
        else:
            group_score = jnp.sum(jax.lax.top_k(by_group, 2)[0], axis=-1)
        _, kept = jax.lax.top_k(group_score, routing.topk_groups)
        keep = jnp.zeros((t, routing.groups), bool).at[jnp.arange(t)[:, None], kept].set(True)
        choice = jnp.where(jnp.repeat(keep, e // routing.groups, axis=1), choice, -jnp.inf)
    _, ids = jax.lax.top_k(choice, routing.top_k)
    weights = jnp.take_along_axis(scores, ids, axis=1)
    if routing.renormalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * routing.scale, ids.astype(jnp.int32)


def local_keys(ids: jax.Array, first_expert: jax.Array | int, local: int,
                num_tokens: jax.Array | int | None) -> jax.Array:
    """Each (token, choice) pair's expert among this call's `local` ones, `local` for
    pairs it skips: another device's expert, or a padding token's (rows from
    `num_tokens` on)."""
    expert = ids - first_expert
    mine = (expert >= 0) & (expert < local)
    if num_tokens is not None:
        mine &= jnp.arange(ids.shape[0])[:, None] < num_tokens
    return jnp.where(mine, expert, local)


def routed_experts(ids: jax.Array, first_expert: jax.Array | int, local: int,
                   num_tokens: jax.Array | int | None = None) -> tuple[jax.Array, jax.Array]:
    """(the distinct local experts the real tokens routed to, ascending, then `local`
    fill, `[min(T*k, local)]`; how many there are) for expert ids `[T, k]`."""
    return distinct_experts(local_keys(ids, first_expert, local, num_tokens), local)


def distinct_experts(key: jax.Array, local: int) -> tuple[jax.Array, jax.Array]:
    """`routed_experts` from `local_keys`' `key [T, k]`."""
    experts = jnp.unique(key, size=min(key.size, local), fill_value=local)
    return experts, jnp.sum(experts < local, dtype=jnp.int32)


def routed_slots(weights: jax.Array, ids: jax.Array, first_expert: jax.Array | int,
                 local: int, num_tokens: jax.Array | int | None = None
                 ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """`routed_experts`' (experts `[U]`, count), and per slot u each row's routing weight
    for expert u, `[U, T]` float32, and whether the row routed there, `[U, T]` bool
    (padding rows, other devices' pairs and fill slots: nowhere)."""
    key = local_keys(ids, first_expert, local, num_tokens)
    experts, count = distinct_experts(key, local)
    hit = (key[None] == experts[:, None, None]) & (experts < local)[:, None, None]
    return (experts, count, jnp.sum(jnp.where(hit, weights[None], 0.0), axis=2),
            jnp.any(hit, axis=2))
