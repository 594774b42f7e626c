"""An API server's start: the tokenizer loads on a thread that yields the processors to the engine's worker
(frontend/server/main.py in_yielding_thread), which is what /health waits for; its result and its errors
reach the awaiting task."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from frontend.server.main import TOKENIZER_NICE, in_yielding_thread


def test_the_tokenizer_thread_yields_and_hands_back_its_result_and_errors() -> None:
    def niceness() -> tuple[int, bool]:
        thread = threading.current_thread()
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), thread is threading.main_thread()

    def fails() -> None:
        raise OSError("no tokenizer here")

    async def run() -> tuple[int, bool]:
        result = await in_yielding_thread(niceness)
        with pytest.raises(OSError, match="no tokenizer here"):
            await in_yielding_thread(fails)
        return result  # type: ignore[no-any-return]

    before = os.getpriority(os.PRIO_PROCESS, 0)
    nice, on_main = asyncio.run(run())
    assert nice == min(before + TOKENIZER_NICE, 19) and not on_main
    assert os.getpriority(os.PRIO_PROCESS, 0) == before  # the process's own (its main thread's) is untouched
