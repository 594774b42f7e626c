"""The worker's device: --device auto|cpu|cuda (auto: CUDA where torch sees a GPU)."""

from __future__ import annotations

from typing import Any

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(name: str, cuda_available: bool) -> str:
    """ "cpu" or "cuda"; ValueError for a CUDA device torch cannot see."""
    if name not in DEVICES:
        raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got {name!r}")
    if name == "auto":
        return "cuda" if cuda_available else "cpu"
    if name == "cuda" and not cuda_available:
        raise ValueError(
            "--device cuda: torch sees no GPU (a CPU build of torch, or no driver); install the CUDA build "
            "(pip install '.[cuda]' beside a CUDA torch) or serve with --device cpu"
        )
    return name


class DeviceError(ValueError):
    """Settings the resolved device cannot serve (refused at start, in one line)."""


def check_device_options(config: Any, device: str, pooling: bool) -> None:
    """CUDA-only options on the CPU worker, and what the CUDA worker does not run yet, refused by name."""
    if device == "cpu":
        cuda_only = [
            flag
            for flag, given in (
                ("--gpu-memory-utilization", config.gpu_memory_utilization is not None),
                ("--enforce-eager", config.enforce_eager),
                ("--max-cudagraph-capture-size", config.max_cudagraph_capture_size is not None),
                ("--attention-backend", config.attention_backend in ("flashinfer", "xformers")),
            )
            if given
        ]
        if cuda_only:
            raise DeviceError(f"{cuda_only[0]} applies to the CUDA worker, and this worker runs on the CPU")
        return
    if config.attention_backend == "cpu":
        raise DeviceError(
            "--attention-backend cpu: the csrc kernels are the CPU worker's; on CUDA: auto, flashinfer, xformers, torch"
        )
    if config.batch_invariant:
        raise DeviceError("--batch-invariant: the CUDA worker has no batch-invariant kernels yet")
    if pooling:
        raise DeviceError("pooling models run on the CPU worker so far (--device cpu)")
    if config.lora is not None:
        raise DeviceError("--enable-lora: LoRA runs on the CPU worker so far (--device cpu)")
