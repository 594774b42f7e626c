"""The Llama family (Llama 2/3, Mistral, SmolLM2, TinyLlama) and Qwen2/Qwen3, on paged attention.

Tokens are flattened across requests: every tensor is [num_tokens, ...]; attention reads and writes
the paged KV cache through the backend, so the model never sees padding.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from worker.attention import AttentionBackend, AttentionMetadata
from worker.host_memory import empty_on_huge_pages
from worker.model_config import ModelConfig
from worker.models.layers import (
    Embedding,
    Linear,
    RMSNorm,
    Rope,
    RotaryEmbedding,
    can_pack,
    pairs_onto_huge_pages,
    silu_and_mul,
)
from worker.parallel.sharding import vocab_shard

if TYPE_CHECKING:
    from worker.csrc_ops import CpuOps
    from worker.lora.slots import LoraBatch
    from worker.parallel.group import TensorParallelGroup


logger = logging.getLogger("engine.worker")


class Attention(nn.Module):
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
        self.tp = tp  # config holds this rank's heads; o_proj's partial sums are all-reduced
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        hidden = config.hidden_size
        self.qkv_proj = Linear(
            hidden, self.q_size + 2 * self.kv_size, bias=config.attention_bias, dtype=dtype
        )
        self.o_proj = Linear(self.q_size, hidden, bias=False, dtype=dtype)
        eps = config.rms_norm_eps
        self.q_norm = RMSNorm(self.head_dim, eps, dtype, ops) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps, dtype, ops) if config.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        rope: Rope,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        backend: AttentionBackend,
        out_rows: torch.Tensor | None = None,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        """out_rows: the rows to return (all when None); every row's keys and values are written.
        lora: the step's adapters (of out_rows' rows for o_proj), added to each product they target."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [num_tokens, q_size + 2 * kv_size]
        if lora is not None:
            lora.add(self.index, "qkv", x, qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [num_tokens, heads, head_dim]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [num_tokens, kv_heads, head_dim]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope.apply(q, k)
        out = backend.forward(q, k, v, kv_cache, metadata, self.scale)  # [num_tokens, heads, head_dim]
        if out_rows is not None:
            out = out.index_select(0, out_rows)
        out = out.reshape(-1, self.q_size)
        projected: torch.Tensor = self.o_proj(out)  # [num_tokens, hidden]
        if lora is not None:
            (lora if out_rows is None else lora.select(out_rows)).add(self.index, "o", out, projected)
        if self.tp is not None:
            projected = self.tp.all_reduce(projected)
        return projected


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
        inter = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * inter, bias=False, dtype=dtype)
        self.down_proj = Linear(inter, config.hidden_size, bias=False, dtype=dtype)
        self.ops = ops

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        # [num_tokens, hidden]
        if lora is None:
            out: torch.Tensor = self.down_proj(silu_and_mul(self.gate_up_proj(x), self.ops))
        else:
            gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * inter]
            lora.add(self.index, "gate_up", x, gate_up)
            hidden = silu_and_mul(gate_up, self.ops)  # [num_tokens, inter]
            out = self.down_proj(hidden)
            lora.add(self.index, "down", hidden, out)
        return out if self.tp is None else self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        ops: CpuOps | None,
        index: int = 0,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, ops)
        self.self_attn = Attention(config, dtype, ops, index, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, ops)
        self.mlp = MLP(config, dtype, ops, index, tp)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: Rope,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        backend: AttentionBackend,
        out_rows: torch.Tensor | None = None,
        lora: LoraBatch | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's output, the residual stream before it); their sum is the hidden state,
        of the rows out_rows names (all when None).

        Keeping the two apart lets the next norm fuse the residual add (HF's rounding is the same).
        """
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.add_and_norm(x, residual)
        x = self.self_attn(x, rope, kv_cache, metadata, backend, out_rows, lora)
        if out_rows is not None:
            residual = residual.index_select(0, out_rows)
            if not len(out_rows):
                return x, residual  # nothing scored: the keys and values were all this layer had to give
            if lora is not None:
                lora = lora.select(out_rows)
        x, residual = self.post_attention_layernorm.add_and_norm(x, residual)
        return self.mlp(x, lora), residual


class LlamaForCausalLM(nn.Module):
    """Also Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm), chosen by ModelConfig flags.

    tp: a tensor-parallel rank's model (worker/parallel/): config then holds the rank's heads and
    intermediate size, and the embedding and lm_head hold its shard of the vocabulary."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        ops: CpuOps | None = None,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.ops = ops  # the csrc kernels, or None for the plain torch path
        self.tp = tp
        vocab_rows = config.vocab_size if tp is None else vocab_shard(config.vocab_size, tp.rank, tp.size)[1]
        self.embed_tokens = (
            Embedding(vocab_rows, config.hidden_size, dtype=dtype)
            if tp is None
            else VocabParallelEmbedding(vocab_rows, config.hidden_size, dtype, tp)
        )
        self.layers = nn.ModuleList(DecoderLayer(config, dtype, ops, i, tp) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, ops)
        self.lm_head = Linear(config.hidden_size, vocab_rows, bias=False, dtype=dtype)
        # *ForSequenceClassification: the `score` head over the last token's normed hidden state
        self.score = ScoreHead(config.hidden_size, config.num_labels, dtype) if config.num_labels else None
        self.rotary: RotaryEmbedding | None = None
        # The layers' weights for the csrc stack (csrc/decoder_cpu.cpp), set by finalize() when it is built.
        self.native_layers: list[list[torch.Tensor]] | None = None
        self.batch_invariant = False  # finalize() says

    def init_rotary(self, max_position: int, device: torch.device) -> None:
        config = self.config
        self.rotary = RotaryEmbedding(
            config.head_dim, max_position, config.rope_theta, config.rope_scaling, device
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        backend: AttentionBackend,
        out_rows: torch.Tensor | None = None,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:  # [len(out_rows) or num_tokens, hidden], before the final norm
        """out_rows: the rows the step scores (sampled tokens, prompt logprobs), in the order wanted; None
        for all. Past the last layer's KV write no other row is needed, so that layer's attention, o and
        MLP run on these rows alone (llama.cpp's inp_out_ids): in a prefill step most of a layer.
        lora: the step's adapters, where a row uses one (a step with none keeps the native stack)."""
        assert self.rotary is not None
        x: torch.Tensor = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        residual: torch.Tensor | None = None
        rope = self.rotary.prepare(positions, x.dtype, self.ops)
        if self.native_layers is not None:
            rows = backend.paged_rows(metadata, x.shape[0], kv_caches[0].shape[2])
            if rows is not None:  # every layer in one native call: the same kernels, no Python between them
                first = cast(DecoderLayer, self.layers[0])
                attention, packed = first.self_attn, first.mlp.down_proj.packed is not None
                shape = [
                    attention.num_heads,
                    attention.num_kv_heads,
                    attention.head_dim,
                    int(packed),
                    first.mlp.down_proj.pairs_rows,
                ]
                assert self.ops is not None  # finalize() builds native_layers only with the kernels
                x, residual = self.ops.decoder_layers(
                    x, self.native_layers, rope.cos, rope.sin, positions, kv_caches, metadata.slot_block_ids,
                    metadata.slot_offsets, *rows, shape, [self.config.rms_norm_eps, attention.scale], out_rows,
                    *(lora.native() if lora is not None else (None, None)),
                )  # fmt: skip
                return x + residual
        last = len(self.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x, residual = layer(
                x, residual, rope, kv_cache, metadata, backend, out_rows if i == last else None, lora
            )
        assert residual is not None  # the model has at least one layer
        return x + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [n, hidden] rows to score -> [n, vocab] logits in the model's dtype (the sampler
        converts to float32 where it needs to)."""
        logits: torch.Tensor = self.lm_head(self.norm(hidden))
        return logits

    def classify(self, rows: torch.Tensor) -> torch.Tensor:
        """rows: [n, hidden], each input's last hidden state after the final norm -> [n, num_labels]."""
        assert self.score is not None
        logits: torch.Tensor = self.score(rows)
        return logits

    def finalize(self, batch_invariant: bool = False, pack: bool = True) -> None:
        """After loading: tie the output projection to the embedding, pack weights for oneDNN where it pays,
        or, batch-invariant, for the one product kernel every row count takes (docs/batch-invariance.md).
        pack False: the weights stay as loaded (the CUDA worker moves them to the GPU)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        if not pack:
            return
        self.batch_invariant = batch_invariant and self.ops is not None
        if batch_invariant and self.ops is None:
            logger.warning("batch-invariant products need the csrc kernels; this model runs torch's")
        if self.batch_invariant:
            assert self.ops is not None
            linears = [module for module in self.modules() if isinstance(module, Linear)]
            kinds = [linear.invariant_kernel(self.ops) for linear in linears]
            if None in kinds:
                logger.warning(
                    "%d products have a shape the batch-invariant kernels do not take; they stay variant",
                    kinds.count(None),
                )
            rows = [linear for linear, kind in zip(linears, kinds, strict=True) if kind == "rows"]
            # packed straight onto huge pages: each copy of the weights is new memory to fault in, the
            # larger part of a start's packing time
            slots = empty_on_huge_pages(
                [linear.rows_shape for linear in rows], self.embed_tokens.weight.dtype
            )
            for linear, slot in zip(rows, slots, strict=True):
                linear.pack_invariant(self.ops, slot)
            for linear, kind in zip(linears, kinds, strict=True):
                if kind in ("amx", "pairs"):
                    linear.pack_invariant(self.ops)
            pairs_onto_huge_pages(linears)
        elif can_pack(self.embed_tokens.weight.dtype):
            for module in self.modules():
                if isinstance(module, Linear):
                    module.pack(self.ops)  # the tied lm_head packs a copy: the embedding keeps its plain one
            pairs_onto_huge_pages([module for module in self.modules() if isinstance(module, Linear)])
        # NOTE: the native stack runs every layer in one C++ call, with no way out for an all-reduce
        if self.ops is not None and hasattr(self.ops, "decoder_layers") and self.tp is None:
            self.native_layers = [native_weights(cast(DecoderLayer, layer)) for layer in self.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        config = self.config
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        stacked = {
            "q_proj": ("qkv_proj", 0, q_size),
            "k_proj": ("qkv_proj", q_size, kv_size),
            "v_proj": ("qkv_proj", q_size + kv_size, kv_size),
            "gate_proj": ("gate_up_proj", 0, config.intermediate_size),
            "up_proj": ("gate_up_proj", config.intermediate_size, config.intermediate_size),
        }
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue
            target, rows = name, None
            for part, (merged, start, size) in stacked.items():
                if f".{part}." in name:
                    target, rows = name.replace(part, merged), (start, size)
                    break
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            with torch.no_grad():
                if rows is None:
                    param.copy_(tensor.view(param.shape))
                else:
                    param[rows[0] : rows[0] + rows[1]].copy_(tensor)
            loaded.add(f"{name}")
        expected = self._expected_checkpoint_names()
        missing = expected - {n.removeprefix("model.") for n in loaded}
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {sorted(missing)[:3]}")

    def _expected_checkpoint_names(self) -> set[str]:
        names: set[str] = set()
        for name, _ in self.named_parameters():
            if "qkv_proj" in name:
                names.update(name.replace("qkv_proj", p) for p in ("q_proj", "k_proj", "v_proj"))
            elif "gate_up_proj" in name:
                names.update(name.replace("gate_up_proj", p) for p in ("gate_proj", "up_proj"))
            elif name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            else:
                names.add(name)
        return names


class VocabParallelEmbedding(nn.Module):
    """A rank's rows of the embedding; a token another rank holds reads zeros here, and the all-reduce
    gives every rank each token's one row (x + 0 is exact, so the sum is the row itself)."""

    def __init__(self, rows: int, hidden_size: int, dtype: torch.dtype, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden_size, dtype=dtype))
        self.first = tp.rank * rows
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.first  # [num_tokens]
        inside = (local >= 0) & (local < self.weight.shape[0])
        x = torch.nn.functional.embedding(torch.where(inside, local, 0), self.weight)  # [num_tokens, hidden]
        x[~inside] = 0
        return self.tp.all_reduce(x)


class ScoreHead(nn.Module):
    """HF's `score` (a bias-free Linear to a few labels) as each row's own float32 dot products: every
    row's logits are the same whatever else is in the batch, and no product kernel takes 1-3 outputs."""

    def __init__(self, hidden_size: int, num_labels: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_labels, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        products = rows.float().unsqueeze(1) * self.weight.float()  # [n, labels, hidden]
        return products.sum(-1).to(rows.dtype)


def native_weights(layer: DecoderLayer) -> list[torch.Tensor]:
    """One layer's weights in csrc/decoder_cpu.cpp's order; an empty tensor for an absent bias or norm."""
    attention, mlp, none = layer.self_attn, layer.mlp, torch.empty(0)

    def weight(linear: Linear) -> torch.Tensor:
        return (linear.packed if linear.packed is not None else linear.weight).detach()

    def optional(module: nn.Module | None, name: str) -> torch.Tensor:
        tensor = getattr(module, name, None) if module is not None else None
        return tensor.detach() if tensor is not None else none

    def packing(linear: Linear) -> torch.Tensor:
        """csrc's packing of a product: linear_rows' 3-d, linear_amx's 5-d view of the pairs, the pairs 4-d."""
        if linear.amx:
            assert linear.pairs is not None
            groups, kpairs, width, two = linear.pairs.shape
            return linear.pairs.view(groups, kpairs // 16, 16, width, two)
        return optional(linear, "rows" if linear.rows is not None else "pairs")

    linears = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)

    return [
        layer.input_layernorm.weight.detach(), weight(attention.qkv_proj), optional(attention.qkv_proj, "bias"),
        weight(attention.o_proj), layer.post_attention_layernorm.weight.detach(), weight(mlp.gate_up_proj),
        weight(mlp.down_proj), optional(attention.q_norm, "weight"), optional(attention.k_norm, "weight"),
        *(packing(linear) for linear in linears),
    ]  # fmt: skip
