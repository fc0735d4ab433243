"""Request lifecycle and the waiting queues (FCFS and priority)."""

import pytest

from jaxllm.core.messages import EngineCoreRequest, FinishReason
from jaxllm.core.request import Request, RequestStatus
from jaxllm.core.request_queue import FCFSRequestQueue, PriorityRequestQueue, create_request_queue
from jaxllm.sampling_params import PoolingParams, SamplingParams


def make_request(rid, prompt_len=2, arrival=0.0, priority=0):
    return Request(rid, list(range(prompt_len)), SamplingParams(), arrival_time=arrival,
                   priority=priority)


def test_request_from_engine_core_request_copies_every_field():
    ecr = EngineCoreRequest(request_id="x", prompt_token_ids=[1, 2, 3],
                            sampling_params=SamplingParams(max_tokens=5), eos_token_id=2,
                            arrival_time=3.5, priority=4)
    req = Request.from_engine_core_request(ecr)
    assert (req.request_id, req.prompt_token_ids, req.eos_token_id, req.arrival_time,
            req.priority, req.max_tokens) == ("x", [1, 2, 3], 2, 3.5, 4, 5)
    assert req.status == RequestStatus.WAITING and req.num_prompt_tokens == 3
    assert req.num_tokens == 3 and req.num_computed_tokens == 0


def test_finished_statuses_map_to_finish_reasons():
    assert not RequestStatus.PREEMPTED.is_finished()
    assert RequestStatus.is_finished(RequestStatus.FINISHED_ABORTED)
    assert RequestStatus.FINISHED_STOPPED.finish_reason() == FinishReason.STOP
    assert RequestStatus.FINISHED_LENGTH_CAPPED.finish_reason() == FinishReason.LENGTH
    assert RequestStatus.FINISHED_ABORTED.finish_reason() == FinishReason.ABORT
    assert RequestStatus.FINISHED_ERROR.finish_reason() == FinishReason.ERROR
    assert RequestStatus.RUNNING.finish_reason() is None


@pytest.mark.parametrize("queue_cls", [FCFSRequestQueue, PriorityRequestQueue])
def test_queues_put_prepended_requests_first_and_remove_any(queue_cls):
    q = queue_cls()
    a, b, c = (make_request(r) for r in "abc")
    for r in (a, b, c):
        q.add(r)
    assert q.pop() is a
    q.prepend(a)
    assert list(q) == [a, b, c] and q.peek() is a and len(q) == 3
    q.remove_many([a, c])
    assert list(q) == [b]
    q.remove(b)
    assert not q
    with pytest.raises(IndexError):
        q.pop()


def test_priority_queue_orders_by_priority_then_arrival():
    q = PriorityRequestQueue()
    reqs = [make_request("late-urgent", arrival=5.0, priority=0),
            make_request("early-lax", arrival=1.0, priority=2),
            make_request("early-urgent", arrival=2.0, priority=0)]
    for r in reqs:
        q.add(r)
    assert [q.pop().request_id for _ in range(3)] == ["early-urgent", "late-urgent", "early-lax"]


def test_pooling_request_generates_nothing_and_default_params_fill_in():
    pooled = Request("p", [1, 2], None, PoolingParams())
    assert pooled.is_pooling and pooled.max_tokens == 1
    plain = Request("s", [1, 2], None)
    assert plain.sampling_params == SamplingParams()


def test_empty_prompt_is_refused():
    with pytest.raises(ValueError):
        Request("e", [], SamplingParams())


def test_appended_tokens_extend_outputs_and_all_tokens():
    req = make_request("a", 3)
    req.append_output_token_ids(7)
    req.append_output_token_ids([8, 9])
    assert req.output_token_ids == [7, 8, 9] and req.all_token_ids == [0, 1, 2, 7, 8, 9]
    assert req.num_tokens == 6 and req.num_output_tokens == 3


def test_output_tokens_read_like_the_list_of_generated_tokens():
    req = make_request("a", 3)
    out = req.output_token_ids
    assert len(out) == 0 and list(out) == [] and out == []
    with pytest.raises(IndexError):
        out[-1]
    req.append_output_token_ids([7, 8, 9])
    assert (out[0], out[2], out[-1], out[-3]) == (7, 9, 9, 7)
    assert out[1:] == [8, 9] and out[::-1] == [9, 8, 7] and list(out) == [7, 8, 9]
    for bad in (3, -4):
        with pytest.raises(IndexError):
            out[bad]
    assert out != [7, 8] and out != [7, 8, 10] and 8 in out


def test_queue_factory_follows_the_policy_name():
    assert isinstance(create_request_queue("fcfs"), FCFSRequestQueue)
    assert isinstance(create_request_queue("priority"), PriorityRequestQueue)
    with pytest.raises(ValueError):
        create_request_queue("lifo")
