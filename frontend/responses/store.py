"""ResponseStore: the responses kept for GET, DELETE, cancel and previous_response_id.

One SQLite file per `engine serve` (the launcher makes it), so every API server of it sees every
response: a follow-up that lands on another process finds its previous response. Bounded by a count
and a size (the JSON bytes kept); the least recently used go first (vLLM's store never evicts). A
response on another host (an attached frontend has its own file) is a 404 that says where it is kept.

Invariants: at most `max_count` rows and `max_bytes` bytes after every put (a single response larger
than max_bytes is not kept, and its put says so); `last_used` grows with every put and get.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    body TEXT NOT NULL,        -- the response object, as GET returns it
    history TEXT NOT NULL,     -- its input and output items: what a continuation starts from
    engine_request_id TEXT,    -- the engine request while it runs (a cancel aborts it)
    num_bytes INTEGER NOT NULL,
    last_used REAL NOT NULL
)
"""


@dataclass
class Stored:
    body: dict[str, Any]
    history: list[dict[str, Any]]
    engine_request_id: str | None


class ResponseStore:
    def __init__(self, path: str, max_count: int, max_bytes: int) -> None:
        self.max_count, self.max_bytes = max_count, max_bytes
        # NOTE: one connection per API server, used from its event loop's thread only; SQLite's file
        # lock orders the servers' writes (a busy timeout, not an error, when two write at once).
        self._db = sqlite3.connect(path, timeout=10, isolation_level=None, check_same_thread=False)
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(SCHEMA)

    @property
    def enabled(self) -> bool:
        return self.max_count > 0 and self.max_bytes > 0

    def put(self, body: dict[str, Any], history: list[dict[str, Any]], engine_request_id: str | None) -> bool:
        """Keep (or replace) a response; False when it alone is larger than the store."""
        text, history_text = json.dumps(body), json.dumps(history)
        num_bytes = len(text) + len(history_text)
        if num_bytes > self.max_bytes:
            self.delete(body["id"])
            return False
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute(
                    "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?)",
                    (body["id"], text, history_text, engine_request_id, num_bytes, time.time()),
                )
                self._evict()
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return True

    def get(self, response_id: str) -> Stored | None:
        with self._lock:
            row = self._db.execute(
                "SELECT body, history, engine_request_id FROM responses WHERE id = ?", (response_id,)
            ).fetchone()
            if row is None:
                return None
            self._db.execute("UPDATE responses SET last_used = ? WHERE id = ?", (time.time(), response_id))
        return Stored(json.loads(row[0]), json.loads(row[1]), row[2])

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0

    def stats(self) -> tuple[int, int]:
        """(count, bytes) kept now."""
        with self._lock:
            count, num_bytes = self._db.execute(
                "SELECT COUNT(*), COALESCE(SUM(num_bytes), 0) FROM responses"
            ).fetchone()
        return int(count), int(num_bytes)

    def _evict(self) -> None:
        count, num_bytes = self._db.execute(
            "SELECT COUNT(*), COALESCE(SUM(num_bytes), 0) FROM responses"
        ).fetchone()
        while count > self.max_count or num_bytes > self.max_bytes:
            oldest = self._db.execute(
                "SELECT id, num_bytes FROM responses ORDER BY last_used LIMIT 1"
            ).fetchone()
            self._db.execute("DELETE FROM responses WHERE id = ?", (oldest[0],))
            count, num_bytes = count - 1, num_bytes - oldest[1]

    def close(self) -> None:
        with self._lock:
            self._db.close()
