"""A worker without the csrc kernels: it serves on the torch paths and says so (/health's detail, the
model info), and the default turns batch invariance off there; asking for it explicitly is a startup
error (at the CLI for --attention-backend torch: tests/test_cli_errors.py), never a warning."""

from __future__ import annotations

import httpx
import pytest

from protocol.config import WorkerConfig
from tests.serve_helpers import Served, serving
from tests.test_correctness_tiny import build_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = str(tmp_path_factory.mktemp("tiny-torch-paths"))
    build_tiny("llama", folder)
    return folder


def test_the_worker_says_it_serves_without_kernels(tiny: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from worker import csrc_ops
    from worker.model_runner import NO_KERNELS, ModelRunner

    monkeypatch.setattr(csrc_ops, "load_cpu_ops", lambda build=False: None)  # as where the build failed
    runner = ModelRunner(WorkerConfig(model=tiny, dtype="float32", num_kv_blocks=16))
    info = runner.model_info()
    assert info.notices == [NO_KERNELS] and not info.batch_invariant
    with pytest.raises(ValueError, match="--batch-invariant needs the csrc CPU kernels.*did not build"):
        ModelRunner(WorkerConfig(model=tiny, dtype="float32", num_kv_blocks=16, batch_invariant=True))


def test_with_the_kernels_the_default_is_batch_invariant(tiny: str) -> None:
    from worker.csrc_ops import load_cpu_ops
    from worker.model_runner import ModelRunner

    if load_cpu_ops() is None:
        pytest.skip("no C++ compiler: the csrc kernels did not build (the torch path serves instead)")
    info = ModelRunner(WorkerConfig(model=tiny, dtype="bfloat16", num_kv_blocks=16)).model_info()
    assert info.batch_invariant and info.notices == []
    variant = ModelRunner(WorkerConfig(model=tiny, num_kv_blocks=16, batch_invariant=False)).model_info()
    assert not variant.batch_invariant and variant.notices == []


@pytest.mark.slow
def test_health_names_the_torch_paths(tiny: str, smollm2_server: Served) -> None:
    with serving(
        tiny, "--attention-backend", "torch", "--dtype", "float32", "--num-kv-blocks", "64"
    ) as served:
        health = httpx.get(f"{served.base}/health", timeout=10)
        assert health.status_code == 200
        assert health.json()["status"] == "ok"
        assert "without the csrc CPU kernels" in health.json()["detail"]
        done = httpx.post(
            f"{served.base}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3}, timeout=60
        )
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 3
    plain = httpx.get(f"{smollm2_server.base}/health", timeout=10)  # with the kernels: vLLM's empty 200
    assert plain.status_code == 200 and plain.content == b""
