"""One msgpack codec per direction for the tagged unions. Frames: [type byte][msgpack body]."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

from protocol.messages import EngineMessage, FrontendMessage
from protocol.worker_messages import EngineToWorker, WorkerToEngine

T = TypeVar("T")

# NOTE: the type byte lets a router dispatch without decoding the body.
TYPE_BYTES: dict[str, bytes] = {
    "register": b"\x00",
    "add": b"\x01",
    "abort": b"\x02",
    "utility": b"\x03",
    "announce": b"\x04",
    "ready": b"\x10",
    "rejected": b"\x11",
    "outputs": b"\x12",
    "utility_result": b"\x13",
    "dead": b"\x14",
    "engine_set": b"\x15",
    "schedule": b"\x20",
    "shutdown": b"\x21",
    "worker_call": b"\x22",
    "model_output": b"\x30",
    "worker_ready": b"\x31",
    "worker_error": b"\x32",
    "worker_call_result": b"\x33",
}


class Codec(Generic[T]):
    """Encodes any tagged struct; decodes one union."""

    def __init__(self, union: Any) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(union)

    def encode(self, message: msgspec.Struct) -> list[bytes]:
        tag = type(message).__struct_config__.tag
        assert isinstance(tag, str)
        return [TYPE_BYTES[tag], self._encoder.encode(message)]

    def decode(self, frames: list[bytes] | list[Any]) -> T:
        return self._decoder.decode(frames[-1])


def frontend_codec() -> Codec[FrontendMessage]:
    """Decodes what frontends send (used by the engine)."""
    return Codec(FrontendMessage)


def engine_codec() -> Codec[EngineMessage]:
    """Decodes what the engine sends to frontends (used by frontends)."""
    return Codec(EngineMessage)


def worker_input_codec() -> Codec[EngineToWorker]:
    return Codec(EngineToWorker)


def worker_output_codec() -> Codec[WorkerToEngine]:
    return Codec(WorkerToEngine)


def encode_value(value: Any) -> msgspec.Raw:
    """Encode a utility argument or result."""
    return msgspec.Raw(msgspec.msgpack.encode(value))


def decode_value(raw: msgspec.Raw | bytes) -> Any:
    return msgspec.msgpack.decode(bytes(raw))
