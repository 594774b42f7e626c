"""`engine collect-env`: what a bug report needs to know of this machine and installation (as vLLM's
collect_env): engine and Python versions, the OS, the CPU and the ISA extensions the kernels use,
torch's version and build, whether the csrc kernels are built, and the key packages' versions.

torch is asked in a subprocess: the frontend never imports it (tests/test_layering.py), and the
API server's /server_info uses this module too.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from typing import Any

from protocol.version import __version__

PACKAGES = (
    "torch",
    "transformers",
    "tokenizers",
    "safetensors",
    "gguf",
    "huggingface_hub",
    "numpy",
    "fastapi",
    "starlette",
    "uvicorn",
    "uvloop",
    "pydantic",
    "msgspec",
    "pyzmq",
    "prometheus_client",
    "llguidance",
    "openai",
    "flashinfer-python",
    "xformers",
)
# the CPU flags that decide which kernels run (the csrc build and torch's CPU capability)
ISA_PREFIXES = ("avx", "amx", "fma", "f16c", "sse4", "bmi2", "neon", "asimd", "sve")

NOT_BUILT = (
    "not built for this CPU and these sources: a worker builds them at its start; where that fails it "
    "serves on the torch paths (slower, batch-variant; /health says so). `python -m worker.csrc_ops` builds them"
)
# Run in a subprocess (`python -c`): torch's build, and the csrc library this checkout built, if any.
TORCH_PROBE = """
import json, torch
info = {
    "version": torch.__version__,
    "cuda": torch.version.cuda,
    "cuda_available": torch.cuda.is_available(),
    "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    "num_threads": torch.get_num_threads(),
    "config": torch.__config__.show(),
}
try:
    from worker.csrc_ops import built_library
    library = built_library()
    info["csrc"] = str(library) if library is not None else None
except Exception as error:
    info["csrc"] = f"unknown ({type(error).__name__}: {error})"
print(json.dumps(info))
"""


def cpu_info(cpuinfo_path: str = "/proc/cpuinfo") -> dict[str, Any]:
    """The CPU's model name and its ISA extensions (Linux's /proc/cpuinfo: `flags` on x86, `Features` on
    Arm; elsewhere the model from platform and no flags)."""
    model: str | None = None
    flags: set[str] = set()
    try:
        with open(cpuinfo_path) as f:
            for line in f:
                key, _, value = (part.strip() for part in line.partition(":"))
                if key in ("model name", "Model") and model is None:
                    model = value
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    isa = sorted(flag for flag in flags if flag.startswith(ISA_PREFIXES))
    return {
        "model": model or platform.processor() or platform.machine(),
        "num_cpus": os.cpu_count(),
        "isa": isa,
    }


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def torch_info(timeout_s: float = 120.0) -> dict[str, Any]:
    try:
        result = subprocess.run(
            [sys.executable, "-c", TORCH_PROBE], capture_output=True, text=True, timeout=timeout_s
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return {"error": str(error)}
    if result.returncode != 0:
        lines = result.stderr.strip().splitlines()
        return {"error": lines[-1] if lines else f"exit code {result.returncode}"}
    return json.loads(result.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def collect() -> dict[str, Any]:
    return {
        "engine": __version__,
        "python": sys.version.split()[0],
        "python_executable": sys.executable,
        "os": platform.platform(),
        "cpu": cpu_info(),
        "torch": torch_info(),
        "packages": package_versions(),
        "environment": {k: v for k, v in sorted(os.environ.items()) if shown_variable(k)},
    }


def shown_variable(name: str) -> bool:
    """The variables that change our behaviour, never a secret (API keys, tokens)."""
    if any(word in name.upper() for word in ("KEY", "TOKEN", "SECRET", "PASSWORD")):
        return False
    return name.startswith(("ENGINE_", "VLLM_", "HF_", "CUDA_", "OMP_", "PROMETHEUS_")) or name in (
        "TRANSFORMERS_OFFLINE",
        "TORCH_HOME",
    )


def render(info: dict[str, Any]) -> str:
    """A plain-text report, one `key: value` a line, for pasting into an issue."""
    torch = info["torch"]
    lines = [
        f"engine: {info['engine']}",
        f"python: {info['python']} ({info['python_executable']})",
        f"os: {info['os']}",
        f"cpu: {info['cpu']['model']}, {info['cpu']['num_cpus']} logical CPUs",
        f"cpu isa: {' '.join(info['cpu']['isa']) or 'unknown'}",
    ]
    if "error" in torch:
        lines.append(f"torch: not importable ({torch['error']})")
    else:
        build = f"CUDA {torch['cuda']}" if torch["cuda"] else "CPU"
        lines += [
            f"torch: {torch['version']} ({build} build), CPU capability {torch['cpu_capability']}, "
            f"{torch['num_threads']} threads",
            f"cuda available: {torch['cuda_available']}{': ' + ', '.join(torch['devices']) if torch['devices'] else ''}",
            f"csrc kernels: {torch['csrc'] or NOT_BUILT}",
        ]
    lines.append("packages:")
    lines += [f"  {name}: {version or '-'}" for name, version in info["packages"].items()]
    lines.append("environment:")
    lines += [f"  {name}={value}" for name, value in info["environment"].items()] or ["  (none set)"]
    if "error" not in torch:
        lines += ["torch build config:", *("  " + line for line in torch["config"].strip().splitlines())]
    return "\n".join(lines)


def main(as_json: bool = False) -> int:
    info = collect()
    print(json.dumps(info, indent=2) if as_json else render(info))
    return 0
