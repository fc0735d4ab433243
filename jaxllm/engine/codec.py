"""The wire format between the frontend and the engine-core process.

Frames on the input socket are `[EngineCoreRequestType, msgpack payload]`; on
the output socket `[OUTPUTS | UTILITY_RESULT, msgpack payload]`; the handshake
socket carries one `Handshake`. `Codec` holds one typed decoder per kind.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from jaxllm.core.messages import EngineCoreOutputs, EngineCoreRequest


class EngineCoreRequestType(enum.Enum):
    """First frame of every message on the input socket."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"
    SHUTDOWN = b"\x03"


# First frame of every message on the output socket.
OUTPUTS = b"O"
UTILITY_RESULT = b"U"


class Handshake(msgspec.Struct, omit_defaults=True):  # type: ignore[call-arg]
    status: str  # "READY" | "FAILED"
    max_request_tokens: int = 0
    num_blocks: int = 0
    error: str | None = None


class UtilityCall(msgspec.Struct, array_like=True):  # type: ignore[call-arg]
    call_id: int
    method: str
    args: list[Any] = []


class UtilityResult(msgspec.Struct, array_like=True):  # type: ignore[call-arg]
    call_id: int
    ok: bool
    result: Any = None  # the return value, or the error text when not ok


class Codec:
    """msgpack encoder plus one typed decoder per message kind."""

    def __init__(self) -> None:
        self.encoder = msgspec.msgpack.Encoder()
        self.request_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
        self.abort_decoder = msgspec.msgpack.Decoder(list[str])
        self.utility_decoder = msgspec.msgpack.Decoder(UtilityCall)
        self.outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self.result_decoder = msgspec.msgpack.Decoder(UtilityResult)
        self.handshake_decoder = msgspec.msgpack.Decoder(Handshake)

    def encode(self, obj: Any) -> bytes:
        return self.encoder.encode(obj)

    def decode_input(self, kind: bytes, payload: bytes) -> tuple[EngineCoreRequestType, Any]:
        req_type = EngineCoreRequestType(kind)
        if req_type == EngineCoreRequestType.ADD:
            return req_type, self.request_decoder.decode(payload)
        if req_type == EngineCoreRequestType.ABORT:
            return req_type, self.abort_decoder.decode(payload)
        if req_type == EngineCoreRequestType.UTILITY:
            return req_type, self.utility_decoder.decode(payload)
        return req_type, None
