"""The engine core in its own process: transport, results, aborts, failures.

One multi-process engine for the module; the test that kills it runs last.
"""

from __future__ import annotations

import os
import shutil
import signal
import time

import msgspec
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.config import EngineArgs
from jaxllm.core.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    LogprobsLists,
    SchedulerStats,
)
from jaxllm.engine.codec import Codec, EngineCoreRequestType
from jaxllm.engine.core_client import SyncMPClient
from jaxllm.engine.llm_engine import LLMEngine
from jaxllm.errors import EngineDeadError
from jaxllm.sampling_params import RequestOutputKind
from tests.engine.hf_reference import random_prompts
from tests.models.tiny_checkpoints import checkpoint_vocab_size, make_tiny_checkpoint

BASE = dict(dtype="float32", max_model_len=128, max_num_seqs=8, block_size=8, seed=0,
            token_buckets=[16, 64], request_buckets=[4, 8], max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), arch="llama")


@pytest.fixture(scope="module")
def mp_engine(model_dir):
    engine = LLMEngine.from_engine_args(EngineArgs(model=model_dir, **BASE), multiprocess=True)
    yield engine
    engine.shutdown()
    assert not engine.engine_core.proc.is_alive()


def _request(rid: str, ids: list[int], max_tokens: int = 8, **kw) -> EngineCoreRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)
    params.all_stop_token_ids = []
    return EngineCoreRequest(request_id=rid, prompt_token_ids=ids, sampling_params=params,
                             arrival_time=time.time())


def test_codec_round_trips_requests_and_outputs():
    codec = Codec()
    req = _request("r1", [5, 6, 7], stop=["x"], logprobs=2, seed=3)
    kind, back = codec.decode_input(EngineCoreRequestType.ADD.value, codec.encode(req))
    assert kind == EngineCoreRequestType.ADD and back == req
    outs = EngineCoreOutputs(
        outputs=[EngineCoreOutput("r1", [9], LogprobsLists([[9, 3]], [[-0.1, -2.0]], [1]),
                                  finish_reason=FinishReason.LENGTH)],
        scheduler_stats=SchedulerStats(num_running_reqs=1, kv_cache_usage=0.5))
    decoded = codec.outputs_decoder.decode(codec.encode(outs))
    assert decoded == outs and decoded.outputs[0].finish_reason is FinishReason.LENGTH
    with pytest.raises(msgspec.ValidationError):
        codec.decode_input(EngineCoreRequestType.ABORT.value, codec.encode([1, 2]))


@pytest.mark.slow
def test_multiprocess_engine_gives_the_same_greedy_tokens_as_in_process(model_dir, mp_engine):
    vocab = checkpoint_vocab_size(model_dir)
    prompts = random_prompts(vocab, [5, 17, 30, 9], seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    inproc = LLM(model_dir, **BASE).generate([{"prompt_token_ids": p} for p in prompts],
                                              params, use_tqdm=False)
    for i, p in enumerate(prompts):
        mp_engine.add_request(str(i), {"prompt_token_ids": p}, params)
    results = {}
    while mp_engine.has_unfinished_requests():
        for out in mp_engine.step():
            results[out.request_id] = out.outputs[0].token_ids
    assert [results[str(i)] for i in range(len(prompts))] == \
        [o.outputs[0].token_ids for o in inproc]


@pytest.mark.slow
def test_utility_calls_answer_and_unknown_methods_fail(mp_engine):
    client: SyncMPClient = mp_engine.engine_core
    assert client.reset_prefix_cache() is True
    assert client.call_utility("ping", timeout=10) is True
    # The model's summary, as a benchmark reads it from a core in its own process.
    summary = client.model_summary()
    assert summary["params"] > 0 and summary["weight_bytes"] >= 2 * summary["params"]
    assert summary["num_processes"] == 1 and isinstance(summary["attention_backend"], str)
    with pytest.raises(RuntimeError, match="unknown utility"):
        client.call_utility("shutdown_everything", timeout=10)


@pytest.mark.slow
def test_abort_frees_blocks_and_the_idle_core_reports_it(mp_engine):
    client: SyncMPClient = mp_engine.engine_core
    client.add_request(_request("long", [10, 11, 12, 13], max_tokens=100))
    stats = None
    while stats is None or stats.num_running_reqs == 0:
        stats = client.get_output().scheduler_stats
    assert stats.kv_cache_usage > 0
    client.abort_requests(["long"])
    deadline = time.monotonic() + 10
    while stats.num_running_reqs or stats.kv_cache_usage:
        assert time.monotonic() < deadline
        stats = client.get_output().scheduler_stats or stats
    assert stats.num_running_reqs == 0 and stats.kv_cache_usage == 0


@pytest.mark.slow
def test_rejected_request_comes_back_as_an_error_output(mp_engine):
    client: SyncMPClient = mp_engine.engine_core
    client.add_request(_request("huge", list(range(8, 8 + client.max_request_tokens))))
    deadline = time.monotonic() + 10
    while True:
        outs = [o for o in client.get_output().outputs if o.request_id == "huge"]
        if outs:
            break
        assert time.monotonic() < deadline
    assert outs[0].finish_reason == FinishReason.ERROR


@pytest.mark.slow
def test_startup_failure_is_reported_with_the_cause(model_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    for name in os.listdir(broken):
        if name.endswith(".safetensors"):
            os.remove(broken / name)
    config = EngineArgs(model=str(broken), **{**BASE, "precompile": False}) \
        .create_engine_config()
    with pytest.raises(RuntimeError, match="failed to start"):
        SyncMPClient(config)


def test_multiprocessing_for_llm_is_opt_in_through_the_environment(monkeypatch):
    from jaxllm.engine.core_client import multiprocess_default

    monkeypatch.delenv("JAXLLM_ENABLE_MULTIPROCESSING", raising=False)
    assert multiprocess_default() is False
    monkeypatch.setenv("JAXLLM_ENABLE_MULTIPROCESSING", "1")
    assert multiprocess_default() is True


def _output_for(client: SyncMPClient, rid: str, timeout: float = 30.0) -> EngineCoreOutput:
    """The first output of `rid`, finished or not."""
    deadline = time.monotonic() + timeout
    while True:
        for out in client.get_output().all_outputs():
            if out.request_id == rid:
                return out
        assert time.monotonic() < deadline, f"no answer for {rid}: dropped?"


def _finish(client: SyncMPClient, rid: str, ids: list[int]) -> list[int]:
    client.add_request(_request(rid, ids, max_tokens=4))
    tokens: list[int] = []
    while True:
        out = _output_for(client, rid)
        tokens += out.new_token_ids
        if out.finished:
            assert out.finish_reason == FinishReason.LENGTH
            return tokens


@pytest.mark.slow
def test_requests_the_core_cannot_decode_or_hold_are_answered_with_an_error(mp_engine,
                                                                            model_dir):
    """Values that bypassed the frontend's checks: each request gets an error answer of
    its own (none is dropped), and the core goes on serving the others."""
    client: SyncMPClient = mp_engine.engine_core
    codec = Codec()
    before = _finish(client, "before", [10, 11, 12])

    min_over_max = _request("min-over-max", [10, 11], max_tokens=4)
    min_over_max.sampling_params.min_tokens = 50  # set after the checks ran
    huge_stop = _request("huge-stop", [10, 11])
    huge_stop.sampling_params.stop_token_ids = [2**63]
    outside_vocab = _request("outside-vocab", [10, checkpoint_vocab_size(model_dir)])
    for req in (min_over_max, huge_stop, outside_vocab):
        client._send(EngineCoreRequestType.ADD, codec.encode(req))
        out = _output_for(client, req.request_id)
        assert out.finish_reason == FinishReason.ERROR, req.request_id
        assert out.stop_reason, req.request_id
    client._send(EngineCoreRequestType.ADD, msgspec.msgpack.encode(
        {"request_id": "wrong-types", "prompt_token_ids": "not a list"}))
    out = _output_for(client, "wrong-types")
    assert out.finish_reason == FinishReason.ERROR and "decode" in out.stop_reason

    from concurrent.futures import Future

    fut: Future = Future()
    client._pending[10**6] = fut
    client._send(EngineCoreRequestType.UTILITY, msgspec.msgpack.encode([10**6, 5]))
    with pytest.raises(RuntimeError, match="could not decode"):
        fut.result(timeout=30)

    assert client.is_alive()
    assert _finish(client, "after", [10, 11, 12]) == before


@pytest.mark.slow
def test_killed_engine_fails_waiters_and_new_requests_fast(mp_engine):
    # Runs last in the module: it kills the shared engine.
    client: SyncMPClient = mp_engine.engine_core
    client.add_request(_request("victim", [10, 11, 12], max_tokens=100))
    os.kill(client.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError):
        while True:
            client.get_output()
    assert time.monotonic() - t0 < 5
    with pytest.raises(EngineDeadError):
        client.add_request(_request("late", [10, 11]))
    with pytest.raises(EngineDeadError):
        client.get_output()



class _LiveProcess:
    exitcode = None


def _client_with_unattached_input(tmp_path, exitcode):
    """An MPClient's send path over a bound input socket that no core has attached to."""
    import zmq

    client = object.__new__(SyncMPClient)
    client.engine_dead, client._closing, client.engine_error = False, False, None
    client.proc = _LiveProcess()
    client.proc.exitcode = exitcode
    client.ctx = zmq.Context()
    client.input_socket = client.ctx.socket(zmq.PUSH)
    client.input_socket.setsockopt(zmq.LINGER, 0)
    address = f"ipc://{tmp_path}/input"
    client.input_socket.bind(address)
    return client, address


def test_a_send_waits_for_a_live_core_whose_socket_is_still_attaching(tmp_path):
    """ZeroMQ connects in the background, so the core's READY can come before its input
    socket is attached; a request sent at once must reach it, not read as a dead core."""
    import threading

    import zmq

    client, address = _client_with_unattached_input(tmp_path, exitcode=None)
    received = []

    def core_attaches_late():
        time.sleep(0.3)
        pull = client.ctx.socket(zmq.PULL)
        pull.connect(address)
        received.append(pull.recv_multipart())
        pull.close(linger=0)

    thread = threading.Thread(target=core_attaches_late)
    thread.start()
    client._send(EngineCoreRequestType.ABORT, b"payload")
    thread.join(timeout=10)
    assert received == [[EngineCoreRequestType.ABORT.value, b"payload"]]
    client.input_socket.close()


def test_a_send_to_an_exited_core_fails_at_once(tmp_path):
    client, _ = _client_with_unattached_input(tmp_path, exitcode=1)
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError):
        client._send(EngineCoreRequestType.ABORT, b"payload")
    assert time.monotonic() - t0 < 1.0
    client.input_socket.close()
