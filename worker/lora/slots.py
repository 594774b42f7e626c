"""The adapters one step may mix, in preallocated slots, and their products for the rows that use them.

Per layer and fused product (qkv, o, gate_up, down: FUSED) the slots are two tensors, allocated once:
A [max_loras * parts * rank, in] and B [out, max_loras * parts * rank], where slot s's part p (q, k or v
of qkv) holds its factor in rank-wide block s * parts + p (padded with zeros below max_lora_rank; B's
block sits in that part's rows). Loading an adapter writes its slot's blocks and nothing else.

A step's products (BGMV's shape, in two torch products, one pass over every slot at once):
  xa = x @ A.T                       # [rows, slots * parts * rank]: each row against every slot
  xa.view(rows, slots, -1) *= mask   # [rows, slots, 1]: 1 at the row's own slot, 0 elsewhere (and for the base)
  y += xa @ B.T                      # [rows, out]: only the row's adapter contributes
The masked blocks add exact zeros, so a base row's output is the base product's bit for bit. The cost is
rows x width x (slots x rank) multiply-adds per product, beside the base's rows x width x out: small for the
ranks LoRA uses; a step with no adapter row skips all of it (and keeps the native decoder stack).
"""

from __future__ import annotations

import numpy as np
import torch

from worker.lora.adapter import FUSED, LoraWeights, module_shapes
from worker.model_config import ModelConfig


class LoraSlots:
    def __init__(self, config: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype) -> None:
        self.num_slots, self.max_rank = max_loras, max_rank
        shapes = module_shapes(config)
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], torch.Tensor] = {}
        self.part_rows: dict[str, list[tuple[int, int]]] = {}  # fused -> each part's (first, last) out rows
        for fused, parts in FUSED.items():
            in_features = shapes[parts[0]][0]
            outs = [shapes[part][1] for part in parts]
            bounds = np.cumsum([0, *outs])
            self.part_rows[fused] = [(int(bounds[i]), int(bounds[i + 1])) for i in range(len(parts))]
            width = max_loras * len(parts) * max_rank
            for layer in range(config.num_layers):
                self.a[(layer, fused)] = torch.zeros(width, in_features, dtype=dtype)  # [S*P*R, in]
                self.b[(layer, fused)] = torch.zeros(int(bounds[-1]), width, dtype=dtype)  # [out, S*P*R]
        self.used: dict[str, int] = dict.fromkeys(FUSED, 0)  # slots whose adapter targets each product
        self.targets: dict[int, set[str]] = {}  # slot -> the fused products its adapter targets

    def write(self, slot: int, weights: LoraWeights | None) -> None:
        """Put an adapter in a slot (None: empty it); the other slots are untouched."""
        old = self.targets.get(slot, set())
        new = {
            fused for fused, parts in FUSED.items() if weights and any(k[1] in parts for k in weights.factors)
        }
        for fused, parts in FUSED.items():
            block = len(parts) * self.max_rank
            for key, a in self.a.items():
                if key[1] != fused:
                    continue
                a[slot * block : (slot + 1) * block].zero_()
                self.b[key][:, slot * block : (slot + 1) * block].zero_()
            if weights is None:
                continue
            for p, part in enumerate(parts):
                first, last = self.part_rows[fused][p]
                column = slot * block + p * self.max_rank
                for (layer, target), (a_part, b_part) in weights.factors.items():
                    if target != part:
                        continue
                    rank = a_part.shape[0]
                    self.a[(layer, fused)][column : column + rank] = a_part
                    self.b[(layer, fused)][first:last, column : column + rank] = b_part
        for fused in FUSED:
            self.used[fused] += (fused in new) - (fused in old)
        self.targets[slot] = new

    def batch(self, slot_per_token: np.ndarray, dtype: torch.dtype) -> LoraBatch:
        """slot_per_token: [T], each token row's slot (-1: the base model)."""
        mask = np.zeros((len(slot_per_token), self.num_slots, 1), dtype=np.float32)
        rows = np.nonzero(slot_per_token >= 0)[0]
        mask[rows, slot_per_token[rows], 0] = 1.0
        return LoraBatch(self, torch.from_numpy(mask).to(dtype))


class LoraBatch:
    """One step's rows and their slots; `add` puts the adapters' products into a fused product's output."""

    def __init__(self, slots: LoraSlots, mask: torch.Tensor) -> None:
        self.slots = slots
        self.mask = mask  # [rows, slots, 1]

    def select(self, rows: torch.Tensor) -> LoraBatch:
        """The batch of these rows alone (the last layer's scored rows)."""
        return LoraBatch(self.slots, self.mask.index_select(0, rows))

    def add(self, layer: int, fused: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """x: [rows, in] the product's input; y: [rows, out] its output, updated in place."""
        if not self.slots.used[fused] or not len(x):
            return
        a, b = self.slots.a[(layer, fused)], self.slots.b[(layer, fused)]
        xa = x @ a.t()  # [rows, S*P*R]
        xa.view(len(x), self.slots.num_slots, -1).mul_(self.mask)
        y.addmm_(xa, b.t())
