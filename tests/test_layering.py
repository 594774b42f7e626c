"""The import contract between the parts (STYLE.md, Layering) as an allowlist, no import cycles, the
benchmark harness outside the API server's import graph, and the file-size cap on every Python folder."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
STDLIB = set(sys.stdlib_module_names)
PYTHON_FOLDERS = (
    "protocol",
    "engine_core",
    "worker",
    "frontend",
    "structured_outputs",
    "tests",
    "benchmarks",
)

# part -> the top-level modules (beyond the standard library) it may import
ALLOWED = {
    "protocol": {"protocol", "msgspec"},
    # msgspec is the wire format protocol's structs are made of; zmq only where the process wrapper and
    # the executor own their sockets (see ZMQ_FILES)
    # ray: the optional executor (engine_core/ray_executor.py; the [ray] extra)
    "engine_core": {"engine_core", "protocol", "numpy", "msgspec", "zmq", "ray"},
    "worker": {
        "worker",
        "psutil",
        "protocol",
        "structured_outputs",
        "torch",
        "numpy",
        "msgspec",
        "zmq",
        "gguf",
        "safetensors",
        "tqdm",
    },
    # the grammar backends, shared by the frontend (validation) and the worker (matching); no torch
    "structured_outputs": {
        "structured_outputs",
        "protocol",
        "numpy",
        "msgspec",
        "llguidance",
        "transformers",
    },
    "frontend": {
        "frontend",
        "protocol",
        "structured_outputs",
        "msgspec",
        "zmq",
        "fastapi",
        "starlette",
        "pydantic",
        "uvicorn",
        "uvloop",
        "prometheus_client",
        "transformers",
        "tokenizers",
        "huggingface_hub",  # hub ids resolved through its cache (frontend/model_files.py)
        "numpy",  # pooled vectors: float32 bytes to arrays, base64, cosines (frontend/pooling/)
        "soundfile",  # audio: wav, flac, ogg (frontend/audio/)
        "av",  # audio: mp3, m4a, webm, mp4, and resampling (frontend/audio/)
        "websockets",  # the realtime WebSocket's client in tests and its server under uvicorn
        "PIL",  # images: decoding (frontend/vision/decode.py)
        "aiohttp",  # images: fetching http(s) URLs, imported on the first one (frontend/vision/fetch.py)
        "gguf",  # a render server's context length from a GGUF header (frontend/scale_out/render_server.py)
        "grpc",  # the gRPC front door (frontend/grpc_door/)
        "grpc_health",  # its grpc.health.v1 service
        "grpc_reflection",  # its server reflection
        "google",  # protobuf's runtime, which the generated stubs import
        "mcp",  # the Responses API's mcp tools: MCP's client (frontend/responses/mcp_client.py)
        "httpx2",  # the mcp SDK's HTTP client, which its transports take
        "anyio",  # the mcp SDK's timeouts (anyio.fail_after; Starlette runs on it too)
    },  # fmt: skip
}
# modules only the benchmark harness (frontend/bench/, the [bench] extra) may import
BENCH_ONLY = {"aiohttp", "httpx", "tqdm"}
# `engine run-batch` (frontend/batch/) draws its progress bar with tqdm, a core dependency; the API server
# never loads it (test_the_api_server_does_not_load_the_benchmark_harness)
BATCH_ONLY = {"tqdm"}
ZMQ_FILES = {
    "engine_core/process.py",
    "engine_core/executor.py",
    "worker/main.py",
    "worker/parallel/relay.py",
    "worker/kv_transfer_nixl.py",  # the NIXL connector's side channel (lookups and "done"s between workers)
}
# CUDA-only packages (the [cuda] extra), each imported by its one backend only, inside it (the CPU worker
# never loads them: tests/test_gpu_planning.py)
CUDA_ONLY_FILES = {"flashinfer": "worker/attention/flashinfer.py", "xformers": "worker/attention/xformers.py"}
# a KV connector's transfer engine, imported by its connector only, when --kv-transfer-config names it
CONNECTOR_FILES = {"nixl": "worker/kv_transfer_nixl.py"}
# what frontend/ must not reach into: the engine is a process, spoken to over protocol/
FRONTEND_FORBIDDEN_PREFIXES = ("engine_core", "worker")

MAX_LINES = 500
SIZE_EXCEPTIONS = {
    # one fixture (a real server) and the many behaviours it serves; splitting it would start more servers
    "tests/test_serve_e2e.py": "each end-to-end behaviour on one shared server, to keep `make test` short",
    "benchmarks/peers.py": "builds and drives three servers (ours, vLLM, llama.cpp) in one reproducible run",
}


def imports_of(path: pathlib.Path, source: str | None = None) -> list[tuple[str, int]]:
    """(absolute module name, line) of every import in the file, relative ones resolved."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    result = []
    for node in ast.walk(ast.parse(source if source is not None else path.read_text())):
        if isinstance(node, ast.Import):
            result += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            result.append((module, node.lineno))
    return result


def python_files(part: str) -> list[pathlib.Path]:
    return sorted((ROOT / part).rglob("*.py"))


@pytest.mark.parametrize("part", sorted(ALLOWED))
def test_each_part_imports_only_what_it_may(part: str) -> None:
    violations = []
    for path in python_files(part):
        relative = str(path.relative_to(ROOT))
        bench = relative.startswith("frontend/bench/")
        batch = relative.startswith("frontend/batch/")
        for module, line in imports_of(path):
            top = module.split(".")[0]
            allowed = ALLOWED[part] | (BENCH_ONLY if bench else set()) | (BATCH_ONLY if batch else set())
            if top in STDLIB or (
                top in allowed and (top != "zmq" or part == "frontend" or relative in ZMQ_FILES)
            ):
                continue
            if CUDA_ONLY_FILES.get(top) == relative or CONNECTOR_FILES.get(top) == relative:
                continue
            violations.append(f"{relative}:{line} imports {module}")
    assert not violations, "\n".join(violations)


def test_relative_imports_are_held_to_the_same_rule() -> None:
    path = ROOT / "frontend" / "server" / "admin.py"
    resolved = {m for m, _ in imports_of(path)}
    assert "frontend.openai.common" in resolved  # an absolute import, as written
    probe = ROOT / "frontend" / "server" / "probe.py"
    source = "from ..engine import client\nfrom . import errors\nfrom ...worker import sampler\n"
    assert {m for m, _ in imports_of(probe, source)} == {"frontend.engine", "frontend.server", "worker"}


def test_frontend_never_reaches_into_the_engine_or_the_worker() -> None:
    bad = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in python_files("frontend")
        for module, line in imports_of(path)
        if module.startswith(FRONTEND_FORBIDDEN_PREFIXES)
    ]
    assert not bad, bad


def test_worker_model_code_knows_nothing_of_transport() -> None:
    for path in (ROOT / "worker" / "models").rglob("*.py"):
        assert not {m.split(".")[0] for m, _ in imports_of(path)} & {"zmq", "fastapi", "msgspec"}, path


def test_nothing_imports_tests_benchmarks_or_deploy() -> None:
    for part in ("protocol", "engine_core", "worker", "frontend"):
        for path in python_files(part):
            tops = {m.split(".")[0] for m, _ in imports_of(path)}
            assert not tops & {"tests", "benchmarks", "deploy"}, path


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_import_cycles() -> None:
    """Between our modules, counting imports inside functions too (a lazy import is still a dependency)."""
    modules = {
        module_name(p): p
        for part in ("protocol", "engine_core", "worker", "frontend")
        for p in python_files(part)
    }
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for module, _ in imports_of(path):
            while module and module not in modules:  # `from frontend.x import name`: module frontend.x
                module = module.rpartition(".")[0]
            if module and module != name and not name.startswith(module + "."):
                targets.add(module)
        graph[name] = targets
    state: dict[str, int] = {}  # 1: on the path, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                cycles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, [*path, target])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_api_server_does_not_load_the_benchmark_harness() -> None:
    code = (
        "import sys, frontend.server.main, frontend.cli.main; "
        "bad = sorted(m for m in sys.modules if m.startswith('frontend.bench') or m.split('.')[0] in "
        "('aiohttp', 'httpx', 'torch', 'tqdm')); print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_launcher_starts_the_engine_before_loading_the_serving_stack() -> None:
    """`engine serve` parses its flags and starts the engine process before anything heavy is imported: the
    web framework, numpy and torch come with the API server and the worker, which start in parallel
    (docs/operations.md#startup)."""
    code = (
        "import sys, frontend.cli.main, frontend.launcher; "
        "bad = sorted({m.split('.')[0] for m in sys.modules} & {'fastapi', 'starlette', 'pydantic', 'numpy', "
        "'torch', 'transformers', 'tokenizers', 'uvicorn', 'PIL', 'gguf'}); print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_files_stay_small() -> None:
    too_big = []
    for part in PYTHON_FOLDERS:
        for path in python_files(part):
            relative = str(path.relative_to(ROOT))
            lines = len(path.read_text().splitlines())
            if lines > MAX_LINES and relative not in SIZE_EXCEPTIONS:
                too_big.append(f"{relative}: {lines} lines")
    assert not too_big, too_big
    for relative in SIZE_EXCEPTIONS:  # an exception that is no longer needed goes
        assert len((ROOT / relative).read_text().splitlines()) > MAX_LINES, f"{relative} fits now: drop it"


def test_no_pickle_between_processes() -> None:
    for part in ("protocol", "engine_core", "worker", "frontend"):
        for path in python_files(part):
            assert not {m.split(".")[0] for m, _ in imports_of(path)} & {"pickle", "cloudpickle"}, path
