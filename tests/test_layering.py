"""The import contract between the parts (STYLE.md, Layering), and the file-size cap."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
OURS = {"protocol", "engine_core", "worker", "frontend", "tests", "benchmarks", "deploy"}
# part -> top-level modules it must never import
FORBIDDEN = {
    "protocol": OURS - {"protocol"} | {"torch", "numpy", "zmq", "transformers"},
    "engine_core": {"torch", "worker", "frontend", "tests", "benchmarks", "transformers"},
    "frontend": {"worker", "engine_core", "tests", "benchmarks", "torch"},
    "worker": {"engine_core", "frontend", "tests", "benchmarks"},
}
MAX_LINES = 500
SIZE_EXCEPTIONS: dict[str, str] = {}  # path -> reason


def imported_modules(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("part", sorted(FORBIDDEN))
def test_layering(part: str) -> None:
    violations = []
    for path in sorted((ROOT / part).rglob("*.py")):
        bad = imported_modules(path) & FORBIDDEN[part]
        if bad:
            violations.append(f"{path.relative_to(ROOT)} imports {sorted(bad)}")
    assert not violations, "\n".join(violations)


def test_worker_model_code_knows_nothing_of_transport() -> None:
    for path in (ROOT / "worker" / "models").rglob("*.py"):
        assert not imported_modules(path) & {"zmq", "fastapi", "msgspec"}, path


def test_files_stay_small() -> None:
    too_big = []
    for part in ("protocol", "engine_core", "worker", "frontend"):
        for path in (ROOT / part).rglob("*.py"):
            relative = str(path.relative_to(ROOT))
            lines = len(path.read_text().splitlines())
            if lines > MAX_LINES and relative not in SIZE_EXCEPTIONS:
                too_big.append(f"{relative}: {lines} lines")
    assert not too_big, too_big


def test_no_pickle_between_processes() -> None:
    for part in ("protocol", "engine_core", "worker", "frontend"):
        for path in (ROOT / part).rglob("*.py"):
            assert not imported_modules(path) & {"pickle", "cloudpickle"}, path
