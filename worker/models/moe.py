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
order), and the experts run in one csrc call (worker/models/experts.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from worker.model_config import ModelConfig
from worker.models.experts import NO_BIAS, Experts
from worker.models.layers import Linear
from worker.models.mlp import MLP

if TYPE_CHECKING:
    from worker.csrc_ops import CpuOps
    from worker.lora.slots import LoraBatch
    from worker.parallel.group import TensorParallelGroup

ROUTERS = ("softmax", "topk_softmax", "softmax_grouped", "sigmoid_grouped")


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
