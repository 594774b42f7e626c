"""The csrc build step: a lock left by a killed build is removed (torch would wait on it forever), a
fresh one (a build running now) is left alone."""

from __future__ import annotations

import os
import pathlib
import time

import pytest

from worker.csrc_ops import STALE_LOCK_S, remove_stale_build_lock


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = pathlib.Path(tmp_path) / "some_ops" / "lock"
    lock.parent.mkdir()
    lock.touch()
    remove_stale_build_lock("some_ops")
    assert lock.exists()  # a build may be running
    old = time.time() - STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    remove_stale_build_lock("some_ops")
    assert not lock.exists()
    remove_stale_build_lock("some_ops")  # no lock: nothing to do
