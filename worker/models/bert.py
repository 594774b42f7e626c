"""BERT-family encoders (BertModel; BertForSequenceClassification's `classifier` head), for pooling.

An encoder's attention is bidirectional over its whole input, so it runs beside the paged KV cache, not
on it: each input of a step is one segment [start, end) of the flattened tokens, attended to by itself
(no mask, no padding, no other input in it; csrc encoder_attention, every segment in one call, or torch's
scaled_dot_product_attention a segment at a time), and nothing is written to a cache. Nothing would read it
back: a pooling request is one prefill step, an encoder's input is never chunked (its first token attends
to its last), and a prefix cache would hold keys that depend on the tokens after them. Each segment alone
is also what keeps an input's vector independent of the rest of the batch (docs/batch-invariance.md): the
products are the model's Linear kernels, the layer norms and GELU are row by row.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from worker.model_config import ModelConfig, UnsupportedModelError
from worker.models.layers import Embedding, Linear, can_pack

if TYPE_CHECKING:
    from worker.csrc_ops import CpuOps

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "relu": F.relu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm without the initialization: its weight and bias come from the checkpoint."""

    def reset_parameters(self) -> None:
        pass


class BertLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, ops: CpuOps | None = None) -> None:
        super().__init__()
        self.ops = ops
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.qkv = Linear(hidden, 3 * hidden, bias=True, dtype=dtype)  # query, key, value stacked
        self.attention_out = Linear(hidden, hidden, bias=True, dtype=dtype)
        self.attention_norm = LayerNorm(hidden, eps, dtype=dtype)
        self.intermediate = Linear(hidden, config.intermediate_size, bias=True, dtype=dtype)
        self.output = Linear(config.intermediate_size, hidden, bias=True, dtype=dtype)
        self.output_norm = LayerNorm(hidden, eps, dtype=dtype)
        self.activation = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, hidden]; segments: int64 [S, 2], each input's [start, end) rows."""
        num_tokens, hidden = x.shape
        qkv = self.qkv(x)
        if self.ops is not None:  # csrc/encoder_attention_cpu.cpp: every segment and head in one call
            q, k, v = qkv[:, :hidden], qkv[:, hidden : 2 * hidden], qkv[:, 2 * hidden :]
            attended = self.ops.encoder_attention(q, k, v, segments, self.num_heads, self.head_dim**-0.5)
        else:
            attended = self.torch_attention(qkv, segments)
        x = self.attention_norm(self.attention_out(attended.view(num_tokens, hidden)) + x)
        result: torch.Tensor = self.output_norm(self.output(self.activation(self.intermediate(x))) + x)
        return result

    def torch_attention(self, qkv: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
        """The same with torch's scaled_dot_product_attention, a call per segment (2.6x the csrc kernel's
        time in bf16 at 28 inputs of ~73 tokens, Zen 4)."""
        num_tokens = qkv.shape[0]
        qkv = qkv.view(num_tokens, 3, self.num_heads, self.head_dim)
        attended = torch.empty(num_tokens, self.num_heads, self.head_dim, dtype=qkv.dtype)
        for start, end in segments.tolist():
            # [1, heads, n, head_dim] each, contiguous: torch's fused CPU kernel (flash attention) takes
            # these; strided 3-d views fell back to its unfused math path, 2.5x the time
            q, k, v = qkv[start:end].permute(1, 2, 0, 3).contiguous().unsqueeze(1).unbind(0)
            out = F.scaled_dot_product_attention(q, k, v)  # [1, heads, n, head_dim]
            attended[start:end] = out[0].transpose(0, 1)
        return attended


class BertModel(nn.Module):
    """The last hidden state of every token (HF BertModel's `last_hidden_state`, post-layer-norm). With
    `num_labels`, also the classifier of BertForSequenceClassification over the tanh pooler of [CLS]."""

    is_encoder = True

    def __init__(self, config: ModelConfig, dtype: torch.dtype, ops: CpuOps | None = None) -> None:
        super().__init__()
        self.config, self.ops = config, ops
        hidden = config.hidden_size
        self.word_embeddings = Embedding(config.vocab_size, hidden, dtype=dtype)
        self.position_embeddings = Embedding(config.max_position_embeddings, hidden, dtype=dtype)
        self.token_type_embeddings = Embedding(max(config.type_vocab_size, 1), hidden, dtype=dtype)
        self.embeddings_norm = LayerNorm(hidden, config.rms_norm_eps, dtype=dtype)
        self.layers = nn.ModuleList(BertLayer(config, dtype, ops) for _ in range(config.num_layers))
        self.classifier: Linear | None = None
        self.pooler: Linear | None = None
        if config.num_labels:
            self.pooler = Linear(hidden, hidden, bias=True, dtype=dtype)
            self.classifier = Linear(hidden, config.num_labels, bias=True, dtype=dtype)
        self.batch_invariant = False

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens], from 0 in each input
        segments: list[tuple[int, int]],
        token_type_ids: torch.Tensor | None = None,  # [num_tokens]; None: all type 0
    ) -> torch.Tensor:  # [num_tokens, hidden]
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        if token_type_ids is None:
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        x = self.embeddings_norm(x)
        bounds = torch.tensor(segments, dtype=torch.int64).view(-1, 2)
        for layer in self.layers:
            x = layer(x, bounds)
        hidden: torch.Tensor = x
        return hidden

    def classify(self, first_rows: torch.Tensor) -> torch.Tensor:
        """first_rows: [n, hidden], each input's [CLS] row -> [n, num_labels] logits."""
        assert self.pooler is not None and self.classifier is not None
        logits: torch.Tensor = self.classifier(torch.tanh(self.pooler(first_rows)))
        return logits

    def finalize(
        self, batch_invariant: bool = False, pack: bool = True, int8_activations: bool = False
    ) -> None:
        """Pack the products: for the one kernel every row count takes (batch-invariant), else for oneDNN.
        pack False: as loaded (unused: pooling runs on the CPU worker)."""
        if int8_activations:  # (--activation-quantization int8: none of its weights are kept packed)
            raise UnsupportedModelError(
                "--activation-quantization int8: BERT keeps no quantized weights packed"
            )
        if not pack:
            return
        linears = [module for module in self.modules() if isinstance(module, Linear)]
        self.batch_invariant = batch_invariant and self.ops is not None
        for linear in linears:
            if self.batch_invariant and self.ops is not None and linear.invariant_kernel(self.ops):
                linear.pack_invariant(self.ops)
            elif can_pack(self.word_embeddings.weight.dtype):
                linear.pack(self.ops)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        hidden = self.config.hidden_size
        stacked = {"query": 0, "key": 1, "value": 2}
        loaded: set[str] = set()
        for name, tensor in weights:
            target = checkpoint_name_to_ours(name)
            if target is None:
                continue
            offset = None
            for part, index in stacked.items():
                if f".attention.self.{part}." in name:
                    offset = index * hidden
            param = params.get(target)
            if param is None and target.startswith("pooler."):
                continue  # a bare BertModel's pooler: embeddings pool the hidden states themselves
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            with torch.no_grad():
                if offset is None:
                    param.copy_(tensor.view(param.shape))
                else:
                    param[offset : offset + hidden].copy_(tensor)
            loaded.add(target if offset is None else f"{target}#{offset}")
        expected = {f"{name}#{i * hidden}" if ".qkv." in name else name for name in params for i in range(3)}
        missing = expected - loaded
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {sorted(missing)[:3]}")


# HF BertModel's names (bare, or under `bert.` in *ForSequenceClassification) -> ours
_LAYER_PARTS = {
    "attention.self.query": "qkv",
    "attention.self.key": "qkv",
    "attention.self.value": "qkv",
    "attention.output.dense": "attention_out",
    "attention.output.LayerNorm": "attention_norm",
    "intermediate.dense": "intermediate",
    "output.dense": "output",
    "output.LayerNorm": "output_norm",
}
_GLOBAL_PARTS = {
    "embeddings.word_embeddings": "word_embeddings",
    "embeddings.position_embeddings": "position_embeddings",
    "embeddings.token_type_embeddings": "token_type_embeddings",
    "embeddings.LayerNorm": "embeddings_norm",
    "pooler.dense": "pooler",
    "classifier": "classifier",
}


def checkpoint_name_to_ours(name: str) -> str | None:
    """None for what the model has no use for (position_ids buffers; the pooler of a bare BertModel)."""
    name = name.removeprefix("bert.")
    kind = name.rsplit(".", 1)[-1]
    if kind == "gamma":  # old checkpoints' LayerNorm names
        kind = "weight"
    elif kind == "beta":
        kind = "bias"
    if kind not in ("weight", "bias"):
        return None
    stem = name.rsplit(".", 1)[0]
    if stem.startswith("encoder.layer."):
        index, part = stem.removeprefix("encoder.layer.").split(".", 1)
        ours = _LAYER_PARTS.get(part)
        return None if ours is None else f"layers.{index}.{ours}.{kind}"
    ours = _GLOBAL_PARTS.get(stem)
    return None if ours is None else f"{ours}.{kind}"
