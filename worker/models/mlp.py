"""A decoder layer's MLP: gated (down(act(gate) * up), gate and up one fused product) or plain
(down(act(up)): StarCoder2, GPT-NeoX), with the family's activation and optional biases."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from worker.model_config import ModelConfig
from worker.models.layers import Linear, silu_and_mul

if TYPE_CHECKING:
    from worker.csrc_ops import CpuOps
    from worker.lora.slots import LoraBatch
    from worker.parallel.group import TensorParallelGroup


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """transformers' ACT2FN of the names ModelConfig keeps (worker/models/families/base.py ACTIVATIONS)."""
    if name == "silu":
        return F.silu(x)
    if name in ("gelu_tanh", "gelu"):
        approximate = "tanh" if name == "gelu_tanh" else "none"
        if x.dtype in (torch.bfloat16, torch.float16) and x.device.type == "cpu":
            # NOTE: torch's CPU GELU on bf16 takes 8 ms for 16 x 2048 values (tanh; 1.1 ms exact) where the
            # same in float32 takes 0.5 ms: computed in float32 and rounded once, as torch's bf16 op does
            return F.gelu(x.float(), approximate=approximate).to(x.dtype)
        return F.gelu(x, approximate=approximate)
    if name == "gelu_fast":
        return 0.5 * x * (1.0 + torch.tanh(x * math.sqrt(2 / math.pi) * (1.0 + 0.044715 * x * x)))
    if name == "relu":
        return F.relu(x)
    raise ValueError(f"unknown activation {name!r}")


class MLP(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        ops: CpuOps | None,
        index: int = 0,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.index = index  # the layer's, for its LoRA slots
        self.tp = tp  # config holds this rank's share of the intermediate size; down's sums are all-reduced
        self.act, self.gated = config.hidden_act, config.mlp == "gated"
        inter, bias = config.intermediate_size, config.mlp_bias
        if self.gated:
            self.gate_up_proj = Linear(config.hidden_size, 2 * inter, bias=bias, dtype=dtype)
        else:
            self.up_proj = Linear(config.hidden_size, inter, bias=bias, dtype=dtype)
        self.down_proj = Linear(inter, config.hidden_size, bias=bias, dtype=dtype)
        self.ops = ops

    def act_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[num_tokens, 2 * inter] -> act(gate) * up, [num_tokens, inter]."""
        if self.act == "silu":
            return silu_and_mul(gate_up, self.ops)
        if self.act == "gelu_tanh" and self.ops is not None and gate_up.device.type == "cpu":
            return self.ops.gelu_tanh_and_mul(gate_up)  # csrc: the decoder stack's kernel too
        gate, up = gate_up.chunk(2, dim=-1)
        return activation(self.act, gate) * up

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        # [num_tokens, hidden]
        if not self.gated:
            up = self.up_proj(x)  # [num_tokens, inter]
            if lora is not None:
                lora.add(self.index, "gate_up", x, up)  # a plain MLP's gate_up slots hold up alone
            hidden = activation(self.act, up)
            out: torch.Tensor = self.down_proj(hidden)
            if lora is not None:
                lora.add(self.index, "down", hidden, out)
        elif lora is None:
            out = self.down_proj(self.act_and_mul(self.gate_up_proj(x)))
        else:
            gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * inter]
            lora.add(self.index, "gate_up", x, gate_up)
            hidden = self.act_and_mul(gate_up)  # [num_tokens, inter]
            out = self.down_proj(hidden)
            lora.add(self.index, "down", hidden, out)
        return out if self.tp is None else self.tp.all_reduce(out)
