"""A frontend's connection to the EngineCore: two DEALER sockets that connect to the engine's ROUTERs.

Requests go out on the input socket; outputs for this frontend's requests (and only those) come back
on the output socket, routed by the frontend's identity.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import zmq

from protocol.codec import decode_value, encode_value, engine_codec, frontend_codec
from protocol.errors import EngineDeadError, ProtocolVersionError
from protocol.messages import (
    PROTOCOL_VERSION,
    AbortRequests,
    AddRequest,
    EngineDead,
    EngineMessage,
    ModelInfo,
    Ready,
    Register,
    Rejected,
    UtilityCall,
    UtilityResult,
)


def connect_dealers(
    context: zmq.Context, client_id: str, input_address: str, output_address: str
) -> tuple[Any, Any]:
    """A frontend's (input, output) DEALER sockets, both carrying its identity, never dropping."""
    identity = client_id.encode()
    output_socket = context.socket(zmq.DEALER)
    input_socket = context.socket(zmq.DEALER)
    for sock in (output_socket, input_socket):
        sock.setsockopt(zmq.IDENTITY, identity)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
    # Output first, so the engine can route the Ready reply as soon as it sees the Register.
    output_socket.connect(output_address)
    input_socket.connect(input_address)
    return input_socket, output_socket


class EngineClient:
    def __init__(self, input_address: str, output_address: str, client_id: str | None = None) -> None:
        self.client_id = client_id or f"fe-{uuid.uuid4().hex[:12]}"
        self._codec = frontend_codec()
        self._decoder = engine_codec()
        self._context = zmq.Context()
        self.input_socket, self.output_socket = connect_dealers(
            self._context, self.client_id, input_address, output_address
        )
        self.model_info: ModelInfo | None = None
        self._next_call_id = 0
        self.pending: list[EngineMessage] = []  # messages received while waiting for something else

    def register(self, timeout_s: float, is_alive: Any = None) -> ModelInfo:
        """Join the engine; is_alive() (optional) lets the wait end early when the engine process died."""
        self._send(Register(PROTOCOL_VERSION, self.client_id))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if is_alive is not None and not is_alive():
                raise EngineDeadError("the engine process exited during startup (see its log above)")
            message = self.receive(timeout_s=0.5)
            if isinstance(message, Ready):
                self.model_info = message.model_info
                return message.model_info
            if isinstance(message, Rejected):
                raise ProtocolVersionError(message.reason)
            if isinstance(message, EngineDead):
                raise EngineDeadError(message.reason)
        raise TimeoutError(f"the engine did not answer registration within {timeout_s} s")

    def add_request(self, request: AddRequest) -> None:
        self._send(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(AbortRequests(request_ids))

    def call_utility(self, method: str, *args: Any, timeout_s: float = 60.0) -> Any:
        self._next_call_id += 1
        call_id = self._next_call_id
        self._send(UtilityCall(call_id, method, [encode_value(a) for a in args]))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            message = self._receive_socket(timeout_s=0.5)
            if isinstance(message, UtilityResult) and message.call_id == call_id:
                if message.error is not None:
                    raise RuntimeError(message.error)
                return decode_value(message.result)
            if isinstance(message, EngineDead):
                raise EngineDeadError(message.reason)
            if message is not None:
                self.pending.append(message)
        raise TimeoutError(f"utility {method!r} got no answer within {timeout_s} s")

    def receive(self, timeout_s: float | None) -> EngineMessage | None:
        """The next message from the engine, or None after timeout_s."""
        if self.pending:
            return self.pending.pop(0)
        return self._receive_socket(timeout_s)

    def _receive_socket(self, timeout_s: float | None) -> EngineMessage | None:
        timeout_ms = None if timeout_s is None else int(timeout_s * 1000)
        if not self.output_socket.poll(timeout_ms):
            return None
        return self._decoder.decode(self.output_socket.recv_multipart(copy=False))

    def _send(self, message: Any) -> None:
        self.input_socket.send_multipart(self._codec.encode(message), copy=False)

    def close(self) -> None:
        self.input_socket.close()
        self.output_socket.close()
        self._context.term()
