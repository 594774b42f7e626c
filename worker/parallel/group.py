"""The tensor-parallel group: torch.distributed over gloo (CPU) or NCCL (CUDA), and the four collectives the
model and the runner use.

Invariants: every rank calls the same collectives in the same order (they run the same SchedulerOutput
through the same code); in batch-invariant mode a sum over ranks is added in rank order, so a row's
result does not depend on how many rows the step has (gloo's ring all-reduce splits a tensor into chunks
by its size, and which rank adds which chunk first moves with it).
"""

from __future__ import annotations

import datetime
import logging
import os

import torch
import torch.distributed as dist

from protocol.config import ParallelConfig

logger = logging.getLogger("engine.worker")


class TensorParallelGroup:
    def __init__(
        self,
        config: ParallelConfig,
        rank: int,
        batch_invariant: bool = False,
        device: torch.device | None = None,
    ) -> None:
        """device: the rank's (CUDA: NCCL, and its tensors there; else gloo)."""
        self.device = device or torch.device("cpu")
        self.rank = rank
        self.size = config.tensor_parallel_size
        self.batch_invariant = batch_invariant
        self.timeout_s = config.timeout_s
        if config.master_addr.startswith("127.") or config.master_addr == "localhost":
            # gloo otherwise resolves the host's name to pick an interface, which may not reach the others
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        self.startup_timeout_s = max(config.startup_timeout_s, config.timeout_s)
        timeout = datetime.timedelta(seconds=config.timeout_s)
        # joining waits for the slowest rank to start (another machine's may come minutes later)
        self.store = dist.TCPStore(  # type: ignore[attr-defined]
            config.master_addr,
            config.master_port,
            self.size,
            is_master=rank == 0,
            timeout=datetime.timedelta(seconds=self.startup_timeout_s),
        )
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=self.store, rank=rank, world_size=self.size, timeout=timeout)
        # the waits at start (loads, kernel compiles) take the startup timeout, on gloo (monitored_barrier's)
        startup = datetime.timedelta(seconds=self.startup_timeout_s)
        self.startup_group = dist.new_group(backend="gloo", timeout=startup) if backend != "gloo" else None
        logger.info("rank %d of %d joined (%s at %s)", rank, self.size, backend, config.master_addr)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of x (each rank's partial product), on every rank."""
        if not self.batch_invariant:
            dist.all_reduce(x)
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        total = parts[0]
        for part in parts[1:]:
            total += part  # rank order, whatever the shape
        return total

    def gather_logits(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """local: [n, vocab / size] this rank's shard of the logits -> [n, vocab] on rank 0, None elsewhere.

        NOTE: gathered on rank 0, which samples alone, rather than sampled per shard and reduced: the
        sampler's penalties, masks, top-k/p and grammars see the whole vocabulary in one place, exactly as
        at TP=1, and the gather moves n x vocab floats once a step (the all-reduces move far more)."""
        local = local.contiguous()
        if self.rank == 0:
            parts = [torch.empty_like(local) for _ in range(self.size)]
            dist.gather(local, parts, dst=0)
            return torch.cat(parts, dim=-1)[:, :vocab_size]
        dist.gather(local, None, dst=0)
        return None

    def broadcast_token_ids(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Rank 0's sampled ids reach the others, whose next step reads them as its inputs (host tensors in
        and out: the sampler runs on the host)."""
        on_device = token_ids.to(self.device)
        dist.broadcast(on_device, src=0)
        return on_device.cpu()

    def wait_for_all(self) -> None:
        """At start: every rank has loaded its shard (up to the startup timeout, not the collectives')."""
        wait = datetime.timedelta(seconds=self.startup_timeout_s)
        dist.monitored_barrier(group=self.startup_group, timeout=wait, wait_all_ranks=True)

    def min_int(self, value: int) -> int:
        """The smallest of every rank's value (the KV cache size every rank can hold)."""
        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return int(tensor.item())

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
