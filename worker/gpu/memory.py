"""The KV cache's size on a GPU, from the device's memory (--gpu-memory-utilization), as vLLM sizes it.

After the weights load, a profiling forward pass at --max-num-batched-tokens measures the peak memory a
step needs; the KV cache gets what is left of utilization x total:

    kv_bytes = total x utilization - (weights + the profile's peak activations + what others hold)

Invariants: the result is never negative (a model that leaves nothing is a start error naming the
numbers), and the block count fits the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass


class GpuMemoryError(ValueError):
    """The model and one step's activations leave no room for a KV cache under the utilization."""


@dataclass(frozen=True)
class MemoryPlan:
    total_bytes: int  # the device's memory
    utilization: float  # the share this worker may use
    used_bytes: int  # at the profile's peak: weights, activations, and any other process's
    bytes_per_block: int  # one KV block over every layer, keys and values

    @property
    def kv_bytes(self) -> int:
        return int(self.total_bytes * self.utilization) - self.used_bytes

    @property
    def num_blocks(self) -> int:
        return self.kv_bytes // self.bytes_per_block

    def describe(self) -> str:
        gib = 1 << 30
        return (
            f"GPU memory: {self.total_bytes / gib:.2f} GiB x {self.utilization:.2f} utilization = "
            f"{self.total_bytes * self.utilization / gib:.2f} GiB; in use at the profile's peak "
            f"{self.used_bytes / gib:.2f} GiB; KV cache {max(self.kv_bytes, 0) / gib:.2f} GiB = "
            f"{max(self.num_blocks, 0)} blocks of {self.bytes_per_block / (1 << 20):.2f} MiB"
        )


def plan_kv_cache(
    total_bytes: int, utilization: float, used_bytes: int, bytes_per_block: int, min_blocks: int = 1
) -> MemoryPlan:
    """The plan, or GpuMemoryError when fewer than min_blocks fit (a request of max_model_len needs them)."""
    if not 0 < utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    plan = MemoryPlan(total_bytes, utilization, used_bytes, bytes_per_block)
    if plan.num_blocks < min_blocks:
        raise GpuMemoryError(
            f"{plan.describe()}: {min_blocks} blocks are needed; raise --gpu-memory-utilization, or lower "
            "--max-model-len or --max-num-batched-tokens"
        )
    return plan


def bytes_per_block(block_size: int, num_kv_heads: int, head_dim: int, num_layers: int, itemsize: int) -> int:
    """One block over every layer: [2, block_size, num_kv_heads, head_dim] per layer."""
    return 2 * block_size * num_kv_heads * head_dim * num_layers * itemsize
