"""The data-parallel client's bookkeeping, with stand-in cores: where requests go, where
their aborts go, when a core counts a request no longer, and a failed start."""

from __future__ import annotations

import pytest

from jaxllm.core.messages import EngineCoreOutput, EngineCoreOutputs, FinishReason
from jaxllm.distributed.dp_devices import CorePlacement, core_devices, restrict_visible_gpus
from jaxllm.engine.dp_client import DPSyncMPClient, LoadBalancer
from jaxllm.errors import ParameterError


class FakeCore:
    """Records what the DP client sends to one core."""

    def __init__(self, placement: CorePlacement):
        self.engine_index = placement.rank
        self.max_request_tokens = 100 + placement.rank
        self.num_blocks = 10
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.stopped = False

    def add_request(self, request) -> None:
        self.added.append(request.request_id)

    def abort_requests(self, ids: list[str]) -> None:
        self.aborted.extend(ids)

    def shutdown(self) -> None:
        self.stopped = True


class Req:
    def __init__(self, request_id: str):
        self.request_id = request_id


def fake_client(dp: int, made: list[FakeCore], fail_rank: int | None = None
                ) -> DPSyncMPClient:
    """A DP client over stand-in cores (appended to `made` as they start)."""
    client = DPSyncMPClient.__new__(DPSyncMPClient)

    def make(p: CorePlacement) -> FakeCore:
        if p.rank == fail_rank:
            raise RuntimeError(f"core {p.rank} failed to start")
        made.append(FakeCore(p))
        return made[-1]

    client._start(make, dp, 1)
    return client


def finished(engine: int, *ids: str) -> EngineCoreOutputs:
    return EngineCoreOutputs(outputs=[EngineCoreOutput(i, [1], finish_reason=FinishReason.LENGTH)
                                      for i in ids], engine_index=engine)


def test_requests_go_to_the_least_loaded_core_and_ties_take_turns():
    lb = LoadBalancer(2)
    assert [lb.assign(r) for r in "abcd"] == [0, 1, 0, 1]
    lb.observe(finished(0, "a"))
    assert lb.counts == [1, 2]
    assert lb.assign("e") == 0  # the less loaded core, though core 1 is next in turn
    lb.observe(finished(0, "e"))
    lb.observe(finished(0, "c"))
    lb.observe(finished(1, "b"))
    assert lb.counts == [0, 1]
    # One request at a time (each finished before the next) still alternates.
    lb.observe(finished(1, "d"))
    got = []
    for r in "fgh":
        got.append(lb.assign(r))
        lb.observe(finished(got[-1], r))
    assert got == [1, 0, 1]


def test_a_finish_reported_by_another_core_or_an_abort_without_an_output_releases_right():
    lb = LoadBalancer(2)
    assert lb.assign("x") == 0 and lb.assign("y") == 1
    lb.observe(finished(1, "x"))  # a stale output for a reused id: not core 1's request
    assert lb.owner == {"x": 0, "y": 1}
    lb.observe(EngineCoreOutputs(finished_requests=["x"], engine_index=0))
    assert lb.owner == {"y": 1} and lb.counts == [0, 1]


def test_aborts_reach_the_core_that_holds_each_request():
    made: list[FakeCore] = []
    client = fake_client(3, made)
    for r in ("a", "b", "c", "d"):
        client.add_request(Req(r))
    assert [c.added for c in made] == [["a", "d"], ["b"], ["c"]]
    client.abort_requests(["d", "b", "unknown"])
    assert [c.aborted for c in made] == [["d"], ["b"], []]
    assert client.balancer.counts == [1, 0, 1]
    client.abort_requests(["d"])  # already gone: sent nowhere
    assert [c.aborted for c in made] == [["d"], ["b"], []]
    assert client.max_request_tokens == 100  # every core must hold a request


def test_a_core_that_fails_to_start_stops_the_started_ones():
    made: list[FakeCore] = []
    with pytest.raises(RuntimeError, match="core 1 failed to start"):
        fake_client(3, made, fail_rank=1)
    assert [c.engine_index for c in made] == [0, 2] and all(c.stopped for c in made)


def test_each_core_takes_its_own_slice_of_the_devices(monkeypatch):
    import os

    import jax

    devices = jax.devices()
    assert core_devices(2, 2, 1, devices[:4]) == devices[2:4]
    assert core_devices(2, 1, 0, devices[:4]) == devices[:4]
    with pytest.raises(ParameterError, match="needs 6 devices, but engine core 0 sees 4"):
        core_devices(2, 3, 0, devices[:4])

    class Chip:
        platform = "tpu"

    # A TPU core's process is left only its own chips (tpu_dp.py); one that sees the whole
    # host would fight the other cores for them.
    with pytest.raises(ParameterError, match="engine core 0 sees 2 TPU devices, not its own 1"):
        core_devices(1, 2, 0, [Chip(), Chip()])
    own = [Chip(), Chip()]
    assert core_devices(2, 4, 3, own) == own
    assert core_devices(1, 1, 0, [Chip()])[0].platform == "tpu"

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    restrict_visible_gpus(CorePlacement(1, 2, 2))
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "6,7"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    restrict_visible_gpus(CorePlacement(1, 2, 3))
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3,4,5"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(ParameterError, match="needs 4 GPUs, but CUDA_VISIBLE_DEVICES names 2"):
        restrict_visible_gpus(CorePlacement(0, 2, 2))
