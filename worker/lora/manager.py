"""The worker's adapters: a CPU cache of loaded ones (max_cpu_loras, least recently used out first) and
the slots a step's adapters go in (max_loras; the engine never schedules more adapters in one step).

An adapter the cache let go of is read again from its folder when a request needs it (the request names
its path), as vLLM's LRU cache does. An adapter a request the worker holds uses is never let go (so
requests finish on the weights they started with, whatever happens to the folder); the cache may then
hold more than max_cpu_loras until they end. A folder that fails when read again fails the requests on
it (`failed`), not the step.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np
import torch

from protocol.errors import InvalidParameterError
from protocol.lora import LoraConfig, LoraRequest
from worker.lora.adapter import LoraWeights, load_adapter
from worker.lora.slots import LoraBatch, LoraSlots
from worker.model_config import ModelConfig, UnsupportedModelError

if TYPE_CHECKING:
    from worker.csrc_ops import CpuOps


class LoraManager:
    def __init__(
        self, config: LoraConfig, model_config: ModelConfig, dtype: torch.dtype, ops: CpuOps | None = None
    ) -> None:
        if model_config.is_encoder:
            raise UnsupportedModelError("--enable-lora serves decoders; this model is an encoder")
        if model_config.kv_lora_rank:
            raise UnsupportedModelError(
                f"--enable-lora: {model_config.architecture}'s latent attention has no LoRA slots yet"
            )
        self.config, self.model_config, self.dtype = config, model_config, dtype
        self.slots = LoraSlots(model_config, config.max_loras, config.max_lora_rank, dtype, ops)
        self.cache: OrderedDict[int, LoraWeights] = OrderedDict()  # lora id -> weights, oldest use first
        self.slot_ids: list[int | None] = [None] * config.max_loras  # the adapter in each slot
        self.slot_order: list[int] = list(range(config.max_loras))  # least recently used slot first
        self.pinned: set[int] = set()  # adapters of the requests the worker holds: never evicted
        self.failed: dict[int, str] = {}  # this step's adapters that could not be read again, and why

    def add(self, lora: LoraRequest) -> dict[str, int]:
        """Load (and check) an adapter into the cache; raises InvalidParameterError and keeps nothing when
        the folder does not fit. Returns its rank and size."""
        weights = load_adapter(lora.path, self.model_config, self.config.max_lora_rank, self.dtype)
        self._keep(lora.lora_id, weights)
        return {"rank": weights.rank, "num_bytes": weights.num_bytes}

    def remove(self, lora_id: int) -> bool:
        """Drop an adapter from the cache and its slot; False when the worker did not hold it."""
        held = self.cache.pop(lora_id, None) is not None
        if lora_id in self.slot_ids:
            slot = self.slot_ids.index(lora_id)
            self.slots.write(slot, None)
            self.slot_ids[slot] = None
            held = True
        return held

    def clear_slots(self) -> None:
        """Forget what the slots hold (their memory was dropped): each adapter is written again when used."""
        for slot, lora_id in enumerate(self.slot_ids):
            if lora_id is not None:
                self.slots.write(slot, None)
                self.slot_ids[slot] = None

    def list_ids(self) -> list[int]:
        return list(self.cache)

    def _keep(self, lora_id: int, weights: LoraWeights) -> None:
        self.cache[lora_id] = weights
        self.cache.move_to_end(lora_id)
        keep = self.pinned | {lora_id}
        evictable = [held for held in self.cache if held not in keep]  # oldest use first
        for held in evictable[: max(0, len(self.cache) - self.config.num_cpu_loras)]:
            del self.cache[held]

    def batch(
        self, loras: list[LoraRequest | None], counts: np.ndarray, pinned: set[int]
    ) -> LoraBatch | None:
        """The step's LoRA batch for requests in flattened order (their adapters, their token counts);
        None when no request uses one. pinned: the adapters of every request the worker holds."""
        self.pinned, self.failed = pinned, {}
        ids = [lora.lora_id if lora is not None else 0 for lora in loras]
        if not any(ids):
            return None
        present = {lora.lora_id: lora for lora in loras if lora is not None}
        if len(present) > self.config.max_loras:
            raise RuntimeError(f"a step mixes {len(present)} adapters; max_loras is {self.config.max_loras}")
        slot_of = {}
        for lora_id, lora in present.items():
            try:
                slot_of[lora_id] = self._slot_for(lora, set(present))
            except (InvalidParameterError, OSError) as error:  # its folder changed since it was loaded
                self.failed[lora_id] = f"the LoRA adapter `{lora.name}` could not be read again: {error}"

        slots = np.array([slot_of.get(lora_id, -1) for lora_id in ids], dtype=np.int64)
        return self.slots.batch(np.repeat(slots, counts))

    def _slot_for(self, lora: LoraRequest, present: set[int]) -> int:
        if lora.lora_id in self.slot_ids:
            slot = self.slot_ids.index(lora.lora_id)
        else:
            weights = self.cache.get(lora.lora_id)
            if weights is None:  # the cache let it go: read it again
                weights = load_adapter(lora.path, self.model_config, self.config.max_lora_rank, self.dtype)
            self._keep(lora.lora_id, weights)
            slot = next(s for s in self.slot_order if self.slot_ids[s] not in present)
            self.slots.write(slot, weights)
            self.slot_ids[slot] = lora.lora_id
        self.slot_order.remove(slot)
        self.slot_order.append(slot)
        if lora.lora_id in self.cache:
            self.cache.move_to_end(lora.lora_id)
        return slot
