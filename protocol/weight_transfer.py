"""Weight updates for RL loops (docs/rl-weight-updates.md): vLLM's `--weight-transfer-config` and the
init and update infos its routes carry (/init_weight_transfer_engine, /update_weights).

A trainer process and every worker rank of the engine join one torch.distributed group (gloo on CPUs;
nccl on CUDA, the same code path): the trainer is rank 0, worker rank r is `rank_offset + r`. Each
update names its tensors (Hugging Face checkpoint names, dtypes, shapes) in the order the trainer
broadcasts them, one by one or packed into byte buffers (`packing_plan`, computed alike on both sides).
"""

from __future__ import annotations

from typing import Any

import msgspec

from protocol.errors import InvalidParameterError

BACKENDS = ("gloo", "nccl")
DTYPES = ("float32", "bfloat16", "float16")  # what a trainer sends (torch.<name>)
DEFAULT_BUFFER_BYTES = 1 << 30  # vLLM's packed buffer size
DEFAULT_NUM_BUFFERS = 2


class WeightTransferConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    backend: str = "gloo"
    timeout_s: float = 300.0  # how long a rendezvous or one update's broadcasts may take


class InitInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int


class UpdateInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    packed: bool = False
    packed_buffer_size_bytes: int = DEFAULT_BUFFER_BYTES
    packed_num_buffers: int = DEFAULT_NUM_BUFFERS
    is_checkpoint_format: bool = True  # Hugging Face names and layouts (the only format served)

    def check(self) -> None:
        if not (len(self.names) == len(self.dtype_names) == len(self.shapes)):
            raise InvalidParameterError(
                "update_info", "names, dtype_names and shapes must have one entry per tensor"
            )
        for dtype in self.dtype_names:
            if dtype.removeprefix("torch.") not in DTYPES:
                raise InvalidParameterError(
                    "update_info.dtype_names", f"takes {', '.join(DTYPES)}, got {dtype!r}"
                )
        if any(size < 0 for shape in self.shapes for size in shape):
            raise InvalidParameterError("update_info.shapes", "sizes must be 0 or more")
        if self.packed_buffer_size_bytes < 1 or self.packed_num_buffers < 1:
            raise InvalidParameterError(
                "update_info", "packed_buffer_size_bytes and packed_num_buffers must be 1 or more"
            )
        if not self.is_checkpoint_format:
            raise InvalidParameterError(
                "update_info.is_checkpoint_format",
                "only checkpoint-format weights (Hugging Face names) are taken",
            )


def parse(kind: type[Any], value: Any, param: str) -> Any:
    """A request's dict as its typed info; an InvalidParameterError naming the field otherwise."""
    try:
        return msgspec.convert(value, kind, strict=True)
    except msgspec.ValidationError as error:
        raise InvalidParameterError(param, f"{param}: {error}") from None


def parse_weight_transfer_config(value: dict[str, Any]) -> WeightTransferConfig:
    config: WeightTransferConfig = parse(WeightTransferConfig, value, "--weight-transfer-config")
    if config.backend not in BACKENDS:
        raise InvalidParameterError(
            "--weight-transfer-config", f"backend takes {', '.join(BACKENDS)}, got {config.backend!r}"
        )
    if config.timeout_s <= 0:
        raise InvalidParameterError("--weight-transfer-config", "timeout_s must be more than 0")
    return config


def packing_plan(num_bytes: list[int], buffer_bytes: int) -> list[list[int]]:
    """The tensors (by index, in order) each packed buffer holds: as many as fit in buffer_bytes, a
    larger one alone. Trainer and workers compute it alike from the update's dtypes and shapes."""
    plan: list[list[int]] = []
    used = 0
    for index, size in enumerate(num_bytes):
        if not plan or used + size > buffer_bytes:
            plan.append([])
            used = 0
        plan[-1].append(index)
        used += size
    return plan
