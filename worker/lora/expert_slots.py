"""The adapters' slots on a mixture of experts' routed experts, beside the layers' own (worker/lora/slots.py).

Per MoE layer and stacked product (gate_up: the gate and up parts; down) two tensors, allocated when the
first adapter that targets experts is written (an adapter on attention alone costs nothing here):
a [E, max_loras, parts * rank, in] and bt [E, max_loras, parts * rank, out], so that expert e's slots,
a[e] and bt[e], are lora_add's [slots, parts * rank, in] as they lie. A row's expert products then add
B_{s,e} (A_{s,e} x) for its slot s and each expert e it is routed to (Experts.adapted).
"""

from __future__ import annotations

import numpy as np
import torch

from worker.lora.adapter import LoraWeights
from worker.lora.experts import EXPERT_PARTS, shapes
from worker.model_config import ModelConfig


class ExpertSlots:
    def __init__(self, config: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype) -> None:
        self.config, self.num_slots, self.max_rank, self.dtype = config, max_loras, max_rank, dtype
        size = shapes(config)
        self.bounds = {
            fused: torch.from_numpy(np.cumsum([0, *(size[part][1] for part in parts)]).astype(np.int64))
            for fused, parts in EXPERT_PARTS.items()
        }
        # fused -> [slots, parts]: each slot's rank in each part (0: its adapter leaves the part alone)
        self.ranks = {
            fused: torch.zeros(max_loras, len(parts), dtype=torch.long)
            for fused, parts in EXPERT_PARTS.items()
        }
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.bt: dict[tuple[int, str], torch.Tensor] = {}
        self.holding: set[int] = set()  # slots whose adapter targets experts

    def _allocate(self) -> None:
        size, experts = shapes(self.config), self.config.num_experts
        for layer in range(self.config.num_layers):
            if not self.config.is_moe_layer(layer):
                continue
            for fused, parts in EXPERT_PARTS.items():
                width = len(parts) * self.max_rank
                in_features, out_features = size[parts[0]][0], int(self.bounds[fused][-1])
                self.a[(layer, fused)] = torch.zeros(
                    experts, self.num_slots, width, in_features, dtype=self.dtype
                )
                self.bt[(layer, fused)] = torch.zeros(
                    experts, self.num_slots, width, out_features, dtype=self.dtype
                )

    def write(self, slot: int, weights: LoraWeights | None) -> None:
        """Put an adapter's expert factors in a slot (None, or none of them: empty it)."""
        experts = weights.experts if weights is not None else {}
        if experts and not self.a:
            self._allocate()
        if slot in self.holding:
            for key in self.a:
                self.a[key][:, slot].zero_()
                self.bt[key][:, slot].zero_()
            self.holding.discard(slot)
        for ranks in self.ranks.values():
            ranks[slot] = 0
        for (layer, part), (a, b) in experts.items():  # a [E, rank, in], b [E, out, rank]
            fused = next(name for name, parts in EXPERT_PARTS.items() if part in parts)
            p = EXPERT_PARTS[fused].index(part)
            first, last = (int(v) for v in self.bounds[fused][p : p + 2])
            row, rank = p * self.max_rank, a.shape[1]
            self.a[(layer, fused)][:, slot, row : row + rank] = a
            self.bt[(layer, fused)][:, slot, row : row + rank, first:last] = b.transpose(1, 2)
            self.ranks[fused][slot, p] = rank
        if experts:
            self.holding.add(slot)
