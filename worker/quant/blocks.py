"""A quantized weight on its way from the checkpoint to a product: a GGUF file's blocks (GgufBlocks) or a
safetensors checkpoint's integers (IntBlocks: AWQ, GPTQ, compressed-tensors), and the products' packing of
them (QuantPart, csrc/quant_cpu.cpp's tiles), which a Linear or an Embedding holds in place of its float
weight (worker/models/layers.py). docs/quantization.md has the whole path."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from worker.csrc_ops import loaded_cpu_ops
from worker.quant import int_pack


class QuantWeight:
    """A [N, K] quantized weight: its type (csrc/quant_blocks.h's QType), its float32 values, its tiles."""

    qtype: int
    shape: tuple[int, int]
    # the activations' quantization the checkpoint prescribes for this product (None: float activations;
    # "int8-token": symmetric int8 per token, dynamic)
    activations: str | None = None

    @property
    def type_name(self) -> str:
        raise NotImplementedError

    def with_rows(self, reorder: Callable[[np.ndarray], np.ndarray]) -> QuantWeight:
        """The weight with its rows rearranged: reorder takes and returns an array of rows."""
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        raise NotImplementedError

    def packed(self) -> torch.Tensor:
        raise NotImplementedError

    def input_order(self) -> torch.Tensor | None:
        """int64 [K]: the packed weight's column j is input dim order[j] (act-order, QuantPart.order); None:
        the input dims' own order."""
        return None

    def narrow(self, dim: int, start: int, length: int) -> QuantWeight:
        """Rows (dim 0) or input dims (dim 1, whole blocks only) [start, start + length): a rank's slice."""
        raise ValueError(f"a {self.type_name} weight is not sliced for tensor parallel yet")

    def pad_rows(self, rows: int) -> QuantWeight:
        """The weight with zero rows after its own, `rows` in all (a vocabulary shard's padding)."""
        raise ValueError(f"a {self.type_name} weight is not padded for tensor parallel yet")


def _whole(what: str, start: int, length: int, block: int) -> None:
    if start % block or length % block:
        raise ValueError(
            f"input dims [{start}, {start + length}) are not whole {what} blocks of {block} dims"
        )


@dataclass
class GgufBlocks(QuantWeight):
    """A [N, K] weight as the file holds it: rows of blocks, uint8 [N, K / B * bytes per block]."""

    qtype: int
    rows: np.ndarray
    shape: tuple[int, int]

    @property
    def type_name(self) -> str:
        from gguf.constants import GGMLQuantizationType  # (not at import: the gguf package costs 0.1 s)

        return GGMLQuantizationType(self.qtype).name

    def with_rows(self, reorder: Callable[[np.ndarray], np.ndarray]) -> GgufBlocks:
        """The weight with its rows rearranged (llama.cpp's rotary permutation undone): whole rows move."""
        return GgufBlocks(self.qtype, np.ascontiguousarray(reorder(self.rows)), self.shape)

    def dequantize(self) -> torch.Tensor:
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize

        values = np.asarray(dequantize(self.rows, GGMLQuantizationType(self.qtype)), dtype=np.float32)
        values = values.reshape(self.shape)
        return torch.from_numpy(values)

    def packed(self) -> torch.Tensor:
        # the csrc packer where the kernels are loaded (a worker loads them before its weights; the tiles
        # serve only with them): the same bytes as the numpy specification, 5-20x sooner (0.3 s of a
        # worker's start with SmolLM2's file)
        ops = loaded_cpu_ops()
        if ops is None:
            from worker.quant.gguf_pack import pack

            return torch.from_numpy(pack(self.rows, self.qtype, self.shape))
        raw = torch.from_numpy(np.ascontiguousarray(self.rows, dtype=np.uint8))
        return ops.pack_gguf(raw, self.qtype, *self.shape)

    def narrow(self, dim: int, start: int, length: int) -> GgufBlocks:
        if dim == 0:
            return GgufBlocks(self.qtype, self.rows[start : start + length], (length, self.shape[1]))
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(self.qtype)]
        _whole(self.type_name, start, length, block)
        columns = self.rows[:, start // block * nbytes : (start + length) // block * nbytes]
        return GgufBlocks(self.qtype, np.ascontiguousarray(columns), (self.shape[0], length))

    def pad_rows(self, rows: int) -> GgufBlocks:
        zeros = np.zeros((rows - self.shape[0], self.rows.shape[1]), dtype=np.uint8)  # scales 0: weights 0
        return GgufBlocks(self.qtype, np.concatenate([self.rows, zeros]), (rows, self.shape[1]))


@dataclass
class IntBlocks(QuantWeight):
    """A [N, K] weight of `bits`-bit integers q (4-bit: uint8 0-15; 8-bit: int8) with a float32 scale and
    offset per (row, group of K / groups dims): weight = fma(scale, q, offset) (worker/quant/int_pack.py).
    order: act-order checkpoints (GPTQ's desc_act, compressed-tensors' actorder "group") group input dims
    that are not side by side; q's columns are then held in group order, column j being input dim
    order[j]: packed so, its products take x's columns in that order (QuantPart.order)."""

    bits: int
    q: np.ndarray
    scale: np.ndarray  # float32 [N, groups]
    offset: np.ndarray
    activations: str | None = None
    order: np.ndarray | None = None  # int64 [K]

    @property
    def shape(self) -> tuple[int, int]:  # type: ignore[override]
        return (int(self.q.shape[0]), int(self.q.shape[1]))

    @property
    def group(self) -> int:
        return self.shape[1] // int(self.scale.shape[1])

    @property
    def qtype(self) -> int:  # type: ignore[override]
        int8_rows = self.activations is not None
        return int(int_pack.int_type(self.bits, self.group, self.shape[1], int8_rows).value)

    @property
    def type_name(self) -> str:
        return f"int{self.bits} (groups of {self.group})"

    def with_rows(self, reorder: Callable[[np.ndarray], np.ndarray]) -> IntBlocks:
        q, scale, offset = (np.ascontiguousarray(reorder(a)) for a in (self.q, self.scale, self.offset))
        return IntBlocks(self.bits, q, scale, offset, self.activations, self.order)

    def dequantize(self) -> torch.Tensor:
        """The weight in float32: scale * q + offset, rounded once (float64 holds scale * q exactly)."""
        scale = np.repeat(self.scale.astype(np.float64), self.group, axis=1)
        offset = np.repeat(self.offset.astype(np.float64), self.group, axis=1)
        weight = (scale * self.q.astype(np.float64) + offset).astype(np.float32)
        if self.order is not None:  # back to the input dims' order
            unordered = np.empty_like(weight)
            unordered[:, self.order] = weight
            weight = unordered
        return torch.from_numpy(weight)

    def input_order(self) -> torch.Tensor | None:
        return (
            None if self.order is None else torch.from_numpy(np.ascontiguousarray(self.order, dtype=np.int64))
        )

    def packed(self) -> torch.Tensor:
        qtype = int_pack.IntType(self.qtype)
        return torch.from_numpy(int_pack.pack(self.q, self.scale, self.offset, qtype))

    def narrow(self, dim: int, start: int, length: int) -> IntBlocks:
        if dim == 0:
            rows = slice(start, start + length)
            return IntBlocks(
                self.bits, self.q[rows], self.scale[rows], self.offset[rows], self.activations, self.order
            )
        if self.order is not None:
            raise ValueError("an act-order weight's input dims are not sliced for tensor parallel yet")
        groups = int(self.scale.shape[1])
        if groups == 1:  # one scale a row (channel-wise): any run of dims keeps it
            return IntBlocks(self.bits, np.ascontiguousarray(self.q[:, start : start + length]), self.scale,
                             self.offset, self.activations)  # fmt: skip
        _whole(self.type_name, start, length, self.group)
        g = slice(start // self.group, (start + length) // self.group)
        return IntBlocks(self.bits, np.ascontiguousarray(self.q[:, start : start + length]),
                         np.ascontiguousarray(self.scale[:, g]), np.ascontiguousarray(self.offset[:, g]),
                         self.activations)  # fmt: skip

    def pad_rows(self, rows: int) -> IntBlocks:
        extra = rows - self.shape[0]
        pad = [np.zeros((extra, *a.shape[1:]), dtype=a.dtype) for a in (self.q, self.scale, self.offset)]
        return IntBlocks(self.bits, np.concatenate([self.q, pad[0]]), np.concatenate([self.scale, pad[1]]),
                         np.concatenate([self.offset, pad[2]]), self.activations, self.order)  # fmt: skip


@dataclass
class QuantPart:
    """Rows [start, start + out_features) of a product's output, from one packed weight of one type."""

    start: int
    qtype: int
    packed: torch.Tensor  # uint8 [out_features / 16, K / B, record]
    out_features: int
    activations: str | None = None  # QuantWeight.activations
    # act-order (IntBlocks.order): the packed weight's column j is input dim order[j], so the product takes
    # x[:, order] (int64 [K]); None: the input dims' own order
    order: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return self.packed.numel()


@dataclass
class Mxfp4Blocks(QuantWeight):
    """A [N, K] MXFP4 weight as gpt-oss checkpoints hold it: blocks uint8 [N, K / 32, 16], scales uint8
    [N, K / 32] (worker/models/mxfp4.py)."""

    blocks: np.ndarray
    scales: np.ndarray
    qtype: int = int(int_pack.IntType.MXFP4)

    @property
    def shape(self) -> tuple[int, int]:  # type: ignore[override]
        return (int(self.scales.shape[0]), int(self.scales.shape[1]) * 32)

    @property
    def type_name(self) -> str:
        return "MXFP4"

    def with_rows(self, reorder: Callable[[np.ndarray], np.ndarray]) -> Mxfp4Blocks:
        return Mxfp4Blocks(
            np.ascontiguousarray(reorder(self.blocks)), np.ascontiguousarray(reorder(self.scales))
        )

    def dequantize(self) -> torch.Tensor:
        from worker.models.mxfp4 import dequantize_mxfp4

        return dequantize_mxfp4(torch.from_numpy(self.blocks), torch.from_numpy(self.scales), torch.float32)

    def packed(self) -> torch.Tensor:
        return torch.from_numpy(int_pack.pack_mxfp4(self.blocks, self.scales))
