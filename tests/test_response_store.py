"""ResponseStore: bounded by count and bytes with least-recently-used eviction, one file shared by every
connection (every API server of an `engine serve`), and SQLite on the store's own thread: the event loop
runs while a write waits, writes land in the order they were called, and a get sees every one before it."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

from frontend.responses.store import ResponseStore

T = TypeVar("T")


def body(response_id: str, text: str = "") -> dict[str, str]:
    return {"id": response_id, "status": "completed", "text": text}


def run(call: Awaitable[T]) -> T:
    async def wait() -> T:
        return await call

    return asyncio.run(wait())


def test_count_bound_evicts_the_least_recently_used(tmp_path: Path) -> None:
    store = ResponseStore(str(tmp_path / "r.sqlite"), max_count=3, max_bytes=1 << 20)
    for name in "abc":
        assert run(store.put(body(name), [{"role": "user", "content": name}], None))
    assert run(store.get("a")) is not None  # a is now the most recently used
    run(store.put(body("d"), [], None))
    assert run(store.get("b")) is None and {n for n in "acd" if run(store.get(n))} == set("acd")
    assert store.stats()[0] == 3
    store.close()


def test_byte_bound_and_a_response_too_large(tmp_path: Path) -> None:
    store = ResponseStore(str(tmp_path / "r.sqlite"), max_count=100, max_bytes=400)
    for index in range(6):
        run(store.put(body(f"r{index}", "x" * 50), [], None))
        assert store.stats()[1] <= 400
    assert run(store.get("r0")) is None and run(store.get("r5")) is not None
    assert not run(store.put(body("huge", "x" * 1000), [], None)) and run(store.get("huge")) is None
    store.close()


def test_every_connection_sees_one_store(tmp_path: Path) -> None:
    path = str(tmp_path / "r.sqlite")
    first, second = ResponseStore(path, 10, 1 << 20), ResponseStore(path, 10, 1 << 20)
    run(first.put(body("shared", "hello"), [{"type": "message"}], "resp-1-0"))
    stored = run(second.get("shared"))
    assert stored is not None and stored.body["text"] == "hello" and stored.engine_request_id == "resp-1-0"
    assert run(second.delete("shared")) and run(first.get("shared")) is None
    assert not run(first.delete("shared"))
    first.close()
    second.close()


def test_the_loop_runs_while_a_write_waits_for_the_file(tmp_path: Path) -> None:
    """Another API server holds the write lock: the put waits on the store's thread, not on the loop."""
    path = str(tmp_path / "r.sqlite")
    store = ResponseStore(path, 10, 1 << 20)
    other = sqlite3.connect(path, isolation_level=None)

    async def scenario() -> int:
        other.execute("BEGIN IMMEDIATE")
        put = asyncio.create_task(store.put(body("a", "waited"), [], None))
        ticks = 0
        while ticks < 20:  # the loop keeps turning while the put is blocked on the lock
            await asyncio.sleep(0.01)
            ticks += 1
        assert not put.done()
        other.execute("COMMIT")
        assert await asyncio.wait_for(put, 10)
        stored = await store.get("a")  # right after the put: there
        assert stored is not None and stored.body["text"] == "waited"
        return ticks

    assert run(scenario()) == 20
    other.close()
    store.close()


def test_writes_land_in_the_order_they_were_called(tmp_path: Path) -> None:
    store = ResponseStore(str(tmp_path / "r.sqlite"), 10, 1 << 20)

    async def scenario() -> str:
        puts = [asyncio.ensure_future(store.put(body("a", str(index)), [], None)) for index in range(50)]
        get = asyncio.ensure_future(store.get("a"))  # called after every put, awaited before any
        await asyncio.gather(*puts)
        stored = await get
        assert stored is not None
        return str(stored.body["text"])

    assert run(scenario()) == "49"
    store.close()


def test_a_cancelled_caller_still_records_its_write(tmp_path: Path) -> None:
    """A client that leaves cancels its request while the write of its end waits: the write lands."""
    path = str(tmp_path / "r.sqlite")
    store = ResponseStore(path, 10, 1 << 20)
    other = sqlite3.connect(path, isolation_level=None)

    async def scenario() -> None:
        other.execute("BEGIN IMMEDIATE")
        first = asyncio.create_task(store.put(body("a", "first"), [], None))
        queued = asyncio.create_task(store.put(body("b", "queued"), [], None))  # behind the first
        await asyncio.sleep(0)
        first.cancel()
        queued.cancel()
        other.execute("COMMIT")
        assert await store.get("b") is not None  # after both writes: both landed

    run(scenario())
    assert store.stats()[0] == 2
    other.close()
    store.close()


def test_close_lands_the_writes_called_before_it(tmp_path: Path) -> None:
    """As an API server shuts down: writes still on their way when the store closes are in the file."""
    path = str(tmp_path / "r.sqlite")
    store = ResponseStore(path, 10, 1 << 20)

    async def shut_down() -> None:
        puts = [asyncio.create_task(store.put(body(name), [], None)) for name in "abc"]
        await asyncio.sleep(0)  # each put has handed its write to the store's thread
        store.close()
        store.close()  # twice is once
        assert all(await asyncio.gather(*puts))

    run(shut_down())
    reopened = ResponseStore(path, 10, 1 << 20)
    assert reopened.stats() == (3, sum(len(json.dumps(body(name))) + len("[]") for name in "abc"))
    reopened.close()
