"""A watchdog over the engine core's steps: a step that never returns becomes the core's
death, which the frontend reports and the server's supervisor restarts.

A device can hang where no error is raised: a collective or a peer all-reduce kernel
waiting for a rank that never arrives, a driver fault. The host thread then blocks in
the step forever and every request with it. vLLM bounds the same wait in its executor
(`VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`); here `JAXLLM_EXECUTE_MODEL_TIMEOUT_SECONDS` bounds
one `EngineCore.step()` of the core process (0: unbounded). The blocked thread cannot be
interrupted, so the core process exits (`core_proc.EngineCoreProc._step_hung`).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator

from jaxllm.errors import ParameterError

ENV = "JAXLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"
DEFAULT_TIMEOUT_S = 300.0  # vLLM's default for the same bound


def step_timeout() -> float:
    """The bound on one step, in seconds, from `JAXLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`."""
    raw = os.environ.get(ENV, "")
    try:
        seconds = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        raise ParameterError(ENV, f"must be a number of seconds, got {raw!r}") from None
    if not seconds >= 0 or seconds == float("inf"):
        raise ParameterError(ENV, f"must be finite and at least 0 (0: no bound), got {raw!r}")
    return seconds


class StepWatchdog:
    """Calls `on_hung(seconds)` once, from its own thread, when a step entered with
    `step()` has run longer than `timeout_s` (0: never)."""

    def __init__(self, timeout_s: float, on_hung: Callable[[float], None]):
        self.timeout_s = timeout_s
        self.on_hung = on_hung
        self._started: float | None = None  # when the running step began (monotonic)
        self._closed = threading.Event()
        if timeout_s > 0:
            threading.Thread(target=self._watch, name="step-watchdog", daemon=True).start()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        self._started = time.monotonic()
        try:
            yield
        finally:
            self._started = None

    def close(self) -> None:
        self._closed.set()

    def _watch(self) -> None:
        # Checked a few times per bound: a hang is reported within a quarter of it late.
        while not self._closed.wait(min(1.0, self.timeout_s / 4)):
            started = self._started
            if started is not None and time.monotonic() - started > self.timeout_s:
                self.on_hung(time.monotonic() - started)
                return
