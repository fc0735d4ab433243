"""`Scheduler.update_from_output` for one request at a time: the reference path.

Appends the tokens a step sampled for the request (several with speculative
decoding, stopping at the first that finishes it), applies its stop
conditions, pooling and logprobs, and makes its EngineCoreOutput. The array
path (RunningBatch.apply_sampled) does the same for the usual decode step.
"""

from __future__ import annotations

from typing import Any

from jaxllm.core.messages import EngineCoreOutput
from jaxllm.core.request import Request, RequestStatus
from jaxllm.core.runner_output import ModelRunnerOutput
from jaxllm.core.sched_output import SchedulerOutput


def update_request(sched: Any, j: int, req_id: str, so: SchedulerOutput,
                   runner: ModelRunnerOutput, outputs: list[EngineCoreOutput | None],
                   finished: list[tuple[int, Request]]) -> int:
    """`update_from_output` for the request at position `j` of the step, one at a time.
    `sched` is the Scheduler (which imports this module); returns the tokens appended."""
    request = sched.requests.get(req_id)
    if request is None or request.status > RequestStatus.PREEMPTED:
        return 0  # finished or aborted while the step ran
    row = request.batch_index
    if so.samples[j]:
        request.num_output_placeholders -= 1
    index = runner.req_id_to_index.get(req_id)
    sampled = runner.tokens_of(index) if index is not None else ()
    drafts = so.scheduled_spec_decode_tokens.get(req_id)
    if drafts and sampled:
        sched.spec.verified(request, drafts, sampled)

    new_token_ids: list[int] = []
    for token_id in sampled:
        request.append_output_token_ids(token_id)
        new_token_ids.append(token_id)
        if request.check_stop(sched.max_request_tokens):
            break
    if row >= 0 and new_token_ids:
        sched.running.num_output[row] += len(new_token_ids)
        sched.running.num_tokens[row] += len(new_token_ids)
    if runner.spec_token_ids is not None and index is not None:
        request.spec_token_ids = runner.spec_token_ids[index]

    pooling_output = None
    if (request.pooling_params is not None
            and request.num_computed_tokens >= request.num_prompt_tokens):
        pooling_output = runner.pooler_output.get(req_id)
        # A finished prompt without pooled output would never be
        # scheduled again; fail it rather than hang the engine.
        request.status = (RequestStatus.FINISHED_STOPPED if pooling_output is not None
                          else RequestStatus.FINISHED_ERROR)

    new_logprobs = None
    if (new_token_ids and index is not None and runner.logprobs is not None
            and request.sampling_params is not None
            and request.sampling_params.logprobs is not None):
        start = index if runner.logprob_rows is None else runner.logprob_rows[index]
        new_logprobs = runner.logprobs.slice(start, start + len(new_token_ids))
    prompt_logprobs = (runner.prompt_logprobs.get(req_id) if runner.prompt_logprobs
                       else None)
    is_finished = request.status > RequestStatus.PREEMPTED

    if (new_token_ids or pooling_output is not None or prompt_logprobs is not None
            or is_finished):
        outputs[j] = EngineCoreOutput(
            request_id=req_id, new_token_ids=new_token_ids, new_logprobs=new_logprobs,
            new_prompt_logprobs=prompt_logprobs, pooling_output=pooling_output,
            finish_reason=request.status.finish_reason() if is_finished else None,
            stop_reason=request.stop_reason,
            num_cached_tokens=max(0, request.num_cached_tokens))
    if is_finished:
        finished.append((j, request))
    return len(new_token_ids)
