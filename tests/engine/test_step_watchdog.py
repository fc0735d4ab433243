"""A step that never returns (a hung device) becomes the engine core's death, named as
such, instead of a frontend that waits forever (engine/step_watchdog.py)."""

from __future__ import annotations

import os
import textwrap
import time

import pytest

from jaxllm import SamplingParams
from jaxllm.config import EngineArgs
from jaxllm.engine.core_client import SyncMPClient
from jaxllm.engine.llm_engine import LLMEngine
from jaxllm.engine.step_watchdog import ENV, StepWatchdog, step_timeout
from jaxllm.errors import EngineDeadError, ParameterError
from tests.models.tiny_checkpoints import make_tiny_checkpoint


def test_a_step_past_the_bound_is_reported_once_and_a_quick_one_never():
    hung: list[float] = []
    dog = StepWatchdog(0.4, hung.append)
    try:
        for _ in range(3):
            with dog.step():
                time.sleep(0.05)
        time.sleep(0.6)  # idle between steps is not a step
        assert hung == []
        with dog.step():
            time.sleep(1.2)
        assert len(hung) == 1 and hung[0] > 0.4
        with dog.step():
            time.sleep(0.8)
        assert len(hung) == 1
    finally:
        dog.close()


def test_a_zero_bound_never_fires():
    hung: list[float] = []
    dog = StepWatchdog(0.0, hung.append)
    with dog.step():
        time.sleep(0.3)
    assert hung == []


@pytest.mark.parametrize("raw", ["soon", "-1", "nan", "inf"])
def test_a_bad_bound_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv(ENV, raw)
    with pytest.raises(ParameterError, match=f"^{ENV}: "):
        step_timeout()


def test_the_bound_defaults_to_vllms(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert step_timeout() == 300.0
    monkeypatch.setenv(ENV, "0")
    assert step_timeout() == 0.0


@pytest.mark.slow
def test_a_core_told_a_bad_bound_fails_to_start_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, "soon")
    config = EngineArgs(model=make_tiny_checkpoint(tmp_path, arch="llama"), dtype="float32",
                        max_model_len=128, precompile=False).create_engine_config()
    with pytest.raises(RuntimeError, match=f"failed to start.*{ENV}: must be a number"):
        SyncMPClient(config)


# Loaded by the core process at its interpreter's start (PYTHONPATH): its third step
# blocks as a step on a hung device would.
HANG_HOOK = textwrap.dedent("""
    import os, time
    if os.environ.get("JAXLLM_TEST_HANG_AT_STEP"):
        from jaxllm.engine import core
        _step, _count = core.EngineCore.step, [0]

        def step(self):
            _count[0] += 1
            if _count[0] == int(os.environ["JAXLLM_TEST_HANG_AT_STEP"]):
                time.sleep(3600)
            return _step(self)

        core.EngineCore.step = step
""")


@pytest.mark.slow
def test_a_hung_step_ends_the_core_and_the_frontend_says_why(tmp_path, monkeypatch):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HANG_HOOK)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(hook), os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv("JAXLLM_TEST_HANG_AT_STEP", "3")
    monkeypatch.setenv(ENV, "2")
    model = make_tiny_checkpoint(tmp_path, arch="llama")
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=model, dtype="float32", max_model_len=128, max_num_seqs=4, block_size=8,
        token_buckets=[16], request_buckets=[4], max_num_batched_tokens=16), multiprocess=True)
    try:
        engine.add_request("r", {"prompt_token_ids": [10, 11, 12]},
                           SamplingParams(max_tokens=40, ignore_eos=True))
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match=f"past {ENV}=2: the device did not finish"):
            while True:
                engine.step()
        assert time.monotonic() - t0 < 30
        # The client's monitor thread reaps the core; a second reaper racing it would
        # read no exit code (waitpid's ECHILD), so the test waits for the monitor.
        engine.engine_core._monitor.join(timeout=10)
        assert engine.engine_core.proc.exitcode == 1
        with pytest.raises(EngineDeadError):
            engine.add_request("late", {"prompt_token_ids": [10]}, SamplingParams())
    finally:
        engine.shutdown()
