"""Counting JAX compilations inside a block: the engine compiles nothing after warm-up."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax

_EVENTS = ("/jax/core/compile/backend_compile_duration", "/jax/core/compile/jaxpr_trace_duration")


@contextlib.contextmanager
def recorded_compilations() -> Iterator[list[str]]:
    """Yields a list that gains one entry for each trace or backend compile in the block."""
    events: list[str] = []

    def listener(event: str, duration: float, **kwargs) -> None:
        if event in _EVENTS:
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.clear_event_listeners()
