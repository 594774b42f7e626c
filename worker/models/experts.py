"""The experts of a mixture-of-experts layer (worker/models/moe.py routes tokens to them): every expert's
gated MLP as stacked weights, packed once for csrc fused_experts (csrc/moe_cpu.cpp: each expert present takes
its rows in one product, and each row's experts are summed in ascending expert id, the order transformers'
loop adds them); `Experts.reference` is that loop in torch, the path without the kernels and the kernel's
oracle. Quantized experts (a GGUF file's blocks) stay packed and run one expert at a time: csrc
expert_loop (csrc/moe_loop_cpu.cpp), or `packed_experts`, its reference in Python.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from worker.model_config import ModelConfig
from worker.models.layers import Linear
from worker.models.mlp import activation

if TYPE_CHECKING:
    from worker.csrc_ops import CpuOps
    from worker.lora.slots import LoraBatch
    from worker.quant.blocks import QuantPart

# the experts' gated activations, by fused_experts' number: "swiglu_clamped" is gpt-oss's
EXPERT_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "swiglu_clamped": 2}
NO_BIAS = torch.empty(0)


class Experts(nn.Module):
    """Every expert's gated MLP: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I], optional
    biases [E, 2I] and [E, H]; packed once for fused_experts by pack()."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, ops: CpuOps | None) -> None:
        super().__init__()
        experts, hidden, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.act = config.moe_act
        self.alpha, self.limit = config.swiglu_alpha, config.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inter, hidden, dtype=dtype), False)
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, inter, dtype=dtype), False)
        self.gate_up_proj_bias = (
            nn.Parameter(torch.empty(experts, 2 * inter, dtype=dtype), False) if config.expert_bias else None
        )
        self.down_proj_bias = (
            nn.Parameter(torch.empty(experts, hidden, dtype=dtype), False) if config.expert_bias else None
        )
        self.ops = ops
        self.w13: torch.Tensor | None = None  # packed for fused_experts
        self.w2: torch.Tensor | None = None
        self.pairs = False  # w13 and w2 in pack_pairs' layout (else pack_rows')
        # quantized experts kept packed (a GGUF file's blocks): each expert's gate_up and down as Linears
        # holding their parts (Linear.add_quant), run one expert at a time (forward)
        self.quantized: nn.ModuleList | None = None
        # for csrc expert_loop: every expert's blocks (one span of the model's buffer) and a table of
        # each expert's parts, [E, P + 1, 4] (quant_table)
        self.quant_bytes: torch.Tensor | None = None
        self.quant_table: torch.Tensor | None = None
        # act-order experts: each expert's parts' input orders, [E, P, H] and [E, 1, I] (quant_table_of)
        self.quant_orders: tuple[torch.Tensor, torch.Tensor] | None = None

    def add_quant(self, expert: int, part: str, quant: QuantPart) -> None:
        """One expert's gate_proj, up_proj or down_proj, packed (worker/models/checkpoint.py)."""
        if self.quantized is None:
            (experts, inter2, hidden), inter = self.gate_up_proj.shape, self.down_proj.shape[2]
            dtype, biased = self.gate_up_proj.dtype, self.gate_up_proj_bias is not None
            self.quantized = nn.ModuleList(
                nn.ModuleList([Linear(hidden, inter2, bias=biased, dtype=dtype), Linear(inter, hidden, bias=biased, dtype=dtype)])
                for _ in range(experts)
            )  # fmt: skip
        self.expert_products(expert)[1 if part == "down_proj" else 0].add_quant(quant)

    def expert_products(self, expert: int) -> tuple[Linear, Linear]:
        """A packed expert's gate_up and down products."""
        assert self.quantized is not None
        gate_up, down = cast(nn.ModuleList, self.quantized[expert])
        return cast(Linear, gate_up), cast(Linear, down)

    def pack(self, pairs: bool = True) -> None:
        """Pack every expert's two products for fused_experts: pack_pairs' layout for bf16 where the kernels
        have AVX-512 BF16 and the shapes allow (and `pairs`), else pack_rows' (float32, or bf16 elsewhere).
        Experts kept packed as their blocks drop the float weights instead (never written: no memory)."""
        if self.quantized is not None:
            partial = [
                i for i in range(len(self.quantized)) if any(m.quant is None for m in self.expert_products(i))
            ]
            if partial:
                raise ValueError(
                    f"experts {partial[:3]} are partly packed: a checkpoint mixing float and blocks"
                )
            if self.gate_up_proj_bias is not None and self.down_proj_bias is not None:  # each expert's own
                for expert in range(len(self.quantized)):
                    first, second = self.expert_products(expert)
                    assert first.bias is not None and second.bias is not None
                    first.bias.data.copy_(self.gate_up_proj_bias[expert])
                    second.bias.data.copy_(self.down_proj_bias[expert])
            self.quant_bytes, self.quant_table = self.quant_table_of()
            self.quant_orders = self.quant_orders_of() if self.quant_table is not None else None
            empty = torch.empty(0, dtype=self.gate_up_proj.dtype)
            self.gate_up_proj = nn.Parameter(empty, requires_grad=False)
            self.down_proj = nn.Parameter(empty.clone(), requires_grad=False)
            return
        ops = self.ops
        if ops is None or self.gate_up_proj.dtype not in (torch.float32, torch.bfloat16):
            return
        gate_up, down = self.gate_up_proj.detach(), self.down_proj.detach()
        (_, inter2, hidden), inter = gate_up.shape, down.shape[2]
        pairs = (
            pairs
            and gate_up.dtype == torch.bfloat16
            and ops.pairs_available()
            and inter2 % 64 == 0
            and hidden % 64 == 0
            and inter % 2 == 0
        )
        pack = ops.pack_pairs if pairs else ops.pack_rows
        self.pairs = pairs
        self.w13 = torch.stack([pack(w) for w in gate_up])
        self.w2 = torch.stack([pack(w) for w in down])
        empty = torch.empty(0, dtype=gate_up.dtype)
        self.gate_up_proj = nn.Parameter(empty, requires_grad=False)
        self.down_proj = nn.Parameter(empty.clone(), requires_grad=False)

    def quant_table_of(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The experts' blocks as expert_loop takes them: one uint8 span over every expert's (which
        CausalLM.finalize laid back to back in one buffer) and each expert's parts at their offsets in it;
        (None, None) where they do not lie in one buffer or where gate_up's parts differ in number between
        experts."""
        products = [p for e in range(len(self.quantized or [])) for p in self.expert_products(e)]
        held = [p.quant_bytes for p in products if p.quant_bytes is not None and p.quant_parts is not None]
        if not products or len(held) != len(products):
            return None, None
        storage = held[0].untyped_storage().data_ptr()
        if any(b.untyped_storage().data_ptr() != storage for b in held):
            return None, None
        if len({len(p.quant or []) for p in products[::2]}) != 1 or any(
            len(p.quant or []) != 1 for p in products[1::2]
        ):
            return None, None
        first = min(b.data_ptr() for b in held)
        end = max(b.data_ptr() + b.numel() for b in held)
        base = held[0]  # a view of the buffer: the span from the lowest expert's first byte on
        span = torch.as_strided(base, (end - first,), (1,), base.storage_offset() + first - base.data_ptr())
        rows = []
        for product, held_bytes in zip(products, held, strict=True):
            assert product.quant_parts is not None
            parts = product.quant_parts.clone()
            parts[:, 3] += held_bytes.data_ptr() - first  # offsets into the span
            rows.append(parts)
        table = torch.stack([torch.cat(rows[i : i + 2]) for i in range(0, len(rows), 2)])
        return span, table

    def quant_orders_of(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Act-order experts' input orders, each part's (its natural order where it has none): gate_up's [E,
        P, H] and down's [E, 1, I]; None where no expert's part has one."""
        products = [p for e in range(len(self.quantized or [])) for p in self.expert_products(e)]
        if not any(p.ordered for p in products):
            return None

        def orders(linear: Linear) -> torch.Tensor:
            natural = torch.arange(linear.in_features, dtype=torch.int64)
            return torch.stack([natural if part.order is None else part.order for part in linear.quant or []])

        return torch.stack([orders(p) for p in products[::2]]), torch.stack(
            [orders(p) for p in products[1::2]]
        )

    def forward(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        shared: torch.Tensor | None = None,
        shared_gate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [T, H]; ids [T, K] int64, each row's experts; weights [T, K] float32 -> [T, H]. shared: a
        shared expert's output [T, H], added times sigmoid(shared_gate [T, 1]) (or 1 without a gate)."""
        if self.quantized is not None:
            native = x.dtype in (torch.float32, torch.bfloat16)  # (float16 rows: the loop's float32 products)
            if self.quant_table is not None and self.ops is not None and native:  # the loop below, in C++
                assert self.quant_bytes is not None
                return self.ops.expert_loop(
                    x, ids, weights, self.quant_bytes, self.quant_table, self.bias_or_none(False),
                    self.bias_or_none(True), EXPERT_ACTIVATIONS[self.act], self.alpha, self.limit,
                    NO_BIAS if shared is None else shared,
                    NO_BIAS if shared_gate is None else shared_gate.view(-1), None,
                    list(self.quant_orders) if self.quant_orders is not None else None,
                )  # fmt: skip
            return self.with_shared(self.packed_experts(x, ids, weights), shared, shared_gate)
        if self.w13 is None:
            out = self.reference(x, ids, weights)
            if shared is not None:
                out = out + (torch.sigmoid(shared_gate) * shared if shared_gate is not None else shared)
            return out
        assert self.ops is not None and self.w2 is not None
        b13 = self.gate_up_proj_bias if self.gate_up_proj_bias is not None else NO_BIAS
        b2 = self.down_proj_bias if self.down_proj_bias is not None else NO_BIAS
        return self.ops.fused_experts(
            x, ids, weights, self.w13, self.w2, b13, b2, EXPERT_ACTIVATIONS[self.act], self.alpha, self.limit,
            NO_BIAS if shared is None else shared,
            NO_BIAS if shared_gate is None else shared_gate.float().view(-1),
        )  # fmt: skip

    def bias_or_none(self, down: bool) -> torch.Tensor:
        bias = self.down_proj_bias if down else self.gate_up_proj_bias
        return bias.detach() if bias is not None else NO_BIAS

    @staticmethod
    def with_shared(
        out: torch.Tensor, shared: torch.Tensor | None, shared_gate: torch.Tensor | None
    ) -> torch.Tensor:
        """The experts' sum plus a shared expert's output, gated (the loops' form of fused_experts' shared)."""
        if shared is not None and shared_gate is not None:
            # the sigmoid in float64, rounded once: torch's float32 sigmoid of a [T, 1] tensor takes its
            # scalar or its vector loop by T (fused_experts computes it in C++ for that reason)
            return out + torch.sigmoid(shared_gate.double()).to(shared.dtype) * shared
        return out + shared if shared is not None else out

    def product(self, expert: int, down: bool, x: torch.Tensor) -> torch.Tensor:
        """One expert's gate_up (down False) or down product of x, as it is held: its blocks, packed for
        fused_experts, or the float weight."""
        if self.quantized is not None:
            out: torch.Tensor = self.expert_products(expert)[1 if down else 0](x)
            return out
        bias = self.down_proj_bias if down else self.gate_up_proj_bias
        packed = self.w2 if down else self.w13
        if packed is None:
            return F.linear(
                x, (self.down_proj if down else self.gate_up_proj)[expert], self._bias(bias, expert)
            )
        assert self.ops is not None
        b = bias[expert] if bias is not None else NO_BIAS
        if self.pairs:
            return self.ops.linear_pairs(x.contiguous(), packed[expert], b)
        width = packed.shape[1] * packed.shape[3]  # pack_rows: [out / 16, in, 16]
        return self.ops.linear_rows(x.contiguous(), packed[expert], b, width)

    def adapted(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, lora: LoraBatch, layer: int
    ) -> torch.Tensor:
        """The reference's loop for rows whose adapter targets the experts: each expert hit, in ascending id,
        adds its rows' B (A x) to its gate_up and down products (lora_add, each row alone) and their weighted
        outputs to a zero sum. A row's result is its own whatever else the step holds. The csrc decoder stack
        runs the same loop in C++ (expert_loop with the rows' adapters)."""
        out = torch.zeros_like(x, dtype=torch.float32)
        for expert in torch.unique(ids).tolist():
            rows, slot = torch.where(ids == expert)
            xr = x[rows]
            both = self.product(expert, False, xr)
            lora.add_expert(layer, "gate_up", expert, xr, both, rows)
            hidden = self.activate(both)
            y = self.product(expert, True, hidden)
            lora.add_expert(layer, "down", expert, hidden, y, rows)
            out.index_add_(0, rows, y.float() * weights[rows, slot, None])
        return out.to(x.dtype)

    def activate(self, both: torch.Tensor) -> torch.Tensor:
        """The gated activation of a gate_up product [rows, 2I]: the dense MLP's (and fused_experts') numbers."""
        if self.act == "silu" and self.ops is not None:
            return self.ops.silu_and_mul(both)
        if self.act == "gelu_tanh" and self.ops is not None:
            return self.ops.gelu_tanh_and_mul(both)
        return self.gated(both)

    def packed_experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The reference's loop on experts kept packed: each expert hit, in ascending id, runs its rows through
        its two packed products (batch-invariant, csrc/quant_cpu.cpp) and adds them, weighted, into a zero
        sum: a row's result is its own whatever else the step holds."""
        assert self.quantized is not None
        out = torch.zeros_like(x, dtype=torch.float32)
        for expert in torch.unique(ids).tolist():
            rows, slot = torch.where(ids == expert)
            gate_up, down = self.expert_products(expert)
            hidden = self.activate(gate_up(x[rows]))
            out.index_add_(0, rows, down(hidden).float() * weights[rows, slot, None])
        return out.to(x.dtype)

    def gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The experts' gated activation in torch, [rows, 2I] (gate first) -> [rows, I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        if self.act == "swiglu_clamped":
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
            return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        return activation(self.act, gate) * up

    def reference(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """transformers' loop: each expert hit, in ascending id, adds its weighted rows into a zero sum."""
        out = torch.zeros_like(x, dtype=torch.float32)
        for expert in torch.unique(ids).tolist():
            rows, slot = torch.where(ids == expert)
            gate_up = F.linear(x[rows], self.gate_up_proj[expert], self._bias(self.gate_up_proj_bias, expert))
            y = F.linear(self.gated(gate_up), self.down_proj[expert], self._bias(self.down_proj_bias, expert))
            out.index_add_(0, rows, y.float() * weights[rows, slot, None])
        return out.to(x.dtype)

    @staticmethod
    def _bias(bias: torch.Tensor | None, expert: int) -> torch.Tensor | None:
        return bias[expert] if bias is not None else None
