"""Building blocks shared by the model families: RMSNorm, SiLU-and-mul and a linear layer whose weight is
packed once for oneDNN; HF-exact numerics (the other norms: norms.py; rotary embeddings: rope.py).

Each has a plain torch path (the reference) and, when the csrc kernels are built (`ops`), a fused one:
one C++ call instead of a chain of eager ops (csrc/fused_cpu.cpp, tested against these references).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, TypeGuard

import torch
import torch.nn.functional as F
from torch import nn

from worker.host_memory import empty_on_huge_pages

if TYPE_CHECKING:
    from worker.csrc_ops import CpuOps
    from worker.quant.blocks import QuantPart

logger = logging.getLogger("engine.worker")


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, ops: CpuOps | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            return self.ops.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        # Same order of operations as Hugging Face: normalize in float32, cast back, then scale.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """residual + x becomes the new residual; returns (its norm, the new residual). Reuses x and residual."""
        if self.ops is not None:
            self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        residual = x + residual
        return self.forward(residual), residual


def silu_and_mul(gate_up: torch.Tensor, ops: CpuOps | None = None) -> torch.Tensor:
    """gate_up: [num_tokens, 2 * inter] -> silu(gate) * up, [num_tokens, inter]."""
    if ops is not None:
        return ops.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


PACK_BATCH_HINT = 64  # oneDNN picks the blocked layout for this many rows; any number of rows works
# Products of up to this many rows take the pair layout where it is used (use_pairs). Isolated, the two
# kernels are level from 96 to 256 rows and oneDNN is ahead from 512; in the model, where each product's
# weights come from memory, whole steps on the pair kernel against oneDNN above 64 rows (one engine,
# switching every step; EPYC, 2026-12-01): 128-row steps 0.958, 256 0.968 (0.989 for chunks of 1,000-token
# prompts), 512 0.984 (0.963), 1,024 1.022, 2,048 1.035
# (benchmarks/results/2026-11-29-lab-notes-performance.md, "Where a c=64 wave's steps go now").
PAIRS_ROWS = 512
# a pad_rows product at least this wide takes the pair layout padded to 64 columns (invariant_kernel)
PADDED_PAIRS_MIN = 4096
NO_BIAS = torch.empty(0)
A8_BIT = 256  # on a packed part's type: its product quantizes x to int8 (csrc/quant_a8.h)


class Embedding(nn.Embedding):
    """nn.Embedding without the random initialization: its weight comes from the checkpoint, or stays a
    GGUF file's blocks (`quant`, csrc quant_rows dequantizes the rows a step looks up)."""

    quant: QuantPart | None = None
    ops: CpuOps | None = None

    def reset_parameters(self) -> None:
        pass

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            assert self.ops is not None  # finalize_quant sets the two together
            part, ids = self.quant, input_ids.reshape(-1)
            rows = self.ops.quant_rows(part.packed, part.qtype, ids, self.embedding_dim, self.weight.dtype)
            return rows.view(*input_ids.shape, self.embedding_dim)
        return super().forward(input_ids)

    def add_quant(self, part: QuantPart) -> None:
        self.quant = part

    @property
    def quant_nbytes(self) -> int:
        return self.quant.nbytes if self.quant is not None else 0

    def finalize_quant(self, ops: CpuOps, slot: torch.Tensor | None = None) -> None:
        assert self.quant is not None
        if slot is not None:
            slot.copy_(self.quant.packed.view(-1))
            self.quant.packed = slot.view(self.quant.packed.shape)
        self.ops = ops
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)


class Linear(nn.Linear):
    """nn.Linear (same parameters, same checkpoint names) whose weight `pack()` reorders once for oneDNN.

    A bf16 product on the CPU otherwise reorders the weight into oneDNN's blocked layout on every call,
    which costs more than the product itself at decode batch sizes
    (benchmarks/results/2026-11-29-lab-notes-performance.md, "Decode step, in-process"). The packed
    copy replaces the plain weight. Where the csrc kernels have AVX-512 BF16 and no AMX, a second copy
    in csrc's pair layout serves products of up to PAIRS_ROWS rows: decode steps, which oneDNN's
    kernels there run well below the rate the machine reads the weights at, and prefill steps of up to
    512 tokens, where the pair kernel's reading ahead keeps the next weights coming.
    """

    packed: torch.Tensor | None = None
    pairs: torch.Tensor | None = None
    rows: torch.Tensor | None = None  # csrc linear_rows' layout (batch-invariant products)
    amx = False  # pairs serve every row count on AMX tiles (csrc linear_amx; batch-invariant products)
    pairs_rows = PAIRS_ROWS  # products of up to this many rows take the pairs layout, when there is one
    ops: CpuOps | None = None
    # a width short of a multiple of 16 may take linear_rows padded (a MoE router's 8 experts), or from
    # PADDED_PAIRS_MIN wide the pair layout padded (Whisper's logits); not for the products of the decoder
    # stack, which reads the width off the packing
    pad_rows = False
    pairs_bias: torch.Tensor | None = None  # the bias padded as the pair layout's padded width (else None)
    # a GGUF file's blocks kept packed, in place of the weight: each part a run of output rows (a fused
    # product's q, k and v may each have a type of their own); csrc linear_quant (batch-invariant)
    quant: list[QuantPart] | None = None
    quant_bytes: torch.Tensor | None = None  # the parts back to back (finalize_quant)
    quant_parts: torch.Tensor | None = None
    shared_order: torch.Tensor | None = None  # act-order: the input order all parts share (finalize_quant)
    int8_activations = False  # the products quantize their rows to int8 (take_int8_activations)

    def add_quant(self, part: QuantPart) -> None:
        if self.quant and any(p.activations != part.activations for p in self.quant):
            raise ValueError("a fused product's parts quantize their activations differently")
        self.quant = sorted([*(self.quant or []), part], key=lambda p: p.start)

    @property
    def activations(self) -> str | None:
        """How the checkpoint quantizes this product's activations (QuantWeight.activations)."""
        return self.quant[0].activations if self.quant else None

    def finalize_quant(self, ops: CpuOps, slot: torch.Tensor | None = None) -> None:
        """Serve from the packed parts (which load_checkpoint checked cover every row), back to back in one
        uint8 buffer (slot: where, on huge pages; else a new tensor), described by `quant_parts` (csrc
        linear_quant_parts: type, first row, rows, byte offset per part); the weight is dropped."""
        assert self.quant is not None
        sizes = [part.nbytes for part in self.quant]
        flat = slot if slot is not None else torch.empty(sum(sizes), dtype=torch.uint8)
        offset, rows = 0, []
        for part, size in zip(self.quant, sizes, strict=True):
            view = flat[offset : offset + size]
            view.copy_(part.packed.view(-1))
            rows.append([part.qtype, part.start, part.out_features, offset])
            part.packed = view.view(part.packed.shape)
            offset += size
        self.quant_bytes, self.quant_parts = flat, torch.tensor(rows, dtype=torch.int64)
        self.shared_order = self._shared_order()
        self.ops = ops
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def take_int8_activations(self) -> None:
        """--activation-quantization int8: every part's product takes x quantized to int8 per 32 dims (csrc
        quant_a8.cpp), the parts' types carrying its bit (A8_BIT), which the csrc stack and the experts'
        tables read as they are."""
        assert self.quant_parts is not None
        self.quant_parts[:, 0] |= A8_BIT
        self.int8_activations = True

    @property
    def quant_nbytes(self) -> int:
        return sum(part.nbytes for part in self.quant or [])

    def share_quant(self, part: QuantPart, ops: CpuOps | None) -> None:
        """Serve from another module's finalized blocks (a tied lm_head: the embedding's)."""
        assert ops is not None
        self.quant, self.quant_bytes, self.ops = [part], part.packed.view(-1), ops
        self.quant_parts = torch.tensor([[part.qtype, 0, part.out_features, 0]], dtype=torch.int64)
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def _shared_order(self) -> torch.Tensor | None:
        """The one input order every part takes, where they share it (act-order GPTQ orders a module's input
        dims by its input's statistics, so q, k and v, and gate and up, come in one order)."""
        orders = [part.order for part in self.quant or []]
        first = orders[0] if orders else None
        if first is None or any(o is None or not torch.equal(o, first) for o in orders[1:]):
            return None
        return first

    @property
    def ordered(self) -> bool:
        """Whether a part takes its inputs permuted (act-order, QuantPart.order): the csrc decoder stack,
        which runs every part on the same rows, does not serve it."""
        return any(part.order is not None for part in self.quant or [])

    def _quant_forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.quant_bytes is not None and self.quant_parts is not None and self.ops is not None
        dtype = x.dtype
        rows = x.reshape(-1, self.in_features)
        if dtype not in (torch.float32, torch.bfloat16):  # float16: the products take float32 rows
            rows = rows.float()
        bias = self.bias if self.bias is not None else NO_BIAS
        if self.ordered:
            assert self.quant is not None
            shared = self.shared_order
            if shared is not None:  # every part in one order (GPTQ's q, k and v share their input's)
                rows = self.ops.gather_columns(rows, shared)
            else:  # part by part, each on its own order of x's columns
                outputs = []
                for part in self.quant:
                    inputs = rows if part.order is None else self.ops.gather_columns(rows, part.order)
                    part_bias = (
                        bias[part.start : part.start + part.out_features]
                        if self.bias is not None
                        else NO_BIAS
                    )
                    quant = self.ops.linear_quant_a8 if self.int8_activations else self.ops.linear_quant
                    outputs.append(quant(inputs, part.packed, part.qtype, part_bias, part.out_features))
                return torch.cat(outputs, dim=1).to(dtype).view(*x.shape[:-1], self.out_features)
        # W8A8: each row quantized to int8 per token, int32 sums (csrc/quant_w8a8.cpp)
        product = self.ops.linear_w8a8_parts if self.activations is not None else self.ops.linear_quant_parts
        y = product(rows, self.quant_bytes, self.quant_parts, bias, self.out_features)
        if y.dtype == dtype and x.dim() == 2:  # (a decode step's case: no dispatch for a no-op)
            return y
        return y.to(dtype).view(*x.shape[:-1], self.out_features)

    def reset_parameters(self) -> None:
        """Nothing: every weight comes from the checkpoint (`load_weights` checks that none is missing)."""

    def pack(self, ops: CpuOps | None = None) -> None:
        weight = self.weight.detach()
        if use_pairs(ops) and weight.shape[0] % 64 == 0 and weight.shape[1] % 2 == 0:
            self.pairs, self.ops = ops.pack_pairs(weight), ops
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def invariant_kernel(self, ops: CpuOps) -> str | None:
        """The one kernel every row count takes in batch-invariant mode (docs/batch-invariance.md), in bf16:
        "amx" where the CPU has AMX (csrc linear_amx), else "pairs" where it has AVX-512 BF16; else "rows"
        (csrc linear_rows); None where none takes this shape (the plain product stays, and is not
        batch-invariant)."""
        out_features, in_features = self.weight.shape
        # a wide product that may be padded (Whisper's 51,865 logits) takes the pair layout padded to 64
        # columns: 2.3 against 6.8 ms for linear_rows at 16 rows (Zen 4); a narrow one (a router) stays on rows
        fits = out_features % 64 == 0 or (self.pad_rows and out_features >= PADDED_PAIRS_MIN)
        if self.weight.dtype == torch.bfloat16 and ops.pairs_available():
            if fits and in_features % 32 == 0 and ops.has_amx():
                return "amx"
            if fits and in_features % 2 == 0:
                return "pairs"
        if self.weight.dtype in (torch.float32, torch.bfloat16) and (out_features % 16 == 0 or self.pad_rows):
            return "rows"
        return None

    @property
    def rows_shape(self) -> tuple[int, int, int]:
        """linear_rows' layout of this weight: [ceil(out / 16), in, 16]."""
        out_features, in_features = self.weight.shape
        return (-(-out_features // 16), in_features, 16)

    def pack_invariant(self, ops: CpuOps, slot: torch.Tensor | None = None) -> None:
        """Pack for invariant_kernel(ops), which must not be None; slot: where the rows layout goes (a
        buffer on huge pages), else a new tensor. The plain weight is dropped."""
        weight = self.weight.detach()
        kind = self.invariant_kernel(ops)
        if kind in ("amx", "pairs"):
            if weight.shape[0] % 64:  # zero rows up to a multiple of 64; forward drops their columns
                width = -(-weight.shape[0] // 64) * 64
                weight = torch.cat([weight, weight.new_zeros(width - weight.shape[0], weight.shape[1])])
                if self.bias is not None:
                    self.pairs_bias = torch.cat(
                        [self.bias.detach(), self.bias.new_zeros(width - self.out_features)]
                    )
            self.pairs, self.pairs_rows, self.amx = ops.pack_pairs(weight), 1 << 62, kind == "amx"
        else:
            assert kind == "rows", "a shape no batch-invariant kernel takes"
            groups, in_features, _ = self.rows_shape
            rows = slot if slot is not None else torch.empty(self.rows_shape, dtype=weight.dtype)
            if weight.shape[0] % 16:  # padded with zero columns
                rows.copy_(ops.pack_rows(weight))
            else:  # [out, in] -> [out / 16, 16, in] -> [out / 16, in, 16] in one strided pass: pack_rows'
                rows.copy_(weight.view(groups, 16, in_features).transpose(1, 2))
            self.rows = rows
        self.ops = ops
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self._quant_forward(x)
        if self.rows is not None:
            assert self.ops is not None  # pack_invariant sets the two together
            bias = self.bias if self.bias is not None else NO_BIAS
            return self.ops.linear_rows(x, self.rows, bias, self.out_features)
        if self.pairs is not None and (self.amx or x.shape[0] <= self.pairs_rows):
            assert self.ops is not None  # pack() and pack_invariant() set the two together
            padded = self.pairs_bias if self.pairs_bias is not None else self.bias
            product = self.ops.linear_amx if self.amx else self.ops.linear_pairs
            y: torch.Tensor = product(x, self.pairs, padded if padded is not None else NO_BIAS)
            return y if y.shape[-1] == self.out_features else y[..., : self.out_features]
        if self.packed is not None:
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
            return out
        return F.linear(x, self.weight, self.bias)

    def gelu(self, x: torch.Tensor) -> torch.Tensor:
        """GELU (exact) of the product. Where forward would take oneDNN's packed path, oneDNN applies it to
        the float32 sums as they are written (no second pass over the output; in bf16 one rounding instead of
        two); elsewhere the product, then F.gelu. Whisper's encoder: 150 against 179 ms a 24,000 x 512 x 2,048
        product in bf16 (Zen 4); in float32 the same bits either way."""
        onednn = self.quant is None and self.rows is None and not self.amx and self.packed is not None
        if onednn and not (self.pairs is not None and x.shape[0] <= self.pairs_rows):
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
                x, self.packed, self.bias, "gelu", [], "none"
            )
            return out
        return F.gelu(self(x))


def pairs_onto_huge_pages(linears: list[Linear]) -> None:
    """Move the pair-layout weights into one buffer on huge pages (worker/host_memory.py), one at a time so
    that each copy frees its original: a decode step reads every one of them, and on 4 KiB pages the
    products at one row took 12% longer (benchmarks/results/2026-11-29-lab-notes-performance.md, "Huge pages
    and 64-token blocks"). linear_rows' layout goes onto huge pages as it is packed (CausalLM.finalize)."""
    linears = [linear for linear in linears if linear.pairs is not None]
    if not linears:
        return
    slots = empty_on_huge_pages([tuple(_pairs(linear).shape) for linear in linears], _pairs(linears[0]).dtype)
    for linear, slot in zip(linears, slots, strict=True):
        slot.copy_(_pairs(linear))
        linear.pairs = slot


def _pairs(linear: Linear) -> torch.Tensor:
    """The pair-layout weight of a Linear that pairs_onto_huge_pages kept for having one."""
    assert linear.pairs is not None
    return linear.pairs


def use_pairs(ops: CpuOps | None) -> TypeGuard[CpuOps]:
    """Where the csrc kernels have AVX-512 BF16 and the CPU has no AMX. Not measured on AMX CPUs with
    this kernel; there a GEMV of this kind was level with oneDNN at one row and slower from two rows on
    (docs/performance.md, "Tried and not landed")."""
    return ops is not None and bool(ops.pairs_available()) and not ops.has_amx()


def can_pack(dtype: torch.dtype) -> bool:
    """Packing pays for bf16 (AMX / AVX-512 BF16 kernels); float32 products keep MKL's path."""
    if dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    try:
        weight = torch.zeros(8, 8, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(1, 8, dtype=dtype), packed, None, "none", [], "")
    except (RuntimeError, AttributeError) as error:
        logger.info("oneDNN weight packing unavailable (%s); using F.linear", error)
        return False
    return True
