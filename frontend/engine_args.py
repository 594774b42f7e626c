"""EngineArgs: the user-facing knobs (CLI flags and LLM keyword arguments), turned into an EngineConfig."""

from __future__ import annotations

from dataclasses import dataclass, field

from frontend.model_files import DEFAULT_MODEL_NAME, default_cache_dir, resolve_model
from protocol.config import DEFAULT_BLOCK_SIZE, EngineConfig, WorkerConfig


@dataclass(frozen=True)
class EngineArgs:
    model: str | None = None  # HF folder or .gguf file; None: the bundled SmolLM2-135M-Instruct
    served_model_name: list[str] = field(default_factory=list)
    dtype: str = "auto"
    max_model_len: int | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_memory_bytes: int = 1 << 30
    num_kv_blocks: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    # Each step scheduled while the one before it runs (engine_core/engine_core.py).
    async_scheduling: bool = True
    seed: int = 0
    num_threads: int | None = None
    attention_backend: str = "auto"  # "auto", "torch" or "cpu"
    tokenizer_cache_dir: str | None = field(default_factory=default_cache_dir)
    startup_timeout_s: float = 600.0
    log_level: str = "info"
    log_format: str = "text"
    stats_log_interval_s: float = 10.0

    def __post_init__(self) -> None:
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}"
            )
        for name in ("max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def engine_config(self) -> EngineConfig:
        model = resolve_model(self.model)
        worker = WorkerConfig(
            model=model,
            dtype=self.dtype,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            num_kv_blocks=self.num_kv_blocks,
            max_num_seqs=self.max_num_seqs,
            # vLLM's default: the model as the user named it; the bundled model by its own name.
            served_model_names=self.served_model_name or [self.model or DEFAULT_MODEL_NAME],
            attention_backend=self.attention_backend,
            seed=self.seed,
            num_threads=self.num_threads,
            log_level=self.log_level,
            log_format=self.log_format,
        )
        return EngineConfig(
            worker=worker,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_prefix_caching=self.enable_prefix_caching,
            scheduling_policy=self.scheduling_policy,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            async_scheduling=self.async_scheduling,
            log_level=self.log_level,
            log_format=self.log_format,
            stats_log_interval_s=self.stats_log_interval_s,
        )
