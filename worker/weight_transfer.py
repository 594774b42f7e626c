"""A worker rank's side of weight updates for RL loops (docs/rl-weight-updates.md): it joins the trainer's
group, receives each update's tensors into a staging area, and only at `finish` builds the model from
them (the checkpoint loader's names, TP shards and packing, as at start) and copies it into the live
model's tensors. An update that fails part way (a trainer that died, a name the model lacks, a missing
weight) leaves the served weights as they were: nothing live is written before `finish` has a whole
new model.

The group is a torch.distributed process group of its own (not the default one the TP ranks share):
gloo over loopback or the trainer's interface on CPUs, NCCL on CUDA, built on the trainer's TCPStore.
"""

from __future__ import annotations

import datetime
import os
from collections import deque
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from protocol.errors import InvalidParameterError
from protocol.weight_transfer import InitInfo, UpdateInfo, WeightTransferConfig, packing_plan
from worker.sleep import model_tensors

if TYPE_CHECKING:
    from worker.model_runner import ModelRunner

STORE_PREFIX = "engine-weight-transfer"


def dtype_of(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))  # type: ignore[no-any-return]


def join_group(info: InitInfo, rank: int, backend: str, timeout_s: float) -> Any:
    """The trainer's group (rank 0 is the trainer, whose TCPStore is at master_address:master_port)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(  # type: ignore[attr-defined]
        info.master_address, info.master_port, info.world_size, is_master=rank == 0, timeout=timeout
    )
    prefixed = dist.PrefixStore(STORE_PREFIX, store)  # type: ignore[attr-defined]
    if backend == "nccl":
        nccl_options = dist.ProcessGroupNCCL.Options()
        nccl_options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, info.world_size, nccl_options)
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = timeout
    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    loopback = info.master_address in ("127.0.0.1", "localhost", "::1")
    device = dist.ProcessGroupGloo.create_device(
        **({"interface": interface or "lo"} if interface or loopback else {"hostname": ""})
    )
    options._devices = [device]
    return dist.ProcessGroupGloo(prefixed, rank, info.world_size, options)


def broadcast_all(group: Any, tensors: list[torch.Tensor], in_flight: int) -> None:
    """Receive (or, on the trainer, send) each tensor from rank 0, at most in_flight at once."""
    works: deque[Any] = deque()
    for tensor in tensors:
        works.append(group.broadcast([tensor], dist.BroadcastOptions()))
        if len(works) >= in_flight:
            works.popleft().wait()
    while works:
        works.popleft().wait()


def wire_tensors(info: UpdateInfo, device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(what is broadcast: the tensors, or packed byte buffers; the tensors they fill, in order)."""
    tensors = [
        torch.empty(shape, dtype=dtype_of(dtype), device=device)
        for shape, dtype in zip(info.shapes, info.dtype_names, strict=True)
    ]
    if not info.packed:
        return tensors, tensors
    sizes = [t.numel() * t.element_size() for t in tensors]
    buffers = [torch.empty(sum(sizes[i] for i in group), dtype=torch.uint8, device=device)
               for group in packing_plan(sizes, info.packed_buffer_size_bytes)]  # fmt: skip
    return buffers, tensors


def pack(info: UpdateInfo, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The trainer's side of wire_tensors: each packed buffer's bytes, from the tensors in order."""
    if not info.packed:
        return tensors
    raw = [t.contiguous().view(-1).view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)
           for t in tensors]  # fmt: skip
    plan = packing_plan([r.numel() for r in raw], info.packed_buffer_size_bytes)
    return [torch.cat([raw[i] for i in group]) for group in plan]


def unpack(info: UpdateInfo, buffers: list[torch.Tensor], tensors: list[torch.Tensor]) -> None:
    sizes = [t.numel() * t.element_size() for t in tensors]
    for buffer, group in zip(buffers, packing_plan(sizes, info.packed_buffer_size_bytes), strict=True):
        offset = 0
        for index in group:
            target = tensors[index]
            if target.numel():
                target.view(-1).view(torch.uint8).copy_(buffer[offset : offset + sizes[index]])
            offset += sizes[index]


def checkpoint_names(runner: ModelRunner) -> set[str]:
    """The weights an update must send: the served safetensors checkpoint's names."""
    from worker.quant.method import quantization_config
    from worker.weights import _names, _safetensors_files

    model = runner.config.model
    if model.endswith(".gguf") or runner.packed or quantization_config(model):
        raise InvalidParameterError(
            "init_info", "weight updates take an unquantized safetensors checkpoint: this model's weights "
            "are served quantized",
        )  # fmt: skip
    return {name for path in _safetensors_files(model) for name in _names(path)}


class WeightReceiver:
    def __init__(self, config: WeightTransferConfig, rank: int, device: torch.device) -> None:
        self.config, self.rank, self.device = config, rank, device
        self.group: Any = None
        self.staged: dict[str, torch.Tensor] | None = None  # an update's tensors, by checkpoint name

    def init(self, info: InitInfo) -> dict[str, Any]:
        if self.config.backend == "nccl" and self.device.type != "cuda":
            raise InvalidParameterError("init_info", "the nccl backend needs a CUDA worker: use gloo on CPUs")
        self.shutdown()
        rank = info.rank_offset + self.rank
        if not 0 < rank < info.world_size:
            raise InvalidParameterError(
                "init_info", f"rank_offset {info.rank_offset} puts worker rank {self.rank} at {rank}, outside "
                f"1..{info.world_size - 1} (the trainer is rank 0)",
            )  # fmt: skip
        self.group = join_group(info, rank, self.config.backend, self.config.timeout_s)
        return {"rank": rank, "world_size": info.world_size}

    def start(self) -> None:
        if self.group is None:
            raise InvalidParameterError(
                "init_info", "no weight transfer group: POST /init_weight_transfer_engine first"
            )
        self.staged = {}

    def receive(self, info: UpdateInfo) -> int:
        if self.staged is None:
            raise InvalidParameterError("update_info", "no update is open: POST /start_weight_update first")
        wire, tensors = wire_tensors(info, self.device)
        try:
            broadcast_all(self.group, wire, info.packed_num_buffers)
        except RuntimeError:
            self.staged = None  # the trainer is gone mid-update: nothing of it is kept
            raise
        if info.packed:
            unpack(info, wire, tensors)
        self.staged.update(zip(info.names, (t.cpu() for t in tensors), strict=True))
        return len(tensors)

    def finish(self, runner: ModelRunner) -> dict[str, Any]:
        """Build the model from the staged tensors and copy it into the live one."""
        staged, self.staged = self.staged, None
        if staged is None:
            raise InvalidParameterError("update", "no update is open: POST /start_weight_update first")
        missing = sorted(checkpoint_names(runner) - staged.keys())
        if missing:
            raise InvalidParameterError(
                "update_info.names",
                f"the update lacks {len(missing)} of the checkpoint's weights, e.g. {missing[:3]}",
            )
        unknown = sorted(staged.keys() - checkpoint_names(runner) - {"lm_head.weight"})  # (tied: optional)
        if unknown:
            raise InvalidParameterError("update_info.names", f"the model has no weights named {unknown[:3]}")
        rebuilt = runner.build_from(iter(staged.items()))
        live, fresh = model_tensors(runner.model), model_tensors(rebuilt)
        if [t.shape for t in live] != [t.shape for t in fresh]:
            raise InvalidParameterError(
                "update_info.shapes", "the update's weights do not have the served shapes"
            )
        with torch.no_grad():
            for target, source in zip(live, fresh, strict=True):
                target.copy_(source)
        return {"num_weights": len(staged)}

    def shutdown(self) -> None:
        self.group, self.staged = None, None
