"""Builds and loads the csrc CPU kernels (torch C++ extension); None when no compiler is at hand.

`python -m worker.csrc_ops` builds ahead of time (`make install` runs it); otherwise the
first worker to need the kernels builds them (about a minute) into torch's extension cache.
"""

from __future__ import annotations

import hashlib
import logging
import pathlib
import sys
import time
from typing import TYPE_CHECKING, Protocol, cast

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("engine.worker")

CSRC = pathlib.Path(__file__).resolve().parents[1] / "csrc"
SOURCES = [
    CSRC / name
    for name in (
        "bindings.cpp",
        "paged_attention_cpu.cpp",
        "fused_cpu.cpp",
        "decoder_cpu.cpp",
        "gemm_cpu.cpp",
    )
]
# -fopenmp: at::parallel_for runs the whole range on the calling thread unless the extension itself is
# compiled with OpenMP (ATen's header-only invoke_parallel); libgomp resolves to the copy torch loaded.
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]


def headers_digest() -> str:
    """torch rebuilds a JIT extension when its sources or flags change, not its headers: the headers'
    digest goes into the flags."""
    digest = hashlib.sha1()
    for header in sorted(CSRC.glob("*.h")):
        digest.update(header.read_bytes())
    return digest.hexdigest()[:16]


class CpuOps(Protocol):
    """The extension module's functions (csrc/bindings.cpp; each contract at its definition, csrc/ops.h)."""

    def paged_decode_attention(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor: ...
    def prefill_tiles(self) -> str: ...
    def use_prefill_tiles(self, kind: str) -> str: ...
    def has_amx(self) -> bool: ...
    def pairs_available(self) -> bool: ...
    def pack_pairs(self, weight: torch.Tensor) -> torch.Tensor: ...
    def linear_pairs(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor) -> torch.Tensor: ...
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...
    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> None: ...
    def rotary_embedding(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
    ) -> None: ...
    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...
    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor: ...
    def parallel_threads(self) -> int: ...
    def decoder_layers(
        self,
        x: torch.Tensor,
        layers: list[list[torch.Tensor]],
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        slot_block_ids: torch.Tensor,
        slot_offsets: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        config: list[int],
        scalars: list[float],
        out_rows: torch.Tensor | None,
    ) -> list[torch.Tensor]: ...
    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        block_ids: torch.Tensor,
        offsets: torch.Tensor,
    ) -> None: ...


# A build takes about a minute; a lock file older than this was left by a build that was killed, and
# torch would wait on it forever (every worker of every later server hung in FileBaton.wait).
STALE_LOCK_S = 600.0


def remove_stale_build_lock(name: str) -> None:
    from torch.utils.cpp_extension import _get_build_directory

    lock = pathlib.Path(_get_build_directory(name, verbose=False)) / "lock"
    try:
        age_s = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age_s > STALE_LOCK_S:
        logger.warning("removing a stale csrc build lock (%s, %.0f s old)", lock, age_s)
        lock.unlink(missing_ok=True)


def load_cpu_ops(verbose: bool = False) -> CpuOps | None:
    if not all(source.exists() for source in SOURCES):
        logger.warning("csrc kernels not found in %s; using the torch paths", CSRC)
        return None
    try:
        from torch.utils.cpp_extension import load

        remove_stale_build_lock("engine_cpu_ops")

        module = load(
            name="engine_cpu_ops",
            sources=[str(source) for source in SOURCES],
            extra_cflags=[*FLAGS, f"-DENGINE_CSRC_HEADERS={headers_digest()}"],
            extra_ldflags=["-fopenmp"],
            extra_include_paths=[str(CSRC)],
            verbose=verbose,
        )
        return cast(CpuOps, module)  # the functions bindings.cpp defines; torch types it as a plain module
    except Exception as error:  # no compiler, missing headers: fall back, loudly
        logger.warning("could not build the csrc CPU kernels (%s); using the torch paths", error)
        return None


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    ops = load_cpu_ops(verbose="-v" in sys.argv)
    print("csrc CPU kernels:", "ready" if ops is not None else "unavailable (torch fallback)")
    sys.exit(0)
