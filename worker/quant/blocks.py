"""A quantized GGUF weight on its way from the file to a product: the file's blocks (GgufBlocks), and the
products' packing of them (QuantPart, csrc/quant_cpu.cpp's tiles), which a Linear or an Embedding holds
in place of its float weight (worker/models/layers.py). docs/quantization.md has the whole path."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from worker.quant.gguf_pack import Q, pack


@dataclass
class GgufBlocks:
    """A [N, K] weight as the file holds it: rows of blocks, uint8 [N, K / B * bytes per block]."""

    qtype: int
    rows: np.ndarray
    shape: tuple[int, int]

    @property
    def type_name(self) -> str:
        return Q(self.qtype).name

    def with_rows(self, reorder: Callable[[np.ndarray], np.ndarray]) -> GgufBlocks:
        """The weight with its rows rearranged (llama.cpp's rotary permutation undone): whole rows move."""
        return GgufBlocks(self.qtype, np.ascontiguousarray(reorder(self.rows)), self.shape)

    def dequantize(self) -> torch.Tensor:
        from gguf.quants import dequantize

        values = np.asarray(dequantize(self.rows, Q(self.qtype)), dtype=np.float32).reshape(self.shape)
        return torch.from_numpy(values)

    def packed(self) -> torch.Tensor:
        return torch.from_numpy(pack(self.rows, self.qtype, self.shape))


@dataclass
class QuantPart:
    """Rows [start, start + out_features) of a product's output, from one packed weight of one type."""

    start: int
    qtype: int
    packed: torch.Tensor  # uint8 [out_features / 16, K / B, record]
    out_features: int

    @property
    def nbytes(self) -> int:
        return self.packed.numel()
