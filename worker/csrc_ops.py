"""Builds and loads the csrc CPU kernels (torch C++ extension); None when no compiler is at hand.

`python -m worker.csrc_ops` builds ahead of time (`make install` runs it); otherwise the
first worker to need the kernels builds them (about a minute) into torch's extension cache.
"""

from __future__ import annotations

import hashlib
import logging
import pathlib
import sys
from typing import Any

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


def load_cpu_ops(verbose: bool = False) -> Any | None:
    if not all(source.exists() for source in SOURCES):
        logger.warning("csrc kernels not found in %s; using the torch paths", CSRC)
        return None
    try:
        from torch.utils.cpp_extension import load

        return load(
            name="engine_cpu_ops",
            sources=[str(source) for source in SOURCES],
            extra_cflags=[*FLAGS, f"-DENGINE_CSRC_HEADERS={headers_digest()}"],
            extra_ldflags=["-fopenmp"],
            extra_include_paths=[str(CSRC)],
            verbose=verbose,
        )
    except Exception as error:  # no compiler, missing headers: fall back, loudly
        logger.warning("could not build the csrc CPU kernels (%s); using the torch paths", error)
        return None


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    ops = load_cpu_ops(verbose="-v" in sys.argv)
    print("csrc CPU kernels:", "ready" if ops is not None else "unavailable (torch fallback)")
    sys.exit(0)
