"""The sampler's token bitmask: packed bits unpacked on the device, greedy and sampled rows."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxllm.sample.metadata import variant_metadata
from jaxllm.sample.sampler import apply_token_bitmask, sample


def _pack(allowed: np.ndarray) -> np.ndarray:
    """[R, V] bool -> [R, ceil(V / 32)] int32, bit j of word i = token 32 i + j."""
    r, v = allowed.shape
    padded = np.zeros((r, -(-v // 32) * 32), bool)
    padded[:, :v] = allowed
    bits = padded.reshape(r, -1, 32).astype(np.uint64) << np.arange(32, dtype=np.uint64)
    return bits.sum(-1).astype(np.uint32).view(np.int32)


def test_the_bitmask_keeps_exactly_the_allowed_tokens_for_a_vocab_not_a_multiple_of_32():
    rng = np.random.default_rng(0)
    allowed = rng.random((5, 70)) < 0.3
    allowed[:, 69] = True  # the last id, in the partial last word
    allowed[0] = True  # an unconstrained row
    logits = rng.standard_normal((5, 70)).astype(np.float32)
    out = np.asarray(apply_token_bitmask(jnp.asarray(logits), jnp.asarray(_pack(allowed))))
    np.testing.assert_array_equal(np.isfinite(out), allowed)
    np.testing.assert_array_equal(out[allowed], logits[allowed])


def test_greedy_and_sampled_rows_draw_only_allowed_tokens_under_the_bitmask():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.standard_normal((4, 96)), jnp.float32)
    allowed = np.zeros((4, 96), bool)
    for r, ids in enumerate(([5], [40, 41, 90], [95], [0, 63, 64])):
        allowed[r, ids] = True
    for md in variant_metadata(4, 96):
        if md.token_bitmask is None or md.num_logprobs:
            continue
        md = md.__class__(**{**md.__dict__, "token_bitmask": _pack(allowed)})
        for step in range(3):
            md = md.__class__(**{**md.__dict__, "out_index": np.full(4, step, np.int32)})
            ids = np.asarray(sample(logits, md).token_ids)
            assert all(allowed[r, t] for r, t in enumerate(ids)), (md.all_greedy, ids)
