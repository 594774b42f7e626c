"""The csrc build: built once into a directory keyed by what it depends on; a worker that finds no build
for this CPU builds one before serving, with a line before and after, and serves on the torch paths
only where the build fails (a warning says how to build); a torch lock left by a killed build does not
stop the next build; the wheel carries the sources."""

from __future__ import annotations

import logging
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

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


def test_a_build_removes_this_machines_oldest_builds(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """Past KEEP_BUILDS of this machine the oldest go; other machines' builds, and one being built (its
    flock held), stay."""
    import fcntl

    monkeypatch.setattr(csrc_ops, "BUILD_ROOT", tmp_path)
    machine = csrc_ops._machine()
    builds = []
    for i in range(7):
        build = tmp_path / f"build{i}"
        build.mkdir()
        (build / csrc_ops.MACHINE_FILE).write_text(machine if i != 1 else "another CPU")
        (build / f"{csrc_ops.MODULE_NAME}.so").write_bytes(b"x")
        os.utime(build / csrc_ops.MACHINE_FILE, (1000 + i, 1000 + i))
        builds.append(build)
    with open(builds[2] / "build.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        csrc_ops._prune_builds(builds[6])
    kept = sorted(path.name for path in tmp_path.iterdir())
    # this machine's newest four (6, 5, 4, 3), the other machine's, the one being built
    assert kept == ["build1", "build2", "build3", "build4", "build5", "build6"]
    csrc_ops._prune_builds(builds[6])  # its build done
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "build1",
        "build3",
        "build4",
        "build5",
        "build6",
    ]


def test_without_a_build_a_worker_builds_first_and_serves_on_torch_only_if_that_fails(
    tmp_path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    import torch.utils.cpp_extension

    copy_sources(tmp_path, monkeypatch)
    monkeypatch.delitem(sys.modules, csrc_ops.MODULE_NAME, raising=False)
    builds: list[str] = []

    def failing_compiler(name: str, build_directory: str, **kwargs: object) -> None:
        builds.append(build_directory)
        raise RuntimeError("Error building extension 'engine_cpu_ops': no compiler here")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", failing_compiler)
    with caplog.at_level(logging.INFO, logger="engine.worker"):
        assert csrc_ops.load_cpu_ops() is None  # a plain load (tools, tests) never compiles
        assert builds == []
        from worker.attention import get_attention_backend
        from worker.attention.torch_ref import TorchAttentionBackend

        assert isinstance(get_attention_backend("auto"), TorchAttentionBackend)  # a worker's start
    assert builds == [str(csrc_ops.build_dir())]
    assert "building the csrc CPU kernels for this CPU before serving" in caplog.text
    assert "did not build (Error building extension" in caplog.text
    assert "python -m worker.csrc_ops" in caplog.text and "torch paths" in caplog.text
    with pytest.raises(RuntimeError, match="csrc kernels"):
        get_attention_backend("cpu")


def test_a_first_start_builds_the_kernels_and_serves_on_them() -> None:
    """A real build for a key with no build yet (a checkout after `pip install -e .` alone, or moved to
    another CPU): the worker's start builds it, says so and how long it took, and gets the kernels. The
    objects of this machine's build seed it, so that the test links rather than compiles."""
    if not (shutil.which("c++") or shutil.which("g++")) or csrc_ops.built_library() is None:
        pytest.skip("no C++ compiler: the torch paths serve")
    key = f"first-start-{os.getpid()}"
    script = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='%(message)s')\n"
        "from worker import csrc_ops\n"
        f"csrc_ops.build_key = lambda: {key!r}\n"
        "assert csrc_ops.built_library() is None\n"
        "from worker.attention import get_attention_backend\n"
        "print(type(get_attention_backend('auto')).__name__)\n"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=400, check=False
        )
        assert done.returncode == 0, done.stderr
        assert "building the csrc CPU kernels for this CPU before serving" in done.stdout
        assert "built the csrc CPU kernels in" in done.stdout
        assert done.stdout.strip().splitlines()[-1] == "CpuAttentionBackend"
    finally:
        shutil.rmtree(csrc_ops.BUILD_ROOT / key, ignore_errors=True)


def test_the_wheel_carries_the_kernel_sources(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`pip install .` (not only a checkout) has the sources a first start builds from."""
    root = tmp_path / "source"  # a copy: setuptools builds in the tree's build/, beside our kernels' builds
    ignore = shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__", ".*_cache", "results")
    shutil.copytree(csrc_ops.CSRC.parent, root, ignore=ignore)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(root),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = tmp_path.glob("engine-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in [*csrc_ops.SOURCES, *csrc_ops.CSRC.glob("*.h")]:
        assert f"csrc/{path.name}" in names


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
