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


def worker_device(config: Any, pooling: bool) -> Any:
    """The torch.device this worker runs on, its options checked. auto keeps the CPU worker for what only it
    serves (pooling, LoRA); a CUDA worker's GPU is its place among this machine's workers (every local
    engine's ranks, in order)."""
    import logging

    import torch

    name = config.device
    if name == "auto" and torch.cuda.is_available() and (pooling or config.lora is not None):
        logging.getLogger("engine.worker").info(
            "--device auto: the CPU worker (pooling and LoRA run there so far)"
        )
        name = "cpu"
    device = resolve_device(name, torch.cuda.is_available())
    check_device_options(config, device, pooling)
    if device == "cpu":
        return torch.device("cpu")
    parallel = config.parallel
    local_rank = config.rank - parallel.node_rank * parallel.ranks_per_node
    index = (parallel.engine_index * parallel.ranks_per_node + local_rank) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def cuda_dtype(name: str, checkpoint_dtype: str) -> Any:
    """--dtype on CUDA: auto serves a half-precision checkpoint in its own dtype and a float32 one in bf16, as
    vLLM does; an explicit dtype stands."""
    import torch

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name != "auto":
        return dtypes[name]
    checkpoint = checkpoint_dtype.removeprefix("torch.")
    return dtypes[checkpoint] if checkpoint in ("bfloat16", "float16") else torch.bfloat16
