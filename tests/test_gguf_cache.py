"""The GGUF conversion kept on disk (worker/gguf_cache.py): written by the first load, read back by the
next without parsing the file (6 s of a start for SmolLM2), the same config and weights, bit for bit; a
changed file gets a new entry."""

from __future__ import annotations

import os
import pathlib

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
