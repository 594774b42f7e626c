"""The adapters one step may mix, in preallocated slots, and their products for the rows that use them.

Per layer and fused product (qkv, o, gate_up, down: adapter.products; a plain MLP's gate_up is up alone) the slots are two tensors, allocated once:
a [max_loras, parts * rank, in] and bt [max_loras, parts * rank, out] (B transposed), where slot s's part p
(q, k or v of qkv) holds its factors in the rank-wide block at p * rank (zeros past the adapter's rank; bt's
block only in that part's out columns). Loading an adapter writes its slot and nothing else.

A step's products, for the rows that use an adapter only: y[r] += B_s (A_s x[r]) with s the row's slot, in
one call per fused product (csrc lora_add: BGMV's shape; each row alone, so batch-invariant). A step with no
adapter row costs nothing (and keeps the native decoder stack). Without the csrc kernels, two torch products
over every slot at once, masked to each row's own (the reference the kernel is tested against):
  xa = x @ a.view(slots * width, in).T     # [rows, slots * width]: each row against every slot
  xa.view(rows, slots, width) *= mask      # 1 at the row's slot, 0 elsewhere (and for the base): exact zeros
  y += xa @ bt.view(slots * width, out)    # [rows, out]
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from worker.lora.adapter import LoraWeights, module_shapes, products, targets_of
from worker.lora.expert_slots import ExpertSlots
from worker.lora.experts import EXPERT_PARTS
from worker.model_config import ModelConfig

if TYPE_CHECKING:
    from worker.csrc_ops import CpuOps


NONE = torch.empty(0, dtype=torch.long)


class LoraSlots:
    def __init__(
        self,
        config: ModelConfig,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        ops: CpuOps | None = None,
    ) -> None:
        self.num_slots, self.max_rank, self.ops = max_loras, max_rank, ops
        shapes = module_shapes(config)
        self.products = fused_products = products(config)
        targets = targets_of(config)
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.bt: dict[tuple[int, str], torch.Tensor] = {}
        self.bounds: dict[str, torch.Tensor] = {}  # fused -> its parts' out columns, int64 [parts + 1]
        for fused, parts in fused_products.items():
            in_features = shapes[parts[0]][0]
            bounds = np.cumsum([0, *(shapes[part][1] for part in parts)])
            self.bounds[fused] = torch.from_numpy(bounds.astype(np.int64))
            # a product no adapter may target (a mixture of experts' MLP) keeps empty slots: never read
            width = len(parts) * max_rank if set(parts) & set(targets) else 0
            for layer in range(config.num_layers):
                self.a[(layer, fused)] = torch.zeros(max_loras, width, in_features, dtype=dtype)
                self.bt[(layer, fused)] = torch.zeros(max_loras, width, int(bounds[-1]), dtype=dtype)
        # fused -> [slots, parts]: each slot's rank in each part (0: its adapter does not target the part)
        self.ranks = {
            fused: torch.zeros(max_loras, len(parts), dtype=torch.long)
            for fused, parts in fused_products.items()
        }
        self.used: dict[str, int] = dict.fromkeys(
            fused_products, 0
        )  # slots whose adapter targets each product
        self.targets: dict[int, set[str]] = {}  # slot -> the fused products its adapter targets
        self.experts = ExpertSlots(config, max_loras, max_rank, dtype) if config.num_experts else None
        # per layer [a, bt] of each fused product, in the products' order: decoder_layers' lora_layers
        self.native_layers = [
            [t for fused in fused_products for t in (self.a[(layer, fused)], self.bt[(layer, fused)])]
            for layer in range(config.num_layers)
        ]

    def write(self, slot: int, weights: LoraWeights | None) -> None:
        """Put an adapter in a slot (None: empty it); the other slots are untouched."""
        old = self.targets.get(slot, set())
        new = {
            fused
            for fused, parts in self.products.items()
            if weights and any(k[1] in parts for k in weights.factors)
        }
        for key in self.a:
            self.a[key][slot].zero_()
            self.bt[key][slot].zero_()
        for ranks in self.ranks.values():
            ranks[slot] = 0
        for (layer, target), (a_part, b_part) in weights.factors.items() if weights else []:
            fused = next(name for name, parts in self.products.items() if target in parts)
            p = self.products[fused].index(target)
            first, last = (int(v) for v in self.bounds[fused][p : p + 2])
            row, rank = p * self.max_rank, a_part.shape[0]
            self.a[(layer, fused)][slot, row : row + rank] = a_part  # [rank, in]
            self.bt[(layer, fused)][slot, row : row + rank, first:last] = b_part.t()  # [rank, part's out]
            self.ranks[fused][slot, p] = rank
        for fused in self.products:
            self.used[fused] += (fused in new) - (fused in old)
        self.targets[slot] = new
        if self.experts is not None:
            self.experts.write(slot, weights)

    def batch(self, slot_per_token: np.ndarray) -> LoraBatch:
        """slot_per_token: [T], each token row's slot (-1: the base model)."""
        return LoraBatch(self, torch.from_numpy(slot_per_token.astype(np.int64)))


class LoraBatch:
    """One step's rows and their slots; `add` puts the adapters' products into a fused product's output."""

    def __init__(self, slots: LoraSlots, row_slots: torch.Tensor) -> None:
        self.slots = slots
        self.row_slots = row_slots  # int64 [rows], -1 for the base model's
        experts = slots.experts
        holding = sorted(experts.holding) if experts is not None else []
        # the rows whose adapter targets the routed experts (they leave fused_experts: Experts.adapted)
        self.expert_rows = (
            torch.nonzero(torch.isin(row_slots, torch.tensor(holding, dtype=torch.long))).flatten()
            if holding
            else NONE
        )

    def on_experts(self) -> bool:
        """Whether a row's adapter targets the routed experts (those rows take Experts.adapted)."""
        return len(self.expert_rows) > 0

    def native(self) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
        """decoder_layers' lora_layers and lora_meta (csrc/decoder_cpu.cpp): the same products, in the stack,
        and for a mixture of experts the experts' slots (each layer's, empty where none are allocated), which
        slots hold an adapter on them, and their bounds and ranks."""
        slots = self.slots
        meta = [self.row_slots]
        for fused in slots.products:
            meta += [slots.bounds[fused], slots.ranks[fused] if slots.used[fused] else NONE]
        experts = slots.experts
        if experts is None:
            return slots.native_layers, meta
        holding = torch.zeros(slots.num_slots, dtype=torch.long)
        holding[sorted(experts.holding)] = 1
        meta += [holding]
        for fused in EXPERT_PARTS:
            meta += [experts.bounds[fused], experts.ranks[fused]]
        layers = [
            [*own, *(t for fused in EXPERT_PARTS for t in (experts.a.get((layer, fused), NONE),
                                                          experts.bt.get((layer, fused), NONE)))]
            for layer, own in enumerate(slots.native_layers)
        ]  # fmt: skip
        return layers, meta

    def select(self, rows: torch.Tensor) -> LoraBatch:
        """The batch of these rows alone (the last layer's scored rows)."""
        return LoraBatch(self.slots, self.row_slots.index_select(0, rows))

    def add(self, layer: int, fused: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """x: [rows, in] the product's input; y: [rows, out] its output, updated in place."""
        slots = self.slots
        if not slots.used[fused] or not len(x):
            return
        a, bt = slots.a[(layer, fused)], slots.bt[(layer, fused)]
        if slots.ops is not None:
            slots.ops.lora_add(
                x.contiguous(), y, a, bt, self.row_slots, slots.bounds[fused], slots.ranks[fused]
            )
            return
        add_reference(x, y, a, bt, self.row_slots)

    def add_expert(
        self, layer: int, fused: str, expert: int, x: torch.Tensor, y: torch.Tensor, rows: torch.Tensor
    ) -> None:
        """An expert's product (gate_up or down) for its rows of this batch: x [n, in], y [n, out] in place."""
        experts = self.slots.experts
        assert experts is not None and (layer, fused) in experts.a
        a, bt = experts.a[(layer, fused)][expert], experts.bt[(layer, fused)][expert]
        row_slots = self.row_slots.index_select(0, rows)
        if self.slots.ops is not None:
            self.slots.ops.lora_add(
                x.contiguous(), y, a, bt, row_slots, experts.bounds[fused], experts.ranks[fused]
            )
            return
        add_reference(x, y, a, bt, row_slots)


def add_reference(
    x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, row_slots: torch.Tensor
) -> None:
    """lora_add in torch: every row against every slot, masked to its own (exact zeros elsewhere)."""
    num_slots, width, in_features = a.shape
    mask = torch.zeros(len(x), num_slots, 1, dtype=x.dtype)  # [rows, slots, 1]
    rows = torch.nonzero(row_slots >= 0).flatten()
    mask[rows, row_slots[rows], 0] = 1
    xa = x @ a.view(num_slots * width, in_features).t()  # [rows, slots * width]
    xa.view(len(x), num_slots, width).mul_(mask)
    y.addmm_(xa, bt.view(num_slots * width, -1))
