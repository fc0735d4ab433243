"""The logits processors and the device-side output tables, against a numpy reference.

Requests join, leave (the last row moving into the hole, as InputBatch
condenses), resume with outputs, and sample or not (a prompt chunk) over many
steps; every step the runner's adjust stage must give what a numpy reference
computes from each request's prompt and outputs: logit_bias, allowed tokens,
min_tokens, bad words, then the penalties. A step after warm-up reads nothing
back from the device.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.core.sched_output import NewRequestData
from jaxllm.sample import staged
from jaxllm.sample.output_state import WINDOW
from jaxllm.sampling_params import MAX_BAD_WORDS, ParameterError, SamplingParams
from jaxllm.worker.input_batch import InputBatch

VOCAB = 40
MAX_REQS = 8


def _np_adjust(logits, params, prompt, outputs, fixed_on):
    """vLLM's logits processing of one row, in float32, from the request's history."""
    x = logits.astype(np.float32).copy()
    if fixed_on:
        bias = np.zeros(VOCAB, np.float32)
        for t, b in (params.logit_bias or {}).items():
            bias[t] += np.float32(b)
        x = x + bias
    if params.allowed_token_ids:
        keep = np.zeros(VOCAB, bool)
        keep[params.allowed_token_ids] = True
        x[~keep] = -np.inf
    stop = [t for t in params.all_stop_token_ids or params.stop_token_ids or [] if t < VOCAB]
    if params.min_tokens and len(outputs) < params.min_tokens:
        x[stop] = -np.inf
    for word in params.bad_words_token_ids or ():
        prefix = list(word[:-1])
        ends_with_prefix = (len(prefix) <= len(outputs)
                            and outputs[len(outputs) - len(prefix):] == prefix)
        if word[-1] < VOCAB and (not prefix or ends_with_prefix):
            x[word[-1]] = -np.inf
    if params.needs_penalties:
        counts = np.bincount(np.asarray(outputs, np.int64), minlength=VOCAB)
        seen = (counts > 0) | np.isin(np.arange(VOCAB), prompt)
        rep = np.float32(params.repetition_penalty)
        x = np.where(seen, np.where(x > 0, x / rep, x * rep), x)
        x = x - np.float32(params.frequency_penalty) * counts.astype(np.float32)
        x = x - np.float32(params.presence_penalty) * (counts > 0).astype(np.float32)
    return x


def _random_params(rng):
    kind = rng.integers(0, 7)
    p = dict(temperature=0.0)
    if kind in (0, 6):
        p.update(repetition_penalty=float(rng.uniform(0.5, 2.0)),
                 frequency_penalty=float(rng.uniform(-1, 1)),
                 presence_penalty=float(rng.uniform(-1, 1)))
    if kind in (1, 6):
        words = [[int(t)] for t in rng.integers(0, VOCAB, 2)]
        words += [rng.integers(0, 4, rng.integers(2, 5)).tolist() for _ in range(3)]
        words.append([3] * (WINDOW + 1))  # the longest word the window holds
        p.update(bad_words_token_ids=words)
    if kind in (2, 6):
        p.update(min_tokens=int(rng.integers(1, 6)), stop_token_ids=[1, 2, VOCAB + 3])
    if kind == 3:
        p.update(logit_bias={int(t): float(rng.uniform(-5, 5)) for t in rng.integers(0, 40, 3)})
    if kind == 4:
        p.update(allowed_token_ids=sorted({int(t) for t in rng.integers(0, 6, 4)} | {0}))
    return SamplingParams(**p)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_device_tables_follow_adds_removes_moves_and_match_a_numpy_reference(seed):
    rng = np.random.default_rng(seed)
    ib = InputBatch(MAX_REQS, 256, 4, VOCAB)
    history = {}  # req_id -> (params, prompt, outputs)
    adjust = staged.StagedSampler().adjust
    next_id = 0
    for step in range(40):
        # Requests leave (the last row moves into the hole) and join, some resumed.
        for req_id in list(history):
            if rng.random() < 0.12:
                ib.remove(req_id)
                del history[req_id]
        while ib.num_reqs < MAX_REQS and rng.random() < 0.5:
            params = _random_params(rng)
            prompt = rng.integers(0, VOCAB, rng.integers(1, 6)).tolist()
            outputs = rng.integers(0, 4, rng.integers(0, 4)).tolist()
            req_id = str(next_id)
            next_id += 1
            ib.add(NewRequestData(req_id, prompt, outputs, params, None, [], 0))
            history[req_id] = (params, prompt, outputs)
        if not ib.num_reqs:
            continue
        # A random subset of the rows, in random order, as the scheduler's batch.
        req_ids = [r for r in ib.req_ids if rng.random() < 0.8] or ib.req_ids[:1]
        req_ids = [req_ids[i] for i in rng.permutation(len(req_ids))]
        rows = np.array([ib.req_id_to_row[r] for r in req_ids], np.int32)
        n = rows.size
        R = 4 if n <= 4 else 8
        out_index = np.zeros(R, np.int32)  # what the forward counts: InputBatch's
        out_index[:n] = ib.num_tokens[rows] - ib.num_prompt_tokens[rows]
        logits = rng.standard_normal((R, VOCAB)).astype(np.float32) * 3
        sampled = rng.random(n) < 0.8  # the rest are prompt chunks that sample nothing
        tokens = rng.integers(0, 4, MAX_REQS).astype(np.int32)  # small ids: words match
        tokens_dev = jnp.asarray(tokens)
        with jax.transfer_guard_device_to_host("disallow"):
            md = ib.sampling.make_metadata(rows, R, 0, out_index)
            got = adjust(jnp.asarray(logits), md)
            ib.sampling.record(rows, sampled, tokens_dev, R)
        got = np.asarray(got)
        fixed_on = md.fixed is not None
        assert fixed_on == any(history[r][0].logit_bias or history[r][0].allowed_token_ids
                               for r in req_ids)
        for j, req_id in enumerate(req_ids):
            params, prompt, outputs = history[req_id]
            want = _np_adjust(logits[j], params, prompt, outputs, fixed_on)
            assert np.array_equal(np.isinf(got[j]), np.isinf(want)), (step, req_id)
            np.testing.assert_allclose(got[j], want, rtol=1e-6, atol=1e-6, err_msg=str(step))
        ib.append_sampled(rows[sampled], tokens[:n][sampled])
        for j in np.flatnonzero(sampled):
            history[req_ids[j]][2].append(int(tokens[j]))


def test_bad_words_past_the_tables_capacity_are_refused_naming_the_field():
    too_long = [[1] * (WINDOW + 2)]
    too_many = [[i] for i in range(MAX_BAD_WORDS + 1)]
    for words in (too_long, too_many):
        with pytest.raises(ParameterError, match="bad_words"):
            SamplingParams(bad_words_token_ids=words).verify()
    SamplingParams(bad_words_token_ids=[[1] * (WINDOW + 1)] * MAX_BAD_WORDS).verify()
