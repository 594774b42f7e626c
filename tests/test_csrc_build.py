"""The csrc build: built once into a directory keyed by what it depends on, loaded without compiling,
and a worker without a build serves on the torch paths (a warning says how to build) instead of
compiling at serve time; a torch lock left by a killed build does not stop the next build."""

from __future__ import annotations

import logging
import pathlib
import sys

import pytest

from worker import csrc_ops


def copy_sources(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    for path in [*csrc_ops.SOURCES, *csrc_ops.CSRC.glob("*.h")]:
        (csrc / path.name).write_bytes(path.read_bytes())
    monkeypatch.setattr(csrc_ops, "CSRC", csrc)
    monkeypatch.setattr(csrc_ops, "SOURCES", [csrc / path.name for path in csrc_ops.SOURCES])
    monkeypatch.setattr(csrc_ops, "BUILD_ROOT", tmp_path / "build")
    return csrc


def test_the_build_key_follows_sources_headers_and_flags(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    csrc = copy_sources(tmp_path, monkeypatch)
    key = csrc_ops.build_key()
    assert key == csrc_ops.build_key()
    header = csrc / "cpu_math.h"
    header.write_bytes(header.read_bytes() + b"\n// edited\n")  # torch's own JIT cache misses this one
    edited = csrc_ops.build_key()
    assert edited != key
    monkeypatch.setattr(csrc_ops, "FLAGS", [*csrc_ops.FLAGS, "-DSOMETHING"])
    assert csrc_ops.build_key() not in (key, edited)
    monkeypatch.setattr(csrc_ops, "cpu_isa_flags", lambda: ["avx2"])  # another CPU
    assert len({csrc_ops.build_key(), key, edited}) == 3
    assert str(tmp_path) not in str(csrc_ops.build_dir().relative_to(tmp_path / "build"))


def test_without_a_build_the_worker_warns_and_never_compiles(
    tmp_path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    import torch.utils.cpp_extension

    copy_sources(tmp_path, monkeypatch)
    monkeypatch.delitem(sys.modules, csrc_ops.MODULE_NAME, raising=False)

    def compile_at_serve_time(*args: object, **kwargs: object) -> None:
        raise AssertionError("load_cpu_ops compiled")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", compile_at_serve_time)
    with caplog.at_level(logging.WARNING, logger="engine.worker"):
        assert csrc_ops.load_cpu_ops() is None
    assert "python -m worker.csrc_ops" in caplog.text and "torch paths" in caplog.text

    from worker.attention import get_attention_backend
    from worker.attention.torch_ref import TorchAttentionBackend

    assert isinstance(get_attention_backend("auto"), TorchAttentionBackend)
    with pytest.raises(RuntimeError, match="csrc kernels"):
        get_attention_backend("cpu")


def test_a_lock_left_by_a_killed_build_is_removed(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    import torch.utils.cpp_extension

    copy_sources(tmp_path, monkeypatch)
    directory = csrc_ops.build_dir()
    directory.mkdir(parents=True)
    (directory / "lock").touch()  # torch's FileBaton: every later build would wait on it forever
    builds: list[str] = []

    def fake_compiler(name: str, build_directory: str, **kwargs: object) -> None:
        assert not (pathlib.Path(build_directory) / "lock").exists()
        (pathlib.Path(build_directory) / f"{name}.so").touch()
        builds.append(build_directory)

    monkeypatch.setattr(torch.utils.cpp_extension, "load", fake_compiler)
    library = csrc_ops.build_cpu_ops()
    assert library == directory / f"{csrc_ops.MODULE_NAME}.so" and library.exists()
    assert csrc_ops.build_cpu_ops() == library  # built already: no second compile
    assert builds == [str(directory)]


def test_this_checkout_has_a_build_for_this_cpu() -> None:
    """make install (and the suite's start, tests/conftest.py) build the kernels; the serve tests use them."""
    import shutil

    if not (shutil.which("c++") or shutil.which("g++")):
        pytest.skip("no C++ compiler: the torch paths serve")
    assert csrc_ops.built_library() is not None
    assert csrc_ops.load_cpu_ops() is not None
