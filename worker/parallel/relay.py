"""Rank 0 passes each message from the engine, as the engine encoded it, to the other ranks, and gathers
their answers to calls.

NOTE: the engine speaks to rank 0 alone and rank 0 fans out, rather than the engine sending to every rank:
the engine never imports torch, and the ranks' addresses live in torch.distributed's store, which rank 0
holds. One ROUTER on rank 0, one DEALER per other rank (on this machine or another): a rank says hello
when it connects, so no message is sent before every rank can receive it (a PUB socket would drop what
it sends before its subscribers join). The frames are sent as received, without decoding or copying.
"""

from __future__ import annotations

import time
from typing import Any

import zmq

from protocol.codec import worker_output_codec
from protocol.worker_messages import WorkerCallResult

RELAY_KEY = "engine/relay"
PING = b"ping"  # a frame no encoded message equals (they start with their tag)


class RelayError(RuntimeError):
    """A rank did not join or did not answer in time."""


class Relay:
    def __init__(
        self,
        store: Any,
        rank: int,
        size: int,
        host: str,
        timeout_s: float,
        startup_timeout_s: float | None = None,
    ) -> None:
        """timeout_s: a call's answer, and rank 0's silence; startup_timeout_s: the other ranks' hellos."""
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        self.startup_timeout_s = startup_timeout_s or timeout_s
        self.context = zmq.Context()
        self.codec = worker_output_codec()
        if rank == 0:
            self.socket = self.context.socket(zmq.ROUTER)
            self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        else:
            self.socket = self.context.socket(zmq.DEALER)
            self.socket.setsockopt(zmq.IDENTITY, f"rank-{rank}".encode())
        for option in (zmq.SNDHWM, zmq.RCVHWM, zmq.LINGER):
            self.socket.setsockopt(option, 0)
        if rank == 0:
            self.socket.bind(f"tcp://{host}:*")
            store.set(RELAY_KEY, self.socket.getsockopt(zmq.LAST_ENDPOINT))
            self.peers = self._wait_for_hellos()
        else:
            self.socket.connect(store.get(RELAY_KEY).decode())
            self.socket.send(b"hello")
            self.last_heard = time.monotonic()

    def _wait_for_hellos(self) -> list[bytes]:
        joined: set[bytes] = set()
        deadline = time.monotonic() + self.startup_timeout_s
        while len(joined) < self.size - 1:
            if not self.socket.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                raise RelayError(f"{self.size - 1 - len(joined)} ranks did not reach rank 0's relay in time")
            identity, _ = self.socket.recv_multipart()
            joined.add(identity)
        return [f"rank-{rank}".encode() for rank in range(1, self.size)]

    # ---- rank 0 ----

    def forward(self, frames: list[bytes]) -> None:
        for peer in self.peers:
            self.socket.send_multipart([peer, *frames], copy=False)

    def ping(self) -> None:
        """While the engine is idle: tell the other ranks rank 0 is alive (one on another machine has no
        other way to learn that it died)."""
        self.forward([PING])

    def gather_answers(self) -> list[WorkerCallResult]:
        """The other ranks' answers to the call just forwarded, in rank order."""
        answers: dict[bytes, WorkerCallResult] = {}
        deadline = time.monotonic() + self.timeout_s
        while len(answers) < len(self.peers):
            if not self.socket.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                missing = [peer.decode() for peer in self.peers if peer not in answers]
                raise RelayError(f"{', '.join(missing)} did not answer a call within {self.timeout_s:.0f} s")
            identity, *frames = self.socket.recv_multipart()
            answer = self.codec.decode(frames)
            assert isinstance(answer, WorkerCallResult)
            answers[identity] = answer
        return [answers[peer] for peer in self.peers]

    # ---- the other ranks ----

    def receive(self, timeout_ms: int) -> list[bytes] | None:
        """The next message from rank 0 (None: none within timeout_ms, or a ping); RelayError when rank 0
        has been silent for timeout_s (it pings every second while idle)."""
        if not self.socket.poll(timeout_ms):
            if time.monotonic() - self.last_heard > self.timeout_s:
                raise RelayError(f"rank 0 has been silent for {self.timeout_s:.0f} s: it is gone")
            return None
        frames = self.socket.recv_multipart()
        self.last_heard = time.monotonic()
        return None if frames == [PING] else frames

    def answer(self, answer: WorkerCallResult) -> None:
        self.socket.send_multipart(self.codec.encode(answer))

    def close(self) -> None:
        self.socket.close(linger=1000)  # a shutdown just passed on still goes out
        self.context.term()


def combine(own: WorkerCallResult, others: list[WorkerCallResult]) -> WorkerCallResult:
    """Rank 0's answer for the group: the first failure, or rank 0's result with the others' beside it."""
    for answer in (own, *others):
        if answer.error is not None:
            return answer
    return WorkerCallResult(result=own.result, per_rank=[answer.result for answer in others])
