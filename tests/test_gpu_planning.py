"""The GPU worker's decisions that need no GPU: the device, the CUDA-graph sizes and padding, the KV cache's
size from the device's memory, the attention backend and its fallbacks, the CUDA-only flags refused on the
CPU, and no CUDA-only package imported by the CPU worker."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

from frontend.config.engine_args import EngineArgs
from worker.gpu.backends import choose_cuda_backend
from worker.gpu.device import resolve_device
from worker.gpu.graphs import capture_sizes, padded_size
from worker.gpu.memory import GpuMemoryError, bytes_per_block, plan_kv_cache

GIB = 1 << 30


def test_device() -> None:
    assert resolve_device("auto", cuda_available=False) == "cpu"
    assert resolve_device("auto", cuda_available=True) == "cuda"
    with pytest.raises(ValueError, match="torch sees no GPU"):
        resolve_device("cuda", cuda_available=False)


def test_capture_sizes_follow_vllm_s_list() -> None:
    assert capture_sizes(128) == [1, 2, 4, *range(8, 129, 8)]
    assert capture_sizes(300)[-6:] == [240, 248, 256, 272, 288, 300]  # by 16 past 256, and the largest
    assert capture_sizes(1024)[-1] == 512  # vLLM's bound
    assert capture_sizes(128, max_capture_size=20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(128, max_capture_size=0) == []


def test_a_decode_batch_pads_to_the_next_captured_size() -> None:
    sizes = capture_sizes(64)
    assert [padded_size(n, sizes) for n in (1, 3, 5, 8, 9, 63, 64)] == [1, 4, 8, 8, 16, 64, 64]
    assert padded_size(65, sizes) is None  # eager
    assert padded_size(1, []) is None


def test_kv_cache_gets_what_the_model_and_a_step_leave() -> None:
    per_block = bytes_per_block(block_size=16, num_kv_heads=8, head_dim=128, num_layers=32, itemsize=2)
    assert per_block == 2 * 16 * 8 * 128 * 32 * 2  # 2 MiB: Llama-3-8B's shape in bf16
    plan = plan_kv_cache(
        total_bytes=80 * GIB, utilization=0.9, used_bytes=18 * GIB, bytes_per_block=per_block
    )
    assert plan.kv_bytes == int(80 * GIB * 0.9) - 18 * GIB
    assert plan.num_blocks == plan.kv_bytes // per_block
    assert "KV cache 54.00 GiB" in plan.describe()
    with pytest.raises(GpuMemoryError, match="raise --gpu-memory-utilization"):
        plan_kv_cache(total_bytes=16 * GIB, utilization=0.5, used_bytes=8 * GIB, bytes_per_block=per_block)


def test_backend_choice_and_its_fallbacks() -> None:
    both = {"flashinfer", "xformers"}
    assert choose_cuda_backend("auto", 128, "bfloat16", both) == ("flashinfer", [])
    backend, reasons = choose_cuda_backend("auto", 128, "float32", both)  # the float32 GPU check
    assert backend == "xformers" and "no float32 kernels" in reasons[0]
    backend, reasons = choose_cuda_backend("auto", 96, "float16", both)
    assert backend == "xformers" and "not 96" in reasons[0]
    backend, reasons = choose_cuda_backend("auto", 64, "bfloat16", set())
    assert backend == "torch" and all("not installed" in reason for reason in reasons)
    assert choose_cuda_backend("torch", 80, "float32", set()) == ("torch", [])
    backend, reasons = choose_cuda_backend("auto", 128, "bfloat16", both, nvcc=False)
    assert backend == "xformers" and "finds no nvcc" in reasons[0]
    with pytest.raises(ValueError, match="--attention-backend flashinfer: FlashInfer takes head sizes"):
        choose_cuda_backend("flashinfer", 80, "bfloat16", both)


def test_cuda_only_flags_are_refused_on_the_cpu_device() -> None:
    for flag, options in (
        ("--gpu-memory-utilization", dict(gpu_memory_utilization=0.8)),
        ("--enforce-eager", dict(enforce_eager=True)),
        ("--attention-backend", dict(attention_backend="flashinfer")),
    ):
        with pytest.raises(ValueError, match=flag):
            EngineArgs(device="cpu", **options)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--gpu-memory-utilization"):
        EngineArgs(gpu_memory_utilization=1.5)


def test_the_cpu_worker_imports_no_cuda_only_package() -> None:
    code = (
        "import sys, worker.main, worker.model_runner, worker.attention, worker.gpu.backends, "
        "worker.attention.flashinfer, worker.attention.xformers; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('flashinfer', 'xformers', 'triton')))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_which_cuda_workers_capture_graphs(caplog: pytest.LogCaptureFixture) -> None:
    from types import SimpleNamespace

    from protocol.config import WorkerConfig
    from worker.gpu.device import check_device_options
    from worker.gpu.graph_runner import decode_graph_sizes

    flashinfer, xformers = SimpleNamespace(name="flashinfer"), SimpleNamespace(name="xformers")
    for config in (
        WorkerConfig(model="m", max_cudagraph_capture_size=64),
        WorkerConfig(model="m", enforce_eager=True),
    ):
        check_device_options(config, "cuda", pooling=False)  # both taken on CUDA
    config = WorkerConfig(model="m", max_num_seqs=64)
    assert decode_graph_sizes(config, flashinfer, 1) == capture_sizes(64)
    bounded = WorkerConfig(model="m", max_num_seqs=64, max_cudagraph_capture_size=20)
    assert decode_graph_sizes(bounded, flashinfer, 1) == [1, 2, 4, 8, 16, 20]
    with caplog.at_level(logging.INFO, logger="engine.worker"):
        for off, backend, ranks in (
            (WorkerConfig(model="m", enforce_eager=True), flashinfer, 1),
            (WorkerConfig(model="m", max_cudagraph_capture_size=0), flashinfer, 1),
            (config, xformers, 1),
            (config, flashinfer, 2),
        ):
            assert decode_graph_sizes(off, backend, ranks) == []
    reasons = [record.getMessage() for record in caplog.records if "CUDA graphs off" in record.getMessage()]
    assert len(reasons) == 4, reasons
    assert "--enforce-eager" in reasons[0] and "xformers" in reasons[2] and "NCCL" in reasons[3]


def test_a_padded_decode_plan_keeps_the_rows_and_parks_the_padding_in_the_scratch_block() -> None:
    from worker.attention.flashinfer_meta import decode_plan, empty_plan, pad_decode_plan

    plan = decode_plan(torch.tensor([[7, 2, 0], [5, 0, 0]]), torch.tensor([6, 4]), page_size=4)
    padded = pad_decode_plan(plan, 4, scratch_block=9)
    assert padded.kv_indptr.tolist() == [0, 2, 3, 4, 5]
    assert padded.kv_indices.tolist() == [7, 2, 5, 9, 9]
    assert padded.kv_last_page_len.tolist() == [2, 4, 1, 1]
    assert {padded.kv_indptr.dtype, padded.kv_indices.dtype, padded.kv_last_page_len.dtype} == {torch.int32}
    assert pad_decode_plan(plan, 2, 9).kv_indices.tolist() == [7, 2, 5]  # a full batch: unchanged
    alone = pad_decode_plan(empty_plan(), 3, 9)
    assert (alone.kv_indptr.tolist(), alone.kv_indices.tolist()) == ([0, 1, 2, 3], [9, 9, 9])
    with pytest.raises(ValueError, match="does not fit"):
        pad_decode_plan(plan, 1, 9)
