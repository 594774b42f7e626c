"""The scheduler's waiting requests: FCFS (a deque) or priority (a heap ordered by Request.__lt__).

Invariant: a request is in the queue at most once; a preempted one re-enters at the front (FCFS).
"""

from __future__ import annotations

import heapq
from collections import deque

from engine_core.request import Request


class WaitingQueue:
    """FCFS (a deque) or priority (a heap ordered by Request.__lt__)."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._fcfs: deque[Request] = deque()
        self._heap: list[Request] = []

    def add(self, request: Request) -> None:
        if self.policy == "priority":
            heapq.heappush(self._heap, request)
        else:
            self._fcfs.append(request)

    def add_front(self, request: Request) -> None:
        """Re-queue a preempted request ahead of newer arrivals."""
        if self.policy == "priority":
            heapq.heappush(self._heap, request)
        else:
            self._fcfs.appendleft(request)

    def peek(self) -> Request:
        return self._heap[0] if self.policy == "priority" else self._fcfs[0]

    def pop(self) -> Request:
        return heapq.heappop(self._heap) if self.policy == "priority" else self._fcfs.popleft()

    def remove(self, request: Request) -> None:
        if self.policy == "priority":
            self._heap.remove(request)
            heapq.heapify(self._heap)
        else:
            self._fcfs.remove(request)

    def __len__(self) -> int:
        return len(self._heap) + len(self._fcfs)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._heap if self.policy == "priority" else self._fcfs)
