"""Restarts a dead engine core for the API server, a bounded number of times.

When the core's process dies, AsyncLLM fails the requests in flight and
/health answers 503. The supervisor then starts a new core (its programs come
from the on-disk compilation cache); /health is 200 again once it is ready.
After `max_restarts` restarts without the core staying up for `stable_s` in
between, or at once with `max_restarts=0` (vLLM's behaviour), it gives up and
the server exits non-zero, so that an orchestrator restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("jaxllm.api_server")

# `jaxllm serve --engine-restarts` and ServerOptions both default to it.
DEFAULT_ENGINE_RESTARTS = 3


class EngineSupervisor:
    def __init__(self, engine: Any, max_restarts: int, give_up: Callable[[], None],
                 stable_s: float = 60.0, poll_s: float = 0.1, retry_delay_s: float = 1.0,
                 startup_timeout_s: float | None = None):
        """`engine`: an AsyncLLM (`errored`, `restart_engine_core()`); `give_up`: stops the
        server with a failure status."""
        self.engine = engine
        self.max_restarts = max_restarts
        self.give_up = give_up
        self.stable_s = stable_s
        self.poll_s = poll_s
        self.retry_delay_s = retry_delay_s
        self.startup_timeout_s = startup_timeout_s
        self.restarts = 0  # in a row: reset once a core has stayed up for stable_s
        self.total_restarts = 0

    async def run(self) -> None:
        up_since = time.monotonic()
        while True:
            await asyncio.sleep(self.poll_s)
            if not self.engine.errored:
                if self.restarts and time.monotonic() - up_since >= self.stable_s:
                    self.restarts = 0
                continue
            logger.error("the engine core is dead: %s", self.engine.dead_error)
            if not await self._restart():
                self.give_up()
                return
            up_since = time.monotonic()

    async def _restart(self) -> bool:
        """Starts a new core; False once the restarts are used up."""
        while self.restarts < self.max_restarts:
            self.restarts += 1
            self.total_restarts += 1
            logger.warning("restarting the engine core (restart %d of at most %d in a row)",
                           self.restarts, self.max_restarts)
            try:
                await self.engine.restart_engine_core(self.startup_timeout_s)
            except Exception:
                logger.exception("the engine core failed to restart")
                await asyncio.sleep(self.retry_delay_s)
                continue
            logger.info("the engine core is running again")
            return True
        logger.error("the engine core died and %s; exiting",
                     "--engine-restarts is 0" if self.max_restarts == 0
                     else f"{self.max_restarts} restarts in a row did not keep it up")
        return False
