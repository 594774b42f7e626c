"""Which attention backend a CUDA worker runs, and why when it is not the one asked for.

FlashInfer (the default) takes head sizes 64, 128 and 256 in fp16 and bf16 (flashinfer-python 0.7.4:
no float32 kernels; another head size is not refused there, and gives wrong results or a fault, so we
refuse it here); xformers' memory-efficient attention serves prefill for any of those dtypes up to head
size 256; torch's SDPA over the same paged cache serves anything, float32 included (the oracle). Asked
for by name and unable to serve: a start error; "auto": the first that can, with a log line saying why
the others could not.
"""

from __future__ import annotations

FLASHINFER_HEAD_DIMS = (64, 128, 256)
HALF = ("float16", "bfloat16")


def why_not(backend: str, head_dim: int, dtype: str, installed: set[str], nvcc: bool = True) -> str | None:
    """None if `backend` can serve this head size and dtype on CUDA, else the reason it cannot. nvcc:
    whether the CUDA compiler is here (FlashInfer 0.7.4 compiles its kernels at first use)."""
    if backend == "torch":
        return None
    if backend not in installed:
        return f"{backend} is not installed (pip install '.[cuda]')"
    if backend == "flashinfer" and not nvcc:
        return "FlashInfer compiles its kernels at first use and finds no nvcc (CUDA_HOME, PATH, /usr/local/cuda)"
    if backend == "flashinfer":
        if dtype not in HALF:
            return f"FlashInfer has no {dtype} kernels (fp16 and bf16 only)"
        if head_dim not in FLASHINFER_HEAD_DIMS:
            return f"FlashInfer takes head sizes {FLASHINFER_HEAD_DIMS}, not {head_dim}"
        return None
    if backend == "xformers":
        if head_dim > 256:
            return f"xformers takes head sizes up to 256, not {head_dim}"
        return None
    return f"{backend!r} is not a CUDA attention backend (flashinfer, xformers, torch)"


def choose_cuda_backend(
    requested: str, head_dim: int, dtype: str, installed: set[str], nvcc: bool = True
) -> tuple[str, list[str]]:
    """(the backend, the reasons the ones before it in the order could not serve); ValueError when the one
    asked for by name cannot."""
    if requested != "auto":
        reason = why_not(requested, head_dim, dtype, installed, nvcc)
        if reason is not None:
            raise ValueError(f"--attention-backend {requested}: {reason}")
        return requested, []
    reasons: list[str] = []
    for backend in ("flashinfer", "xformers", "torch"):
        reason = why_not(backend, head_dim, dtype, installed, nvcc)
        if reason is None:
            return backend, reasons
        reasons.append(reason)
    raise AssertionError("torch serves every shape")  # unreachable: why_not("torch") is None
