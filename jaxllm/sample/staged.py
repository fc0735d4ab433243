"""The sampler as the model runner calls it: jitted in stages, on logits already made.

A step whose rows need no logits processor (logits_processors.py), no token
bitmask (structured outputs) and no logprobs (`is_plain`) samples in one program
together with the logits head (the runner's `sample` program, built on
`draw_padded`). Any other step runs the
`StagedSampler`: `adjust_logits`, then `draw`, then `sampled_logprobs`, each
jitted apart so that compiled variants add up (7 adjust + 3 draw + 1 logprobs
per request bucket) instead of multiplying. Both paths compute what
`sampler.sample` computes in one piece.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable
from typing import Any

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


def is_plain(md: SamplingMetadata) -> bool:
    """No logits processor, no bitmask, no logprobs: the step samples in one program."""
    return needs_no_adjust(md) and not md.num_logprobs


def needs_no_adjust(md: SamplingMetadata) -> bool:
    """No logits processor and no bitmask: the logits are sampled as they come."""
    return md.fixed is None and md.history is None and md.token_bitmask is None


def _adjust_part(md: SamplingMetadata) -> SamplingMetadata | None:
    """What the adjust stage reads (None: nothing to adjust); static fields it does not
    read are reset, so that they pick no variant of it."""
    if needs_no_adjust(md):
        return None
    return dataclasses.replace(md, num_logprobs=0, all_greedy=False, use_top_k_top_p=False)


def _draw_part(md: SamplingMetadata) -> SamplingMetadata:
    """What the draw stage reads: the metadata without its per-vocab parts."""
    if is_plain(md):
        return md  # nothing to strip, and a replace costs host time every step
    return dataclasses.replace(md, fixed=None, history=None, token_bitmask=None,
                               num_logprobs=0)


class StagedSampler:
    """The three stages, jitted apart; the runner's programs call `STAGED`.

    Each instance jits its own functions, so its compiled variants are its
    own: a test that swaps an implementation read at trace time (the top-k /
    top-p filter, say) takes a fresh instance and reuses no trace of another.
    """

    def __init__(self) -> None:
        # A partial is a new callable each time: its traces are this instance's.
        self._adjust = jax.jit(functools.partial(adjust_logits))
        self._draw = jax.jit(functools.partial(draw_padded), static_argnames="size")
        self._logprobs = jax.jit(functools.partial(_logprobs_padded))

    def adjust(self, logits: jax.Array, md: SamplingMetadata) -> jax.Array:
        """Stage 1: the logits processors and the bitmask, where some row has them."""
        adj = _adjust_part(md)
        return logits if adj is None else self._adjust(logits, adj)

    def __call__(self, logits: jax.Array, md: SamplingMetadata, size: int) -> SamplerOutput:
        """One token per row of `logits`, ids padded to `size`; logprobs when asked."""
        token_ids = self._draw(self.adjust(logits, md), _draw_part(md), size=size)
        if not md.num_logprobs:
            return SamplerOutput(token_ids)
        return SamplerOutput(token_ids, *self._logprobs(logits, token_ids))

    def precompile(self, logits: jax.Array, variants: Iterable[SamplingMetadata],
                   size: int, call: Callable[..., Any] | None = None) -> None:
        """Compiles each stage once per distinct variant it sees among `variants`
        (from `variant_metadata`), for logits of `logits`' shape. `call(name, fn,
        *args, **kw)` runs each stage (default: calls it); an ahead-of-time compiler
        passes one that compiles it for abstract arguments (worker/tpu_compile.py)."""
        if call is None:
            call = lambda name, fn, *args, **kw: fn(*args, **kw)  # noqa: E731
        seen = set()
        token_ids = None
        for md in variants:
            for stage, part in (("adjust", _adjust_part(md)), ("draw", _draw_part(md))):
                key = (stage, jax.tree_util.tree_structure(part))
                if part is None or key in seen:
                    continue
                seen.add(key)
                if stage == "adjust":
                    call("adjust_logits", self._adjust, logits, part)
                else:
                    token_ids = call("draw_padded", self._draw, logits, part, size=size)
        if token_ids is not None:
            call("logprobs_padded", self._logprobs, logits, token_ids)


STAGED = StagedSampler()
