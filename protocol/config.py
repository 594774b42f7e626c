"""Configuration that crosses process boundaries: the launcher builds it, the engine and workers read it."""

from __future__ import annotations

import os

import msgspec

from protocol.kv_transfer import KVTransferConfig
from protocol.lora import LoraAdapter, LoraConfig
from protocol.pooling import PoolerConfig
from protocol.weight_transfer import WeightTransferConfig

# Tokens per KV block. Decode attention reads each block's rows in one sweep and then jumps to the next
# block, wherever the pool put it; with 64-token blocks a batch-64 decode step took 2.7% less than with
# 16 (benchmarks/results/2026-11-29-lab-notes-performance.md, "Huge pages and 64-token blocks"). vLLM's CPU
# default is 128; 64 measured the same
# and keeps the prefix cache's granularity finer.
DEFAULT_BLOCK_SIZE = 64


def default_cache_dir() -> str:
    """Where conversions of GGUF files (tokenizers, weights) are kept unless --cache-dir says otherwise."""
    return os.path.join(os.path.expanduser("~"), ".cache", "engine")


class ParallelConfig(msgspec.Struct, kw_only=True, frozen=True):
    """How the workers of one engine split the model (docs/parallel.md)."""

    tensor_parallel_size: int = 1  # worker ranks, one per device, joined by torch.distributed
    nnodes: int = 1  # machines the ranks span; each starts tensor_parallel_size / nnodes of them
    node_rank: int = 0  # this machine's index (0: the one that runs the engine)
    master_addr: str = "127.0.0.1"  # where rank 0 listens for the others (torch.distributed's store)
    master_port: int = 0  # 0: a free port, picked by the engine's executor (one machine only)
    timeout_s: float = 120.0  # a collective (or a rank's answer) that takes longer fails the engine
    startup_timeout_s: float = 600.0  # how long the ranks wait for each other to join and to load
    executor_backend: str = "mp"  # "mp": processes started here; "ray": Ray actors
    engines_per_node: int = 1  # data-parallel engines on this machine: they and their ranks share its cores
    engine_index: int = 0  # this engine's place among them (CUDA: which GPUs its ranks take)

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    @property
    def workers_per_node(self) -> int:
        """Worker processes on this machine, every engine's ranks together."""
        return self.ranks_per_node * self.engines_per_node

    @property
    def local_ranks(self) -> range:
        """The ranks this machine starts."""
        first = self.node_rank * self.ranks_per_node
        return range(first, first + self.ranks_per_node)


class WorkerConfig(msgspec.Struct, kw_only=True):
    """Everything a worker needs to load the model and size its KV cache."""

    model: str  # HF folder or .gguf file
    dtype: str = "auto"  # "auto", "float32", "bfloat16", "float16"
    quantization: str | None = None  # --quantization: None, the checkpoint's; "none" dequantizes at load
    # --activation-quantization: "int8" multiplies packed weights by each row quantized to int8 per 32 dims
    # (csrc/quant_a8.cpp); None: the rows as they are
    activation_quantization: str | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    max_model_len: int | None = None  # None: from the model config
    kv_cache_memory_bytes: int = 1 << 30  # KV pool size when num_kv_blocks is None
    num_kv_blocks: int | None = None  # override the pool size in blocks
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048  # the step budget (CUDA: the profiling pass that sizes the KV cache)
    served_model_names: list[str] = []
    attention_backend: str = "auto"  # "auto", "torch" or "cpu"
    seed: int = 0  # seeds the generator of unseeded requests
    num_threads: int | None = None  # torch intra-op threads; None: torch's default
    # decode steps of up to 8 rows: "auto" runs each batch size on every core or one fewer, whichever measures
    # faster while serving (worker/step_threads.py); "all": every core; None: auto where the threads are the
    # worker's to choose (no --num-threads, one worker on the machine, the CPU)
    decode_threads: str | None = None
    log_level: str = "info"
    log_format: str = "text"  # or "json"
    structured_outputs_backend: str = "auto"  # grammar engine: "auto" or "guidance" (llguidance)
    grammar_compile_timeout_s: float = 30.0  # a request whose grammar is not ready by then fails
    cache_dir: str | None = None  # where conversions of GGUF files are kept (tokenizer, weights)
    # each row's results independent of the batch (docs/batch-invariance.md); None: where the csrc kernels
    # are built (True without them is a startup error)
    batch_invariant: bool | None = None
    tokenizer: str | None = None  # a tokenizer folder other than the model's (--tokenizer), for grammars
    runner: str = "auto"  # "generate", "pooling" or "auto" (worker/pooling.py)
    convert: str = "auto"  # a pooling runner's conversion: "embed", "classify" or "auto"
    pooler_config: PoolerConfig | None = None  # overrides of the model's pooling
    lora: LoraConfig | None = None  # LoRA's slots and limits (--enable-lora); None: no adapters
    parallel: ParallelConfig = msgspec.field(default_factory=lambda: ParallelConfig())
    device: str = "auto"  # "auto" (CUDA where torch sees a GPU), "cpu" or "cuda"
    gpu_memory_utilization: float | None = None  # CUDA: the device's share for this worker (None: 0.9)
    enforce_eager: bool = False  # CUDA: no CUDA graphs
    max_cudagraph_capture_size: int | None = None  # CUDA: the largest decode batch captured (None: vLLM's)
    rank: int = 0  # this worker's tensor-parallel rank (set by whoever starts it)
    kv_transfer: KVTransferConfig | None = None  # --kv-transfer-config: disaggregated prefill and decode
    weight_transfer: WeightTransferConfig | None = None  # --weight-transfer-config: RL weight updates


class EngineConfig(msgspec.Struct, kw_only=True):
    """The EngineCore's configuration, passed to its process as JSON."""

    worker: WorkerConfig
    max_num_seqs: int = 128  # requests running at once
    max_num_batched_tokens: int = 2048  # token budget of one step
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"  # or "priority"
    long_prefill_token_threshold: int = 0  # >0: cap each prefill chunk (chunked prefill below the budget)
    decode_prefill_token_budget: int = 0  # >0: a step's prefill tokens while requests decode
    decode_prefill_tokens_per_decode: int = 0  # >0: that share grows to this many per decoding request
    decode_prefill_tokens_per_request: int = 0  # >0: and to this many per request held (running, waiting)
    async_scheduling: bool = True  # schedule step N+1 while step N runs (EngineArgs and the CLI agree)
    input_address: str = ""  # ZMQ address the engine binds for frontend requests
    output_address: str = ""  # ZMQ address the engine binds for outputs
    executor: str = "mp"  # "mp": one worker process per device; "inproc": the model in the engine process
    log_level: str = "info"
    log_format: str = "text"  # or "json"
    stats_log_interval_s: float = 10.0  # the periodic one-line engine summary; 0 turns it off
    lora_modules: list[LoraAdapter] = []  # adapters loaded at start (--lora-modules); needs worker.lora
    profiler_dir: str | None = None  # where POST /start_profile's traces go (--profiler-dir); None: off
    data_parallel_rank: int = 0  # this engine's index among the deployment's engines
    data_parallel_addresses: list[list[str]] = []  # every engine's [input, output] ([]: the only one); an
    # engine on another machine is ["", ""] here until it announces itself to engine 0
    data_parallel_head: str = ""  # an engine on another machine than engine 0: engine 0's input address
    refusal_path: str = ""  # where a start refused for the user's settings or model writes why (exit code 2)
