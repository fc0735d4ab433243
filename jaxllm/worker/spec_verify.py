"""Speculative decoding beside the model runner: verify programs, drafts in and out.

A step that schedules drafts (`SchedulerOutput.scheduled_spec_decode_tokens`)
runs the verify programs instead of the usual forward and sampler: the
forward returns the final hidden state of each request's last K + 1 scheduled
tokens (`[max_num_seqs * (K + 1), hidden]`, K = num_speculative_tokens; a
request with d < K drafts repeats its first row), and the verify sampler
(sample/rejection_sampler.py) turns them into each request's accepted drafts
plus one token, with the target's logprobs of each. Shapes: the verify
forward per token bucket, the verify sampler per request bucket and sampling
mode, all compiled at start-up. With LoRA on, the verify forward runs the target
with each request's adapter, taking the usual forward's slot argument (a draft
model drafts without adapters: its drafts are only proposals).

A step whose requests need a logits processor or a token bitmask (such
requests never draft, but may share a step with one that does) samples
position 0 of every request with the usual sampler: every draft of that step
is rejected, and the target distribution is kept; the output tables then take
that one token per request (sample/output_state.py). After each step the ngram
proposer drafts the next step's tokens from every request's context on the host;
a draft model (draft_model.py) or an EAGLE head (eagle_drafter.py) drafts on the
device at the verify step's dispatch instead, and after each step only says how
many drafts come.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.core.runner_output import ModelRunnerOutput
from jaxllm.lora.layers import set_lora_masks
from jaxllm.sample.logprobs import LogprobsLists
from jaxllm.sample.metadata import SamplingMetadata, variant_metadata
from jaxllm.sample.rejection_sampler import rejection_sample
from jaxllm.sample.sampler import gather_logprobs
from jaxllm.sample.staged import needs_no_adjust
from jaxllm.sampling_params import MAX_LOGPROBS
from jaxllm.spec_decode.config import SpeculativeConfig
from jaxllm.spec_decode.ngram import propose_ngram
from jaxllm.worker.buckets import Buckets
from jaxllm.worker.draft_model import DraftModel
from jaxllm.worker.lora_slots import lora_args
from jaxllm.worker.step_inputs import StepInputs, unpack_step_inputs


@dataclasses.dataclass
class VerifyOutput:
    """The verify sampler's device results, padded to the request bucket."""

    tokens: jax.Array  # [R, K + 1] i32: accepted drafts, then one token, then -1
    num_emitted: jax.Array  # [R] i32
    logprobs: tuple | None  # (ids, logprobs, ranks) of row r * (K + 1) + j, or None


@functools.cache
def verify_functions(graphdef: Any, state_def: Any, head_logits: Any, num_reqs: int,
                     width: int, k1: int, num_groups: int = 1,
                     capture: tuple[int, ...] | None = None) -> tuple[Any, Any, Any]:
    """The jitted verify forward, verify sampler and position-0 gather of one model graph
    (`capture`: the forward also returns what an EAGLE head reads of every row)."""

    def forward(weights, kv_cache, packed, rows, drafts, lora_slots=None):
        input_ids, positions, md, src, _ = unpack_step_inputs(packed, num_reqs, width,
                                                              num_groups)
        # Drafts made on the device (a draft model's) are read from its output.
        input_ids = jnp.where(src >= 0, drafts.reshape(-1)[jnp.maximum(src, 0)], input_ids)
        model = nnx.merge(graphdef, jax.tree.unflatten(state_def, weights))
        if lora_slots is not None:  # the target with each request's adapter (-1: none)
            set_lora_masks(model, lora_slots, md.cu_q_lens, input_ids.shape[0])
        if capture is not None:
            _, kv_cache, states, target = model.forward_captured(
                input_ids, positions, kv_cache, md, rows[:num_reqs], capture, False)
            return kv_cache, states[rows], target
        states, kv_cache = model(input_ids, positions, kv_cache, md)
        return kv_cache, states[rows]

    def sample(head, hidden, draft_ids, num_drafts, md):
        r = md.temperature.shape[0]
        logits = head_logits(head, hidden[:r * k1])
        if draft_ids.shape[0] != r:  # a draft model's `[max_num_seqs, K]` output
            draft_ids = jnp.pad(draft_ids, ((0, max(r - draft_ids.shape[0], 0)), (0, 0)))[:r]
        tokens, emitted = rejection_sample(logits, draft_ids, num_drafts, md)
        lps = None
        if md.num_logprobs:
            lps = gather_logprobs(jax.nn.log_softmax(logits, axis=-1),
                                  jnp.maximum(tokens, 0).reshape(-1), MAX_LOGPROBS)
        return tokens, emitted, lps

    def first_rows(hidden, out_index):
        return hidden.reshape(num_reqs, k1, -1)[:, 0], jnp.asarray(out_index)

    return (jax.jit(forward, donate_argnums=(1,)), jax.jit(sample), jax.jit(first_rows))


class SpecVerifier:
    """The verify programs of one runner, and its draft proposer."""

    def __init__(self, config: SpeculativeConfig, graphdef: Any, state_def: Any,
                 head_logits: Any, buckets: Buckets, drafter: DraftModel | None = None,
                 capture: tuple[int, ...] | None = None):
        self.config = config
        self.drafter = drafter
        # The verify forward's device drafts where none are made on the device.
        self.no_drafts = jnp.zeros((buckets.max_num_seqs, config.num_speculative_tokens),
                                   jnp.int32)
        self.k = config.num_speculative_tokens
        self.k1 = self.k + 1
        self.buckets = buckets
        self.forward, self.sample_fn, self.first_rows = verify_functions(
            graphdef, state_def, head_logits, buckets.max_num_seqs, buckets.max_blocks_per_req,
            self.k1, buckets.num_kv_groups, capture)

    # ---- host side ---------------------------------------------------------

    def verify_rows(self, first: np.ndarray, num_scheduled: np.ndarray,
                    num_drafts: np.ndarray) -> np.ndarray:
        """`[max_num_seqs * (K + 1)]` token rows: request i's position j is its token
        `num_scheduled - 1 - d + min(j, d)` in the step (d its drafts); padding 0."""
        n, k1 = first.size, self.k1
        rows = np.zeros((self.buckets.max_num_seqs, k1), np.int32)
        j = np.minimum(np.arange(k1)[None, :], num_drafts[:, None])
        rows[:n] = (first + num_scheduled - 1 - num_drafts)[:, None] + j
        return rows.reshape(-1)

    def draft_arrays(self, num_drafts: np.ndarray, drafts: list[list[int]],
                     r_pad: int) -> tuple[np.ndarray, np.ndarray]:
        """The sampler's `[r_pad, K]` draft ids and `[r_pad]` counts."""
        ids = np.zeros((r_pad, self.k), np.int32)
        counts = np.zeros(r_pad, np.int32)
        counts[:num_drafts.size] = num_drafts
        for i, d in enumerate(drafts):
            ids[i, :len(d)] = d
        return ids, counts

    def propose(self, token_ids: np.ndarray, num_tokens: np.ndarray, rows: list[int]
                ) -> list[list[int]]:
        """Next step's drafts for each of `rows` (ngram over its known tokens; a draft
        model's are placeholders, made at dispatch)."""
        c = self.config
        if self.drafter is not None:
            return [[0] * self.k for _ in rows]
        return [propose_ngram(token_ids[row, :num_tokens[row]], self.k, c.prompt_lookup_min,
                              c.prompt_lookup_max).tolist() for row in rows]

    # ---- device side -------------------------------------------------------

    def verify_forward(self, runner: Any, inputs: StepInputs, rows: np.ndarray,
                       num_scheduled: np.ndarray, drafts: list[list[int]],
                       num_drafts: np.ndarray) -> tuple:
        """Launches the verify forward (after a draft model's proposal, and before its
        `follow`); returns the handle's `verify`: (draft ids, counts, hidden rows)."""
        r_pad = self.buckets.pad_requests(rows.size)
        ids, counts = self.draft_arrays(num_drafts, drafts, r_pad)
        device_drafts = self.no_drafts
        if self.drafter is not None:
            ids = device_drafts = self.drafter.propose(runner.input_batch, rows, inputs,
                                                       num_drafts)
        runner.kv_cache, hidden, *captured = self.forward(
            runner.state, runner.kv_cache, inputs.packed,
            self.verify_rows(inputs.first, num_scheduled, num_drafts), device_drafts,
            *lora_args(runner.lora))
        self.follow(inputs.packed, device_drafts, *captured)
        return ids, counts, hidden

    def follow(self, packed: np.ndarray, drafts: jax.Array | None = None,
               captured: jax.Array | None = None) -> None:
        """A draft model's (or EAGLE head's, reading `captured`) mirror of the target's
        step (nothing for ngram)."""
        if self.drafter is not None:
            self.drafter.follow(packed, self.no_drafts if drafts is None else drafts, captured)

    # `runner` is the ModelRunner and `h` its StepHandle (model_runner.py imports this
    # module, so they are not named here).
    def dispatch_sample(self, runner: Any, h: Any, rows: np.ndarray,
                        grammar_bitmask: np.ndarray | None) -> None:
        """The runner's sampler for a verify step: the rejection sampler, or the usual
        sampler at position 0 of every request where the step's sampling needs more."""
        ib, spec = runner.input_batch, self
        ids, counts, hidden = h.verify
        out_index = np.zeros(runner.buckets.max_num_seqs, np.int32)
        out_index[:rows.size] = ib.num_tokens[rows] - ib.num_prompt_tokens[rows]
        smd = ib.sampling.make_metadata(rows, h.r_pad, runner.seed, out_index[:h.r_pad])
        if grammar_bitmask is None and spec.verifiable(smd):
            h.verified = spec.sample(runner.programs.head, hidden, ids, counts, smd)
            return
        first, out_index = spec.first_rows(hidden, out_index)
        smd = dataclasses.replace(smd, out_index=out_index)
        if grammar_bitmask is not None:
            smd = dataclasses.replace(smd, token_bitmask=runner._pad_bitmask(grammar_bitmask,
                                                                          h.r_pad))
        h.sampled = runner.programs.sample(first, smd)
        ib.sampling.record(rows, h.gen, h.sampled.token_ids, h.r_pad)

    def collect(self, runner: Any, h: Any) -> ModelRunnerOutput:
        """`collect` with speculation on: every request's emitted tokens (one, or the
        accepted drafts and one), then the next step's drafts."""
        ib, n = runner.input_batch, len(h.req_ids)
        rows = np.fromiter((ib.req_id_to_row.get(r, -1) for r in h.req_ids), np.int32, n)
        if h.verified is not None:
            v = h.verified
            tokens, counts = np.asarray(v.tokens)[:n], np.asarray(v.num_emitted)[:n]
            lp = None if v.logprobs is None else [np.asarray(a) for a in v.logprobs]
        else:
            out = h.sampled
            tokens, counts = np.asarray(out.token_ids)[:n, None], np.ones(n, np.int32)
            lp = None if out.logprobs is None else [
                np.asarray(a) for a in (out.logprob_token_ids, out.logprobs, out.ranks)]
        counts = np.where(h.gen, counts, 0)
        for j in range(tokens.shape[1]):  # each position, vectorized over requests
            got = (counts > j) & (rows >= 0)
            ib.append_sampled(rows[got], tokens[got, j])
        sampled, logprobs, starts = emitted_lists(tokens, counts, lp)
        live = [int(r) for r in rows[(rows >= 0) & (counts > 0)] if ib.can_draft[r]]
        proposals = dict(zip(live, self.propose(ib.token_ids, ib.num_tokens, live),
                             strict=True))
        return ModelRunnerOutput(
            req_ids=h.req_ids, sampled_token_ids=sampled, logprobs=logprobs,
            prompt_logprobs=runner._collect_prompt_logprobs(h.prompt_lp),
            pooler_output=runner._pool(h), logprob_rows=starts,
            spec_token_ids=[proposals.get(int(r), []) for r in rows])

    def sample(self, head: jax.Array, hidden: jax.Array, draft_ids: np.ndarray,
               num_drafts: np.ndarray, md: SamplingMetadata) -> VerifyOutput:
        return VerifyOutput(*self.sample_fn(head, hidden, draft_ids, num_drafts, md))

    @staticmethod
    def verifiable(md: SamplingMetadata) -> bool:
        """Whether the verify sampler takes this step (else position 0 is sampled)."""
        return needs_no_adjust(md)

    def precompile(self, state: list, head: jax.Array, kv_cache: jax.Array,
                   packed_of: Any, vocab_size: int, device_put: Any,
                   lora: tuple = ()) -> jax.Array:
        """Compiles the verify forward for every token bucket (with the LoRA argument
        `lora` when LoRA is on) and the verify sampler for every request bucket and
        mode (and a draft model's programs); returns the (donated) KV cache."""
        b = self.buckets
        s = b.max_num_seqs
        rows = np.zeros(s * self.k1, np.int32)
        hidden = None
        drafts = self.no_drafts if self.drafter is None else self.drafter.precompile(packed_of,
                                                                            self.no_drafts)
        for t in b.token_buckets:
            kv_cache, hidden, *_ = self.forward(state, kv_cache, packed_of(t), rows, drafts,
                                                *lora)
        for r in b.request_buckets:
            ids, counts = np.zeros((r, self.k), np.int32), np.zeros(r, np.int32)
            if self.drafter is not None:
                ids = drafts
            for md in variant_metadata(r, vocab_size, device_put, np.zeros(r, np.int32)):
                if needs_no_adjust(md):
                    self.sample_fn(head, hidden, ids, counts, md)
        self.first_rows(hidden, np.zeros(s, np.int32))
        return kv_cache


def emitted_lists(tokens: np.ndarray, counts: np.ndarray, logprobs: list[np.ndarray] | None
                  ) -> tuple[list[list[int]], LogprobsLists | None, list[int] | None]:
    """Host lists of a step's emitted tokens: `tokens` `[n, P]` with `counts` `[n]` of
    each row taken; `logprobs` (ids, logprobs, ranks) with row `i * P + j` for request
    i's position j. Returns the tokens per request, the logprobs of the emitted ones
    request after request, and where each request's rows start in them."""
    n, width = tokens.shape
    sampled = [row[:c] for row, c in zip(tokens.tolist(), counts.tolist(), strict=True)]
    if logprobs is None:
        return sampled, None, None
    keep = (np.arange(width)[None, :] < counts[:, None]).reshape(-1)
    ids, lps, ranks = (a[:n * width][keep] for a in logprobs)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int).tolist()
    return sampled, LogprobsLists(ids.tolist(), lps.tolist(), ranks.tolist()), starts
