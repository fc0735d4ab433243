"""scripts/profile_step.py's reading of a multi-device trace, on synthetic events: the
devices' step start skew at the first sum of each step, their busy fractions and time in
the sums, and the host threads' forward launches."""

from __future__ import annotations

import pytest

from scripts import profile_step


def _meta(pid: int, name: str) -> dict:
    return {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}}


def _x(pid: int, name: str, ts: float, dur: float, tid: int = 0) -> dict:
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}


def test_step_skew_reads_each_steps_first_sum_on_every_device():
    # Two devices, 3 steps of 2 sums each, 1000 us apart; device 1 starts its steps
    # 5 us later (at 7 us in step 2) and its first sums wait that long.
    events = [_meta(1, "/device:GPU:0"), _meta(2, "/device:GPU:1"), _meta(3, "/host:CPU")]
    for step in range(3):
        t = 1000.0 * step
        late = 7.0 if step == 2 else 5.0
        events += [_x(1, "gemv", t, 100), _x(1, "peer_all_reduce", t + 100, 4 + late),
                   _x(1, "peer_all_reduce", t + 300, 4)]
        events += [_x(2, "gemv", t + late, 100), _x(2, "peer_all_reduce", t + 100 + late, 4),
                   _x(2, "peer_all_reduce", t + 300, 4)]
    events.append(_x(3, "peer_all_reduce", 0, 50))  # a host event: not a device's
    out = profile_step.step_skew(events, per_step=2)
    assert out["steps"] == 2  # the first step is left out
    assert out["start_skew_us"] == {"median": 6.0, "max": 7.0}
    assert len(out["devices"]) == 2
    assert out["devices"][0]["marker_ms"] == pytest.approx((9 + 4 + 9 + 4 + 11 + 4) / 1e3)
    assert 0 < out["devices"][1]["busy_fraction"] < out["devices"][0]["busy_fraction"] < 1
    # No sums of the peer route (XLA's all-reduce): no steps to read.
    plain = [e for e in events if e.get("name") != "peer_all_reduce"]
    assert profile_step.step_skew(plain, per_step=2)["steps"] == 0


def test_launch_threads_reads_each_threads_forward_and_its_graph_launch():
    module = "jit_forward:XLA GPU module"
    events = []
    for tid, (length, graph) in enumerate([(1200.0, 1000.0), (1600.0, 1400.0)]):
        for k in range(3):
            t = 5000.0 * k
            events += [_x(9, module, t, length, tid),
                       _x(9, "cuGraphLaunch (CudaGraph:7)", t + 50, graph, tid),
                       _x(9, "cuGraphLaunch (CudaGraph:8)", t + 3000, 5, tid)]  # the sampler's
    events.append(_x(9, "cuGraphLaunch (CudaGraph:9)", 0, 10, 7))  # a thread with no forward
    rows = profile_step.launch_threads(events)
    assert rows == [{"launches": 3, "median_us": 1600.0, "graph_launch_median_us": 1400.0},
                    {"launches": 3, "median_us": 1200.0, "graph_launch_median_us": 1000.0}]
