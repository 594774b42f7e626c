"""The engine and its model runner in one process (no HTTP, no worker process), for the in-process
benchmarks: SmolLM2 by default, 64-token blocks, 1,024-token context."""

from __future__ import annotations

from typing import Any

from engine_core.engine_core import EngineCore
from frontend.model_files import resolve_model
from protocol.config import DEFAULT_BLOCK_SIZE, EngineConfig, WorkerConfig
from worker.executor import InprocExecutor


def inprocess_engine(model: str | None, dtype: str, num_kv_blocks: int, **engine: Any) -> EngineCore:
    worker = WorkerConfig(
        model=resolve_model(model),
        dtype=dtype,
        block_size=DEFAULT_BLOCK_SIZE,
        num_kv_blocks=num_kv_blocks,
        max_model_len=1024,
    )
    return EngineCore(EngineConfig(worker=worker, **engine), InprocExecutor(worker))
