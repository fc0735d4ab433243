"""The engine core launcher hands each data-parallel core its libtpu environment: a core
started through the real launch path (`launch_core`, spawn, `run_engine_core`) on a
host named a TPU VM by the override reports, from its own process, the environment it
runs with before it starts JAX. No TPU here: JAX stays on the CPU (the tests' platform)."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future

from jaxllm.distributed.dp_devices import core_placements
from jaxllm.engine.core_launch import launch_core

REPORT = "data-parallel core 1 of 2: "


def test_a_launched_core_runs_with_its_own_chips_in_its_environment(capfd, caplog):
    caplog.set_level(logging.INFO, logger="jaxllm")  # the core logs at the frontend's level
    placement = core_placements(2, 2, environ={"JAXLLM_TPU_HOST": "v6e:2x4"})[1]
    config: Future = Future()  # never built: the core waits for it after its JAX start
    outcome: list[BaseException] = []

    def launch() -> None:
        try:
            launch_core(config, use_asyncio=False, startup_timeout_s=120, placement=placement)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            outcome.append(e)

    launcher = threading.Thread(target=launch)
    launcher.start()
    err, deadline = "", time.monotonic() + 120
    try:
        while REPORT not in err and time.monotonic() < deadline:
            time.sleep(0.2)
            err += capfd.readouterr().err
    finally:
        config.set_exception(RuntimeError("no config in this test"))
        launcher.join(timeout=60)
    assert not launcher.is_alive()
    assert [str(e) for e in outcome] == ["no config in this test"]
    assert REPORT in err, err[-2000:]
    line = err.split(REPORT, 1)[1].splitlines()[0]
    reported = dict(item.split("=", 1) for item in line.split())
    assert reported == placement.env
    assert reported["TPU_VISIBLE_CHIPS"] == "2,3"
    assert reported["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "1,2,1"
