"""Builds the csrc CPU kernels (a torch C++ extension) once, and loads the build; None when there is none.

`python -m worker.csrc_ops` builds them (`make install` runs it) into build/csrc/<key>/ beside the
package's sources in a checkout (the engine's cache folder in an installed wheel), where key digests
what the build depends on: the sources and headers, the flags, the torch and Python versions and this
CPU's instruction sets (`-march=native` makes a build for the CPU it ran on). Every install has the
sources (the wheel ships csrc/). A worker that finds no build for this CPU builds one before it
serves, saying so on a progress line (`load_cpu_ops(build=True)`): `pip install -e .` alone, or a
checkout moved to another kind of CPU, serves on the kernels from its first start. A build runs under
an flock, so a start killed during it leaves nothing that hangs the next one. Builds for other CPUs stay
beside it, so a checkout that moves between machines keeps one for each; of this machine's, a build
keeps the newest KEEP_BUILDS (older sources and versions).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import pathlib
import platform
import shutil
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
        "gemm_rows_cpu.cpp",
        "gemm_amx_cpu.cpp",
        "lora_cpu.cpp",
        "moe_cpu.cpp",
        "moe_loop_cpu.cpp",
        "route_cpu.cpp",
        "quant_cpu.cpp",
        "quant_w8a8.cpp",
        "quant_a8.cpp",
        "gguf_pack_cpu.cpp",
        "encoder_attention_cpu.cpp",
    )
]
# -fopenmp: at::parallel_for runs the whole range on the calling thread unless the extension itself is
# compiled with OpenMP (ATen's header-only invoke_parallel); libgomp resolves to the copy torch loaded.
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]


class CpuOps(Protocol):
    """The extension module's functions (csrc/bindings.cpp; each contract at its definition, csrc/ops.h)."""

    def paged_decode_attention(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        window: int,
        softcap: float,
        sinks: torch.Tensor,
    ) -> torch.Tensor: ...
    def prefill_tiles(self) -> str: ...
    def use_prefill_tiles(self, kind: str) -> str: ...
    def has_amx(self) -> bool: ...
    def pairs_available(self) -> bool: ...
    def pack_pairs(self, weight: torch.Tensor) -> torch.Tensor: ...
    def linear_pairs(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor) -> torch.Tensor: ...
    def linear_amx(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor) -> torch.Tensor: ...
    def pack_rows(self, weight: torch.Tensor) -> torch.Tensor: ...
    def linear_rows(
        self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor, out_features: int
    ) -> torch.Tensor: ...
    def quant_type_supported(self, qtype: int) -> bool: ...
    def linear_quant(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        qtype: int,
        bias: torch.Tensor,
        out_features: int,
        amx: bool = True,
    ) -> torch.Tensor: ...
    def pack_gguf(self, raw: torch.Tensor, qtype: int, n: int, k: int) -> torch.Tensor: ...
    def linear_quant_parts(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        parts: torch.Tensor,
        bias: torch.Tensor,
        out_features: int,
    ) -> torch.Tensor: ...
    def linear_w8a8_parts(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        parts: torch.Tensor,
        bias: torch.Tensor,
        out_features: int,
    ) -> torch.Tensor: ...
    def linear_quant_a8(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        qtype: int,
        bias: torch.Tensor,
        out_features: int,
        reference: bool = False,
    ) -> torch.Tensor: ...
    def quant_rows(
        self, packed: torch.Tensor, qtype: int, ids: torch.Tensor, in_features: int, dtype: torch.dtype
    ) -> torch.Tensor: ...
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...
    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> None: ...
    def rotary_embedding(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        interleaved: bool,
    ) -> None: ...
    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...
    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...
    def lora_add(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        a: torch.Tensor,
        bt: torch.Tensor,
        row_slots: torch.Tensor,
        bounds: torch.Tensor,
        ranks: torch.Tensor,
    ) -> None: ...
    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor: ...
    def gather_columns(self, x: torch.Tensor, order: torch.Tensor) -> torch.Tensor: ...
    def encoder_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        segments: torch.Tensor,
        heads: int,
        scale: float,
    ) -> torch.Tensor: ...
    def route_experts(
        self,
        logits: torch.Tensor,
        kind: int,
        top_k: int,
        renormalize: bool,
        scaling: float,
        score_bias: torch.Tensor,
        groups: int,
        top_groups: int,
    ) -> list[torch.Tensor]: ...
    def fused_experts(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        b13: torch.Tensor,
        b2: torch.Tensor,
        activation: int,
        alpha: float,
        limit: float,
        shared: torch.Tensor,
        shared_gate: torch.Tensor,
    ) -> torch.Tensor: ...
    def expert_loop(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        b13: torch.Tensor,
        b2: torch.Tensor,
        activation: int,
        alpha: float,
        limit: float,
        shared: torch.Tensor,
        shared_gate: torch.Tensor,
        lora: list[torch.Tensor] | None,
        orders: list[torch.Tensor] | None,
    ) -> torch.Tensor: ...
    def parallel_threads(self) -> int: ...
    def decoder_layers(
        self,
        x: torch.Tensor,
        layers: list[list[torch.Tensor]],
        ropes: list[torch.Tensor],
        kv_caches: list[torch.Tensor],
        pools: list[torch.Tensor],
        config: list[int],
        layer_kinds: list[int],
        scalars: list[float],
        out_rows: torch.Tensor | None,
        lora_layers: list[list[torch.Tensor]] | None,
        lora_meta: list[torch.Tensor] | None,
    ) -> list[torch.Tensor]: ...
    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        block_ids: torch.Tensor,
        offsets: torch.Tensor,
    ) -> None: ...


def build_root() -> pathlib.Path:
    """build/csrc beside the sources in a checkout; the engine's cache folder in an installed wheel,
    whose site-packages may not be writable."""
    if (CSRC.parent / "pyproject.toml").exists():
        return CSRC.parent / "build" / "csrc"
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(cache) / "engine" / "csrc"


BUILD_ROOT = build_root()
MODULE_NAME = "engine_cpu_ops"
# The instruction-set flags of /proc/cpuinfo a -march=native build depends on.
ISA_FLAG_PREFIXES = ("sse", "ssse", "avx", "amx", "fma", "f16c", "bmi", "vnni", "gfni", "vaes", "vpclmul")


def cpu_isa_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return []
    return sorted(flag for flag in line.partition(":")[2].split() if flag.startswith(ISA_FLAG_PREFIXES))


def a8_vector_form() -> str | None:
    """The int8 rows' vector form this CPU builds: "AVX-512 VNNI" (csrc/quant_a8_run.h, with VBMI), "AVX2"
    (csrc/quant_a8_avx2.h, with FMA and F16C), or None, where `--activation-quantization int8` runs the
    portable loop."""
    flags = set(cpu_isa_flags())
    if {"avx512_vnni", "avx512vbmi"} <= flags:
        return "AVX-512 VNNI"
    return "AVX2" if {"avx2", "fma", "f16c"} <= flags else None


def build_key() -> str:
    """A digest of everything a build depends on. NOTE: torch rebuilds a JIT extension when its sources
    or flags change, not its headers, and keys its cache by the sources' paths: this key has the
    headers' bytes and no path."""
    import torch

    digest = hashlib.sha1()
    for path in [*SOURCES, *sorted(CSRC.glob("*.h"))]:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    for part in (*FLAGS, torch.__version__, sys.version, platform.machine(), *cpu_isa_flags()):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def build_dir() -> pathlib.Path:
    return BUILD_ROOT / build_key()


def built_library() -> pathlib.Path | None:
    library = build_dir() / f"{MODULE_NAME}.so"
    return library if library.exists() else None


def build_cpu_ops(verbose: bool = False) -> pathlib.Path:
    """Compiles the kernels into build_dir() unless built there already; returns the library's path.

    One build at a time per directory, under an flock (the kernel drops it when its holder dies, so it
    is never stale); torch's own lock file, when one is found under the flock, was left by a killed build.
    """
    from torch.utils.cpp_extension import load

    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "build.flock", "w") as flock:
        fcntl.flock(flock, fcntl.LOCK_EX)
        library = directory / f"{MODULE_NAME}.so"
        if library.exists():
            return library
        _seed_from_sibling(directory)
        stale = directory / "lock"
        if stale.exists():
            logger.warning("removing the lock of a build that was killed (%s)", stale)
            stale.unlink()
        load(
            name=MODULE_NAME,
            sources=[str(source) for source in SOURCES],
            extra_cflags=FLAGS,
            extra_ldflags=["-fopenmp"],
            extra_include_paths=[str(CSRC)],
            build_directory=str(directory),
            verbose=verbose,
        )
        (directory / MACHINE_FILE).write_text(_machine())
    _prune_builds(directory)
    return library


MACHINE_FILE = "machine.txt"
# Builds of one machine kept: a checkout's last few source versions (one edited back relinks at most).
KEEP_BUILDS = 4


def _machine() -> str:
    """What makes objects of identical sources and flags differ: this CPU (-march=native), torch, Python."""
    import torch

    return "\n".join([torch.__version__, sys.version, platform.machine(), *cpu_isa_flags()])


def _seed_from_sibling(directory: pathlib.Path) -> None:
    """Start from the newest build of this machine (same CPU, torch and Python) with its objects and ninja's
    records, so that ninja recompiles only the sources that changed (an edit of one kernel: one file
    instead of a 3-minute build of all of them)."""
    machine = _machine()
    siblings = [
        path.parent
        for path in BUILD_ROOT.glob(f"*/{MACHINE_FILE}")
        if path.parent != directory and path.read_text() == machine
    ]
    if not siblings or any(directory.glob("*.o")):
        return
    newest = max(siblings, key=lambda path: (path / MACHINE_FILE).stat().st_mtime)
    for path in newest.iterdir():
        if path.suffix == ".o" or path.name in (".ninja_deps", ".ninja_log"):
            shutil.copy2(path, directory / path.name)


def _prune_builds(directory: pathlib.Path) -> None:
    """Removes this machine's builds beyond the KEEP_BUILDS newest, never `directory`: every source edit and
    every upgrade makes one of ~12 MB (a checkout had collected 63, 731 MB). A build whose flock another
    process holds (building now) stays; one a running process has loaded stays mapped in it."""
    machine = _machine()
    builds = []
    for record in BUILD_ROOT.glob(f"*/{MACHINE_FILE}"):
        try:
            if record.read_text() == machine:
                builds.append((record.stat().st_mtime, record.parent))
        except OSError:  # removed meanwhile
            continue
    builds.sort(reverse=True)
    for _, old in builds[KEEP_BUILDS:]:
        if old == directory:
            continue
        with open(old / "build.flock", "w") as flock:
            try:
                fcntl.flock(flock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            shutil.rmtree(old, ignore_errors=True)


def loaded_cpu_ops() -> CpuOps | None:
    """The kernels if this process has loaded them already (no build lookup, no warning)."""
    module = sys.modules.get(MODULE_NAME)
    return cast(CpuOps, module) if module is not None else None


def load_cpu_ops(build: bool = False) -> CpuOps | None:
    """The built kernels, or None (and a warning naming the fix) where this checkout and CPU have none.
    build: compile them first where there is no build for this CPU (a worker's start), with a line
    before and after; a failed build (no compiler) leaves None and the reason in the warning."""
    if MODULE_NAME in sys.modules:
        return cast(CpuOps, sys.modules[MODULE_NAME])
    if not all(source.exists() for source in SOURCES):
        logger.warning("csrc kernels not found in %s; serving on the torch paths", CSRC)
        return None
    library = built_library()
    if library is None and build:
        library = build_before_serving()
    if library is None:
        logger.warning(
            "the csrc kernels are not built for these sources and this CPU (%s); serving on the torch "
            "paths. Build them with `python -m worker.csrc_ops` (make install does).",
            build_dir(),
        )
        return None
    import torch  # noqa: F401 (the library links against torch's, loaded first)

    spec = importlib.util.spec_from_file_location(MODULE_NAME, library)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[MODULE_NAME] = module
    return cast(CpuOps, module)  # the functions bindings.cpp defines; typed as a plain module


def build_before_serving() -> pathlib.Path | None:
    """A worker's first start on this CPU: build the kernels now, with a progress line; None if it fails."""
    logger.info(
        "building the csrc CPU kernels for this CPU before serving (once per CPU and source; a few minutes "
        "on 2 cores; `python -m worker.csrc_ops` builds them ahead) into %s",
        build_dir(),
    )
    started = time.monotonic()
    try:
        library = build_cpu_ops()
    except Exception as error:  # noqa: BLE001 (no compiler, missing headers: the torch paths serve)
        logger.warning("the csrc kernels did not build (%s)", str(error).splitlines()[0])
        return None
    logger.info("built the csrc CPU kernels in %.0f s", time.monotonic() - started)
    return library


def main() -> int:
    """Builds the kernels for this CPU; a failed build (no compiler) leaves the torch paths, and says so."""
    logging.basicConfig(level=logging.INFO)
    try:
        library = build_cpu_ops(verbose="-v" in sys.argv)
    except Exception as error:  # noqa: BLE001 (no compiler, missing headers: the torch paths serve)
        print(f"csrc CPU kernels: not built ({error}); workers serve on the torch paths")
        return 0
    print(f"csrc CPU kernels: built in {library.parent}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
