"""Counting JAX compilations inside a block: the engine compiles nothing after warm-up."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax

_EVENTS = ("/jax/core/compile/backend_compile_duration", "/jax/core/compile/jaxpr_trace_duration")


def generate_recording_compilations(llm, prompts: list[list[int]], params, times: int = 2
                                    ) -> tuple[list, list[list[str]]]:
    """`prompts` through `llm.generate` `times` times: each pass's outputs, and each
    pass's compilations (`recorded_compilations`)."""
    runs, compiles = [], []
    for _ in range(times):
        with recorded_compilations() as compiled:
            runs.append(llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                     use_tqdm=False))
        compiles.append(compiled)
    return runs, compiles


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
