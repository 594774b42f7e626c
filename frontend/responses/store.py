"""ResponseStore: the responses kept for GET, DELETE, cancel and previous_response_id.

One SQLite file per `engine serve` (the launcher makes it), so every API server of it sees every
response: a follow-up that lands on another process finds its previous response. Bounded by a count
and a size (the JSON bytes kept); the least recently used go first (vLLM's store never evicts). A
response on another host (an attached frontend has its own file) is a 404 that says where it is kept.

SQLite runs on a thread the store owns, never on the event loop: put, get and delete are coroutines
that wait for it, and that one thread runs them in the order they were called, so a response's writes
land in order and a get sees every write called before it (a door awaits a put before it sends what the
put recorded, so another API server's get sees it too).

Invariants: at most `max_count` rows and `max_bytes` bytes after every put (a single response larger
than max_bytes is not kept, and its put says so); `last_used` grows with every put and get.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    body TEXT NOT NULL,        -- the response object, as GET returns it
    history TEXT NOT NULL,     -- its input and output items: what a continuation starts from
    engine_request_id TEXT,    -- the engine request while it runs (a cancel aborts it)
    num_bytes INTEGER NOT NULL,
    last_used REAL NOT NULL
);
-- NOTE: eviction's count, sum and oldest row read this index, not the rows: in a full store (10,000
-- responses of 1.7 KB) a put took 12 ms scanning the rows, 0.5 ms with the index.
CREATE INDEX IF NOT EXISTS responses_by_last_used ON responses (last_used, num_bytes);
"""


@dataclass
class Stored:
    body: dict[str, Any]
    history: list[dict[str, Any]]
    engine_request_id: str | None


class ResponseStore:
    def __init__(self, path: str, max_count: int, max_bytes: int) -> None:
        self.max_count, self.max_bytes = max_count, max_bytes
        # NOTE: one connection per API server, used from the store's one thread only; SQLite's file
        # lock orders the servers' writes (a busy timeout, not an error, when two write at once).
        self._db = sqlite3.connect(path, timeout=10, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        # The file lives as long as its `engine serve`: a power cut may lose the last writes, never the
        # file's consistency (WAL), and a commit no longer waits for the disk.
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="response-store")
        self._closed = False

    @property
    def enabled(self) -> bool:
        return self.max_count > 0 and self.max_bytes > 0

    async def put(
        self, body: dict[str, Any], history: list[dict[str, Any]], engine_request_id: str | None
    ) -> bool:
        """Keep (or replace) a response; False when it alone is larger than the store."""
        text, history_text = json.dumps(body), json.dumps(history)  # as they are now, not when written
        return await self._run(self._put, body["id"], text, history_text, engine_request_id)

    async def get(self, response_id: str) -> Stored | None:
        return await self._run(self._get, response_id)

    async def delete(self, response_id: str) -> bool:
        return await self._run(self._delete, response_id)

    def stats(self) -> tuple[int, int]:
        """(count, bytes) kept now, once every write called before has landed."""
        return self._thread.submit(self._stats).result()

    def close(self) -> None:
        """Finish the writes called so far, then close the file and the thread."""
        if not self._closed:
            self._closed = True
            self._thread.submit(self._db.close)
            self._thread.shutdown(wait=True)

    async def _run(self, call: Callable[..., T], *args: Any) -> T:
        # NOTE: shielded: a request cancelled while its write waits (a client that left) still records
        # it; an unshielded wrap_future would take the write off the queue.
        return await asyncio.shield(asyncio.wrap_future(self._thread.submit(call, *args)))

    # On the store's thread only:

    def _put(self, response_id: str, text: str, history_text: str, engine_request_id: str | None) -> bool:
        num_bytes = len(text) + len(history_text)
        if num_bytes > self.max_bytes:
            self._delete(response_id)
            return False
        self._db.execute("BEGIN IMMEDIATE")
        try:
            self._db.execute(
                "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?)",
                (response_id, text, history_text, engine_request_id, num_bytes, time.time()),
            )
            self._evict()
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        return True

    def _get(self, response_id: str) -> Stored | None:
        row = self._db.execute(
            "SELECT body, history, engine_request_id FROM responses WHERE id = ?", (response_id,)
        ).fetchone()
        if row is None:
            return None
        self._db.execute("UPDATE responses SET last_used = ? WHERE id = ?", (time.time(), response_id))
        return Stored(json.loads(row[0]), json.loads(row[1]), row[2])

    def _delete(self, response_id: str) -> bool:
        return self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0

    def _stats(self) -> tuple[int, int]:
        count, num_bytes = self._db.execute(
            "SELECT COUNT(*), COALESCE(SUM(num_bytes), 0) FROM responses"
        ).fetchone()
        return int(count), int(num_bytes)

    def _evict(self) -> None:
        count, num_bytes = self._stats()
        while count > self.max_count or num_bytes > self.max_bytes:
            oldest = self._db.execute(
                "SELECT id, num_bytes FROM responses ORDER BY last_used LIMIT 1"
            ).fetchone()
            self._db.execute("DELETE FROM responses WHERE id = ?", (oldest[0],))
            count, num_bytes = count - 1, num_bytes - oldest[1]
