"""deploy/Dockerfile.cpu, built and run: the image serves the default model, answers /health and a
completion, and stops cleanly on SIGTERM.

No Docker engine runs on these machines; podman builds and runs images without one. Where no registry answers
for the Dockerfile's base (python:3.11-slim), the base is made here from Debian's packages (debootstrap) with
a venv on PATH. Where podman's own OCI runtime is refused by the sandbox, tests/podman_sandbox_runtime.sh
serves. Pip inside the build sees what this machine's pip sees (its config, local wheels and CA bundle),
so torch comes from the CPU build on disk. The test skips, naming what is missing, where the machine
cannot build (no podman: `apt-get install podman debootstrap`). Long tier: the build takes minutes.
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from typing import NamedTuple

import httpx
import pytest

from tests.serve_helpers import free_port, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.long]

REPO = pathlib.Path(__file__).resolve().parent.parent
RUNTIME_SCRIPT = REPO / "tests" / "podman_sandbox_runtime.sh"
SANDBOX_REFUSALS = ("setrlimit", "cgroups in hybrid mode")  # what such a sandbox answers podman's runtime
LOCAL_WHEELS = "/opt/wheels"  # where these machines keep the CPU torch build
# what this machine's pip reads, mounted into the build where present
PIP_PATHS = (
    "/etc/pip.conf", "/etc/xdg/pip", LOCAL_WHEELS, "/opt/pypi", "/opt/pypi-more",
    "/etc/ssl/certs/ca-certificates.crt",
)  # fmt: skip


class Runtime(NamedTuple):
    """podman's global flags (the OCI runtime) and the flags each `podman run` adds."""

    flags: list[str]
    run_flags: list[str]


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, check=check)


@pytest.fixture(scope="module")
def system_image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, bool]]:
    """(image, whether it needs a venv): the Dockerfile's base where a registry serves it, else Debian's
    Python 3.11 from its packages."""
    if shutil.which("podman") is None:
        pytest.skip(
            "podman is not installed (no Docker engine runs here; `apt-get install podman debootstrap`)"
        )
    if podman("pull", "-q", "docker.io/library/python:3.11-slim", timeout=120, check=False).returncode == 0:
        yield "docker.io/library/python:3.11-slim", False
        return
    if shutil.which("debootstrap") is None:
        pytest.skip(
            "no registry serves python:3.11-slim here, and debootstrap is not installed to make a base"
        )
    rootfs = tmp_path_factory.mktemp("rootfs")
    packages = (
        "python3,python3-dev,python3-venv,python3-pip,g++,make,ca-certificates"  # (-dev: the kernels build)
    )
    subprocess.run(
        ["debootstrap", "--variant=minbase", f"--include={packages}", "bookworm", str(rootfs),
         "http://deb.debian.org/debian"],
        check=True, capture_output=True, timeout=900,
    )  # fmt: skip
    tag = f"localhost/engine-debian:{uuid.uuid4().hex[:8]}"
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    subprocess.run(
        ["podman", "import", "-", tag], stdin=tar.stdout, check=True, capture_output=True, timeout=600
    )
    tar.wait()
    shutil.rmtree(rootfs, ignore_errors=True)
    try:
        yield tag, True
    finally:
        podman("rmi", "-f", tag, check=False)


@pytest.fixture(scope="module")
def runtime(system_image: tuple[str, bool], tmp_path_factory: pytest.TempPathFactory) -> Runtime:
    """An OCI runtime that runs here: podman's own, or the sandbox's (RUNTIME_SCRIPT)."""
    probe = ("run", "--rm", "--network", "host")
    command = (system_image[0], "python3", "-c", "pass")
    run = podman(*probe, *command, check=False)
    if run.returncode == 0:
        return Runtime([], [])
    if not any(refusal in run.stderr for refusal in SANDBOX_REFUSALS):
        pytest.skip(f"podman cannot run a container here: {run.stderr.strip()[-300:]}")
    folder = tmp_path_factory.mktemp("runtime")
    shutil.copy(RUNTIME_SCRIPT, folder / "crun")  # (podman knows crun's abilities by its name)
    flags = ["--runtime", str(folder / "crun"), "--cgroup-manager", "cgroupfs"]
    sandbox = Runtime(flags, ["--cgroups", "disabled"])
    run = podman(*sandbox.flags, *probe, *sandbox.run_flags, *command, check=False)
    if run.returncode != 0:
        pytest.skip(
            f"podman cannot run a container here, even without rlimits and cgroups: {run.stderr[-300:]}"
        )
    return sandbox


@pytest.fixture(scope="module")
def base_image(
    system_image: tuple[str, bool], runtime: Runtime, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """An image with Python 3.11 and pip on PATH: the system image, or it with a venv."""
    system, needs_venv = system_image
    if not needs_venv:
        yield system
        return
    tag = f"localhost/engine-base:{uuid.uuid4().hex[:8]}"
    recipe = tmp_path_factory.mktemp("base")
    (recipe / "Containerfile").write_text(
        f"FROM {system}\nRUN python3 -m venv /opt/venv\nENV PATH=/opt/venv/bin:$PATH\n"
    )
    try:
        podman(*runtime.flags, "build", "-q", "--network", "host", "-t", tag, str(recipe), timeout=600)
        yield tag
    finally:
        podman("rmi", "-f", tag, check=False)


@pytest.fixture(scope="module")
def image(runtime: Runtime, base_image: str) -> Iterator[str]:
    tag = f"localhost/engine-cpu:{uuid.uuid4().hex[:8]}"
    mounts = [
        flag for path in PIP_PATHS if pathlib.Path(path).exists() for flag in ("-v", f"{path}:{path}:ro")
    ]
    local_torch = any(pathlib.Path(LOCAL_WHEELS).glob("torch-2.13.0*.whl"))
    build = podman(
        *runtime.flags, "build", "--network", "host", *mounts, "--build-arg", f"BASE={base_image}",
        *(["--build-arg", f"TORCH_PIP_ARGS=--find-links {LOCAL_WHEELS}"] if local_torch else []),
        "-f", str(REPO / "deploy" / "Dockerfile.cpu"), "-t", tag, str(REPO),
        timeout=1800, check=False,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    try:
        yield tag
    finally:
        podman("rmi", "-f", tag, check=False)


def test_the_cpu_image_holds_the_cpu_torch_and_our_kernels(runtime: Runtime, image: str) -> None:
    """Not a CUDA build of torch (2.7 GB of NVIDIA libraries in a CPU image), and the csrc kernels built."""
    check = (
        "import torch; from worker.csrc_ops import load_cpu_ops; "
        "print(torch.version.cuda, load_cpu_ops() is not None)"
    )
    run = podman(
        *runtime.flags,
        "run",
        "--rm",
        *runtime.run_flags,
        "--entrypoint",
        "python",
        image,
        "-c",
        check,
        timeout=600,
    )
    assert run.stdout.split()[-2:] == ["None", "True"], run.stdout[-2000:] + run.stderr[-2000:]


def test_the_cpu_image_serves_the_default_model(runtime: Runtime, image: str) -> None:
    port, name = free_port(), f"engine-test-{uuid.uuid4().hex[:8]}"
    podman(*runtime.flags, "run", "-d", "--name", name, "--network", "host", *runtime.run_flags, image,
           "--port", str(port))  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:

        def healthy() -> bool:
            try:
                return httpx.get(f"{base}/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                running = podman("inspect", "-f", "{{.State.Running}}", name, check=False).stdout.strip()
                assert running == "true", podman("logs", name, check=False).stderr[-3000:]
                return False

        wait_until(healthy, 300, "the container's /health")
        answer = httpx.post(
            f"{base}/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 8}, timeout=60
        )
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"], answer.text
        podman("stop", "-t", "60", name, timeout=120)  # SIGTERM (the image's STOPSIGNAL): a drain
        code = podman("inspect", "-f", "{{.State.ExitCode}}", name).stdout.strip()
        assert code == "0", podman("logs", name, check=False).stderr[-3000:]
    finally:
        podman("rm", "-f", name, check=False)
