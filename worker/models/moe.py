"""A mixture-of-experts MLP: a router scores the experts for each token, its top k run, and their outputs,
weighted, are summed (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss); a shared expert, gated by a sigmoid, may
run on every token beside them (Qwen2-MoE).

Routers (ModelConfig.moe_router): "softmax" takes the top k of the softmax over all experts (in float32),
renormalized to sum to 1 where norm_topk_prob (Mixtral always; Qwen by its config); "topk_softmax" takes
the top k logits and softmaxes those (gpt-oss, whose router has a bias). DeepSeek's group their experts
(n_group) and keep the best topk_group groups' experts eligible: "softmax_grouped" (V2) ranks groups by
their best softmax score, "sigmoid_grouped" (V3) scores experts by a sigmoid, chooses by score plus a
learned bias (`score_bias`), ranks groups by their two best, and weighs the chosen by their score alone.
Every router's weights end times routed_scaling_factor (1 but for DeepSeek).

With the csrc kernels the router's choice is route_experts (csrc/route_cpu.cpp: each row alone, in one
order), and the experts run in one csrc call (csrc/moe_cpu.cpp fused_experts: each expert present takes its rows in
one product, and each row's experts are summed in ascending expert id, the order transformers' loop adds
them); `Experts.reference` is that loop in torch, the path without the kernels and the kernel's oracle.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from worker.model_config import ModelConfig
from worker.models.layers import Linear
from worker.models.mlp import MLP, activation

if TYPE_CHECKING:
    from worker.csrc_ops import CpuOps
    from worker.lora.slots import LoraBatch
    from worker.parallel.group import TensorParallelGroup
    from worker.quant.blocks import QuantPart

ROUTERS = ("softmax", "topk_softmax", "softmax_grouped", "sigmoid_grouped")
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
        outputs to a zero sum. A row's result is its own whatever else the step holds."""
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


class SparseMoE(nn.Module):
    """The MLP of a mixture-of-experts layer: router (`gate`, as checkpoints name it), experts, and the
    optional shared expert with its sigmoid gate."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        ops: CpuOps | None,
        index: int = 0,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp  # config holds this rank's slice of every expert's width; the sum is all-reduced
        self.index = index  # the layer's (its adapters' slots)
        if config.moe_router not in ROUTERS:
            raise ValueError(f"unknown router {config.moe_router!r}; known: {', '.join(ROUTERS)}")
        self.top_k, self.router, self.ops = config.num_experts_per_tok, config.moe_router, ops
        self.norm_topk_prob = config.norm_topk_prob
        self.groups, self.top_groups = config.n_group, config.topk_group
        self.scaling = config.routed_scaling_factor
        self.score_bias = (
            nn.Parameter(torch.empty(config.num_experts, dtype=torch.float32), requires_grad=False)
            if config.moe_router == "sigmoid_grouped"
            else None
        )
        self.gate = Linear(config.hidden_size, config.num_experts, bias=config.router_bias, dtype=dtype)
        self.gate.pad_rows = True
        self.experts = Experts(config, dtype, ops)
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: Linear | None = None
        if config.shared_expert_intermediate_size:
            shared = dataclasses.replace(config, intermediate_size=config.shared_expert_intermediate_size)
            self.shared_expert = MLP(shared, dtype, ops, index)
            if config.shared_expert_gate:
                self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False, dtype=dtype)
                self.shared_expert_gate.pad_rows = True

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (ids [T, K] int64, weights [T, K] float32): csrc route_experts, each row alone."""
        logits = self.gate(x)  # [T, E]
        if self.ops is None:
            return self.route_reference(logits)
        bias = self.score_bias if self.score_bias is not None else NO_BIAS
        ids, weights = self.ops.route_experts(
            logits, ROUTERS.index(self.router), self.top_k, self.norm_topk_prob, self.scaling, bias,
            self.groups, self.top_groups,
        )  # fmt: skip
        return ids, weights

    def route_reference(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' routers in torch, of the router's logits [T, E]."""
        if self.router == "topk_softmax":
            top, ids = torch.topk(logits, self.top_k, dim=-1)
            return ids, F.softmax(top.float(), dim=-1) * self.scaling
        if self.router == "sigmoid_grouped":
            assert self.score_bias is not None
            scores = torch.sigmoid(logits.float())
            choice = self._eligible(scores + self.score_bias, lambda g: g.topk(2, dim=-1).values.sum(-1))
            ids = torch.topk(choice, self.top_k, dim=-1, sorted=False).indices
            weights = scores.gather(1, ids)
            if self.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
            return ids, weights * self.scaling
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        if self.router == "softmax_grouped":
            probs = self._eligible(probs, lambda g: g.max(dim=-1).values, 0.0)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights * self.scaling if self.scaling != 1.0 else weights

    def _eligible(
        self,
        scores: torch.Tensor,
        group_score: Callable[[torch.Tensor], torch.Tensor],
        fill: float = -math.inf,
    ) -> torch.Tensor:
        """scores [T, E] with the experts outside each row's topk_group best groups set to `fill`."""
        grouped = scores.view(scores.shape[0], self.groups, -1)  # [T, groups, E / groups]
        best = torch.topk(group_score(grouped), self.top_groups, dim=-1, sorted=False).indices
        keep = torch.zeros(grouped.shape[:2], dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep[:, :, None], fill).view_as(scores)

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        ids, weights = self.route(x)
        shared = gate = None
        if self.shared_expert is not None:
            gate = self.shared_expert_gate(x) if self.shared_expert_gate is not None else None
            shared = self.shared_expert(x)
        if lora is not None and lora.on_experts():
            out = self.with_adapters(x, ids, weights, shared, gate, lora)
        else:
            out = self.experts(x, ids, weights, shared, gate)
        return out if self.tp is None else self.tp.all_reduce(out)

    def with_adapters(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        shared: torch.Tensor | None,
        gate: torch.Tensor | None,
        lora: LoraBatch,
    ) -> torch.Tensor:
        """Rows whose adapter targets the experts take Experts.adapted; the others fused_experts, as without."""
        rows = lora.expert_rows
        others = torch.ones(len(x), dtype=torch.bool)
        others[rows] = False
        out = torch.empty_like(x)

        def part(t: torch.Tensor | None, at: torch.Tensor) -> torch.Tensor | None:
            return t[at] if t is not None else None

        if bool(others.any()):
            out[others] = self.experts(
                x[others], ids[others], weights[others], part(shared, others), part(gate, others)
            )
        adapted = self.experts.adapted(x[rows], ids[rows], weights[rows], lora.select(rows), self.index)
        out[rows] = self.experts.with_shared(adapted, part(shared, rows), part(gate, rows))
        return out
