"""The sampler as the model runner calls it: jitted in stages, on logits already made.

A step whose rows need no penalties, no logit adjustment and no logprobs
(`is_plain`) samples in one program together with the logits head (the
runner's `sample` program, built on `draw_padded`). Any other step runs
`run_sampler`: `adjust_logits`, then `draw`, then `sampled_logprobs`, each
jitted apart so that compiled variants add up (3 adjust + 3 draw + 1 logprobs
per request bucket) instead of multiplying. Both paths compute what
`sampler.sample` computes in one piece.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import jax
import jax.numpy as jnp

from jaxllm.sample.metadata import SamplingMetadata
from jaxllm.sample.sampler import SamplerOutput, adjust_logits, draw, sampled_logprobs
from jaxllm.sampling_params import MAX_LOGPROBS


def draw_padded(logits: jax.Array, md: SamplingMetadata, size: int) -> jax.Array:
    """`draw`, padded to `size` rows: the next step's forward reads it by row."""
    token_ids = draw(logits, md)
    return jnp.zeros(size, jnp.int32).at[:token_ids.shape[0]].set(token_ids)


def _logprobs_padded(logits: jax.Array, token_ids: jax.Array) -> tuple:
    return sampled_logprobs(logits, token_ids[:logits.shape[0]], k=MAX_LOGPROBS)


_jit_adjust = jax.jit(adjust_logits)
_jit_draw = jax.jit(draw_padded, static_argnames="size")
_jit_logprobs = jax.jit(_logprobs_padded)


def is_plain(md: SamplingMetadata) -> bool:
    """No penalties, no logit adjustment, no logprobs: the step samples in one program."""
    return md.penalties is None and md.logit_adjust is None and not md.num_logprobs


def _adjust_part(md: SamplingMetadata) -> SamplingMetadata | None:
    """What the adjust stage reads (None: nothing to adjust); static fields it does not
    read are reset, so that they pick no variant of it."""
    if md.penalties is None and md.logit_adjust is None:
        return None
    return dataclasses.replace(md, num_logprobs=0, all_greedy=False, use_top_k_top_p=False)


def _draw_part(md: SamplingMetadata) -> SamplingMetadata:
    """What the draw stage reads: the metadata without its per-vocab parts."""
    if is_plain(md):
        return md  # nothing to strip, and a replace costs host time every step
    return dataclasses.replace(md, penalties=None, logit_adjust=None, num_logprobs=0)


def run_sampler(logits: jax.Array, md: SamplingMetadata, size: int) -> SamplerOutput:
    """The staged sampler: one token per row of `logits`, ids padded to `size`."""
    adj = _adjust_part(md)
    adjusted = logits if adj is None else _jit_adjust(logits, adj)
    token_ids = _jit_draw(adjusted, _draw_part(md), size=size)
    if not md.num_logprobs:
        return SamplerOutput(token_ids)
    return SamplerOutput(token_ids, *_jit_logprobs(logits, token_ids))


def precompile_stages(logits: jax.Array, variants: Iterable[SamplingMetadata],
                      size: int) -> None:
    """Compiles each stage once per distinct variant it sees among `variants`
    (from `variant_metadata`), for logits of `logits`' shape."""
    seen = set()
    token_ids = None
    for md in variants:
        for fn, part in ((_jit_adjust, _adjust_part(md)), (_jit_draw, _draw_part(md))):
            key = (fn, jax.tree_util.tree_structure(part))
            if part is not None and key not in seen:
                seen.add(key)
                out = fn(logits, part) if fn is _jit_adjust else fn(logits, part, size=size)
                if fn is _jit_draw:
                    token_ids = out
    if token_ids is not None:
        _jit_logprobs(logits, token_ids)
