"""ResponseStore: bounded by count and bytes with least-recently-used eviction, and one file shared by
every connection (every API server of an `engine serve`)."""

from __future__ import annotations

from pathlib import Path

from frontend.responses.store import ResponseStore


def body(response_id: str, text: str = "") -> dict[str, str]:
    return {"id": response_id, "status": "completed", "text": text}


def test_count_bound_evicts_the_least_recently_used(tmp_path: Path) -> None:
    store = ResponseStore(str(tmp_path / "r.sqlite"), max_count=3, max_bytes=1 << 20)
    for name in "abc":
        assert store.put(body(name), [{"role": "user", "content": name}], None)
    assert store.get("a") is not None  # a is now the most recently used
    store.put(body("d"), [], None)
    assert store.get("b") is None and {n for n in "acd" if store.get(n)} == set("acd")
    assert store.stats()[0] == 3


def test_byte_bound_and_a_response_too_large(tmp_path: Path) -> None:
    store = ResponseStore(str(tmp_path / "r.sqlite"), max_count=100, max_bytes=400)
    for index in range(6):
        store.put(body(f"r{index}", "x" * 50), [], None)
        assert store.stats()[1] <= 400
    assert store.get("r0") is None and store.get("r5") is not None
    assert not store.put(body("huge", "x" * 1000), [], None) and store.get("huge") is None


def test_every_connection_sees_one_store(tmp_path: Path) -> None:
    path = str(tmp_path / "r.sqlite")
    first, second = ResponseStore(path, 10, 1 << 20), ResponseStore(path, 10, 1 << 20)
    first.put(body("shared", "hello"), [{"type": "message"}], "resp-1-0")
    stored = second.get("shared")
    assert stored is not None and stored.body["text"] == "hello" and stored.engine_request_id == "resp-1-0"
    assert second.delete("shared") and first.get("shared") is None and not first.delete("shared")
    first.close()
    second.close()
