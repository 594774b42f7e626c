"""LoRA adapters across processes: the engine's table entries, what a worker is told to load, the limits.

The engine owns the table (engine_core/lora_table.py): every frontend asks it, so a load or unload is seen
by all at once. Workers hold the weights (worker/lora/): a CPU cache of up to max_cpu_loras adapters and
max_loras preallocated slots, the adapters one step may mix.
"""

from __future__ import annotations

import msgspec


class LoraConfig(msgspec.Struct, kw_only=True):
    """vLLM's LoRA limits."""

    max_loras: int = 1  # adapters one step may mix (the worker's slots)
    max_lora_rank: int = 16  # the largest rank an adapter may have (the slots' width)
    max_cpu_loras: int | None = None  # adapters the worker keeps loaded; None: max_loras

    @property
    def num_cpu_loras(self) -> int:
        return max(self.max_cpu_loras or self.max_loras, self.max_loras)


class LoraRequest(msgspec.Struct, array_like=True):
    """An adapter as the engine names it to workers: its id is unique for the engine's life, so a name
    loaded again from another folder never meets the old one's weights or KV blocks."""

    lora_id: int  # 1, 2, ... (0 is the base model)
    name: str  # as requests give it in `model`
    path: str  # the PEFT folder: adapter_config.json + adapter_model.safetensors


class LoraAdapter(msgspec.Struct, kw_only=True, frozen=True):
    """One row of the engine's table, as /v1/models shows it."""

    name: str
    path: str
    base_model_name: str | None = None  # the served model it was made for (the card's parent)
    lora_id: int = 0
    unloading: bool = False  # unloaded while requests used it: they finish, new ones are refused
