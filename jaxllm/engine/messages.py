"""The engine's wire frames; the message structs themselves live in `jaxllm.core.messages`.

The structs are re-exported here so that code importing them from this module
keeps working while parallel branches merge.
"""

from __future__ import annotations

import enum

from jaxllm.core.messages import (  # noqa: F401  (re-exported)
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    LogprobsLists,
    SchedulerStats,
)


class EngineCoreRequestType(enum.Enum):
    """First frame of every message on the input socket."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"
    SHUTDOWN = b"\x03"
