"""The GGUF conversion kept on disk (worker/gguf_cache.py): written by the first load, read back by the
next without parsing the file (6 s of a start for SmolLM2), the same config and weights, bit for bit; a
changed file gets a new entry, which removes the old one."""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import pytest
import torch

from worker import gguf_cache

pytestmark = pytest.mark.slow


def test_the_conversion_is_kept_and_read_back_without_the_file(
    smollm2_gguf: str, tmp_path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    config, weights = gguf_cache.load_model_files(smollm2_gguf, str(tmp_path))
    converted = dict(weights)
    entries = list((tmp_path / "gguf").iterdir())
    assert len(entries) == 1 and (entries[0] / gguf_cache.WEIGHTS_FILE).exists()

    def no_parse(path: str) -> None:
        raise AssertionError("the GGUF file was parsed again")

    monkeypatch.setattr(gguf_cache, "open_gguf", no_parse)
    again, weights_again = gguf_cache.load_model_files(smollm2_gguf, str(tmp_path))
    assert again == config
    read_back = dict(weights_again)
    assert read_back.keys() == converted.keys()
    assert all(torch.equal(read_back[name], converted[name]) for name in converted)


def test_a_changed_file_gets_a_new_entry(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model = pathlib.Path(tmp_path) / "m.gguf"
    model.write_bytes(b"x" * 100)
    first = gguf_cache._entry_path(str(model), str(tmp_path))
    assert gguf_cache._entry_path(str(model), str(tmp_path)) == first
    assert gguf_cache._entry_path(str(model), str(tmp_path), packed=True) != first  # the blocks kept: its own
    os.utime(model, ns=(1, 1))
    assert gguf_cache._entry_path(str(model), str(tmp_path)) != first


def test_a_new_entry_removes_the_same_files_older_ones(smollm2_gguf: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A reinstalled file (a new modification time) is converted again; the entry of its earlier version goes,
    while entries of other files, and entries that do not say their file, stay."""
    model = tmp_path / "model.gguf"
    shutil.copyfile(smollm2_gguf, model)
    cache = tmp_path / "cache"
    dict(gguf_cache.load_model_files(str(model), str(cache))[1])
    (first,) = (cache / "gguf").iterdir()
    other = cache / "gguf" / "other"
    other.mkdir()
    (other / gguf_cache.SOURCE_FILE).write_text(json.dumps({"model": "/elsewhere/x.gguf", "packed": False}))
    unmarked = cache / "gguf" / "unmarked"
    unmarked.mkdir()
    os.utime(model, ns=(10**18, 10**18))
    dict(gguf_cache.load_model_files(str(model), str(cache))[1])
    left = {entry.name for entry in (cache / "gguf").iterdir()}
    assert first.name not in left and {"other", "unmarked"} < left and len(left) == 3
