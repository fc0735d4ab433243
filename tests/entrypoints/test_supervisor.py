"""The engine supervisor's policy, over a stand-in engine: restart a dead core, give up
after the allowed restarts in a row, and forgive old deaths once a core has stayed up."""

from __future__ import annotations

import asyncio

from jaxllm.entrypoints.openai.supervisor import EngineSupervisor


class FakeEngine:
    """`errored` until a restart succeeds; `restart_fails` restarts raise first."""

    def __init__(self, restart_fails: int = 0):
        self.errored = False
        self.dead_error = RuntimeError("killed")
        self.restart_fails = restart_fails
        self.restart_calls = 0

    async def restart_engine_core(self, startup_timeout_s=None) -> None:
        self.restart_calls += 1
        await asyncio.sleep(0)
        if self.restart_fails:
            self.restart_fails -= 1
            raise RuntimeError("the new core failed to start")
        self.errored = False


def _supervise(engine: FakeEngine, max_restarts: int, deaths: list[float],
               run_for: float = 0.3, stable_s: float = 60.0) -> tuple[bool, EngineSupervisor]:
    """Runs a supervisor for `run_for` s, killing the engine at each time in `deaths`."""
    gave_up = asyncio.Event()

    async def main() -> EngineSupervisor:
        sup = EngineSupervisor(engine, max_restarts, gave_up.set, stable_s=stable_s,
                               poll_s=0.005, retry_delay_s=0.0)
        task = asyncio.ensure_future(sup.run())
        t0 = asyncio.get_running_loop().time()
        for at in deaths:
            await asyncio.sleep(max(0.0, t0 + at - asyncio.get_running_loop().time()))
            engine.errored = True
        await asyncio.sleep(run_for)
        task.cancel()
        return sup

    sup = asyncio.run(main())
    return gave_up.is_set(), sup


def test_a_dead_core_is_restarted_and_the_server_stays_up():
    engine = FakeEngine()
    gave_up, sup = _supervise(engine, max_restarts=3, deaths=[0.0])
    assert not gave_up and not engine.errored and engine.restart_calls == 1


def test_failed_restarts_are_retried_up_to_the_bound_then_it_gives_up():
    engine = FakeEngine(restart_fails=10)
    gave_up, sup = _supervise(engine, max_restarts=3, deaths=[0.0])
    assert gave_up and engine.restart_calls == 3 and engine.errored


def test_a_restart_that_works_after_failures_keeps_the_server_up():
    engine = FakeEngine(restart_fails=2)
    gave_up, _ = _supervise(engine, max_restarts=3, deaths=[0.0])
    assert not gave_up and engine.restart_calls == 3 and not engine.errored


def test_zero_restarts_gives_up_at_the_first_death():
    engine = FakeEngine()
    gave_up, _ = _supervise(engine, max_restarts=0, deaths=[0.0])
    assert gave_up and engine.restart_calls == 0


def test_deaths_in_a_row_exhaust_the_bound():
    engine = FakeEngine()
    gave_up, _ = _supervise(engine, max_restarts=2, deaths=[0.0, 0.05, 0.1])
    assert gave_up and engine.restart_calls == 2


def test_a_core_that_stayed_up_resets_the_count():
    engine = FakeEngine()
    gave_up, sup = _supervise(engine, max_restarts=2, deaths=[0.0, 0.1, 0.2], stable_s=0.05)
    assert not gave_up and engine.restart_calls == 3 and sup.total_restarts == 3
