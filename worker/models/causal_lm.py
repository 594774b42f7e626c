"""A decoder-only language model of any family: embedding (and its multiplier), the layers
(worker/models/decoder.py), final norm, logits (their scale and soft-capping); its weights from the
checkpoint (worker/models/checkpoint.py), packed for the kernels, and the csrc stack where it serves.

tp: a tensor-parallel rank's model (worker/parallel/): config then holds the rank's heads and intermediate
size, and the embedding and lm_head hold its shard of the vocabulary.
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
from worker.models.checkpoint import load_checkpoint
from worker.models.decoder import DecoderLayer
from worker.models.experts import Experts
from worker.models.layers import Embedding, Linear, can_pack, pairs_onto_huge_pages
from worker.models.mla import LatentAttention
from worker.models.native import (
    layer_kinds,
    native_shape,
    native_stack_serves,
    native_weights,
    stack_products,
)
from worker.models.norms import OffsetRMSNorm, make_norm
from worker.models.rope import RotaryEmbedding
from worker.parallel.sharding import vocab_shard

if TYPE_CHECKING:
    from worker.csrc_ops import CpuOps
    from worker.lora.slots import LoraBatch
    from worker.parallel.group import TensorParallelGroup

logger = logging.getLogger("engine.worker")


class CausalLM(nn.Module):
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
        self.norm = make_norm(
            config.norm, config.hidden_size, config.rms_norm_eps, dtype, ops, config.norm_bias
        )
        self.lm_head = Linear(config.hidden_size, vocab_rows, bias=False, dtype=dtype)
        # *ForSequenceClassification: the `score` head over the last token's normed hidden state
        self.score = ScoreHead(config.hidden_size, config.num_labels, dtype) if config.num_labels else None
        self.rotaries: dict[str, RotaryEmbedding] = {}
        # The layers' weights for the csrc stack (csrc/decoder_cpu.cpp), set by finalize() when it is built.
        self.native_layers: list[list[torch.Tensor]] | None = None
        # native_shape, layer_kinds, the stack's scalars (eps, scale, soft-cap, residual multiplier)
        self.native_config: tuple[list[int], dict[bool, list[int]], list[float]] = ([], {}, [])
        self.batch_invariant = False  # finalize() says

    def init_rotary(self, max_position: int, device: torch.device) -> None:
        """The rotary tables: "global" (every rotating layer, or the full ones) and, when the family gives
        its sliding layers a base of their own, "local"."""
        config = self.config
        rotary_dim = config.qk_rope_head_dim or config.rotary_dim or config.head_dim  # MLA: its rope part
        bases = {"global": (config.rope_theta, config.rope_scaling)}
        if config.rope_local_theta:
            bases["local"] = (config.rope_local_theta, None)
        self.rotaries = {
            kind: RotaryEmbedding(rotary_dim, max_position, base, scaling, device, config.rope_interleaved)
            for kind, (base, scaling) in bases.items()
        }

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        backend: AttentionBackend,
        out_rows: torch.Tensor | None = None,
        lora: LoraBatch | None = None,
        mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:  # [len(out_rows) or num_tokens, hidden], before the final norm
        """out_rows: the rows the step scores (sampled tokens, prompt logprobs), in the order wanted; None
        for all. Past the last layer's KV write no other row is needed, so that layer's attention, o and
        MLP run on these rows alone (llama.cpp's inp_out_ids): in a prefill step most of a layer.
        lora: the step's adapters, where a row uses one (a step with none keeps the native stack).
        mm_embeds: (rows, embeddings): image embeddings in place of those rows' token embeddings (after the
        family's embedding multiplier, as transformers' vision-language models put them)."""
        assert self.rotaries, "init_rotary() first"
        x: torch.Tensor = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        if self.config.embedding_multiplier != 1.0:  # in the model's dtype, as Gemma's normalizer is
            x = x * torch.tensor(self.config.embedding_multiplier, dtype=x.dtype)
        if mm_embeds is not None:
            image_rows, image_embeds = mm_embeds
            x[image_rows] = image_embeds.to(x.dtype)
        ropes = {
            kind: rotary.prepare(positions, x.dtype, self.ops, metadata.long_rope, metadata.prompt_lens)
            for kind, rotary in self.rotaries.items()
        }
        window_group = metadata.window_group  # the windowed layers' pool, where they have one
        if self.native_layers is not None and not metadata.image_runs:
            rows = backend.paged_rows(metadata, x.shape[0], kv_caches[0].shape[2])
            pools = [metadata.slot_block_ids, metadata.slot_offsets, *rows] if rows is not None else None
            if pools is not None and window_group is not None:
                window_rows = backend.paged_rows(window_group, x.shape[0], kv_caches[0].shape[2])
                pools = (
                    pools + [window_group.slot_block_ids, window_group.slot_offsets, *window_rows]
                    if window_rows is not None
                    else None
                )
            if pools is not None:  # every layer in one native call: the same kernels, no Python between them
                assert self.ops is not None  # finalize() builds native_layers only with the kernels
                rope_tables = [t for kind in ("global", "local") if kind in ropes
                               for t in (ropes[kind].cos, ropes[kind].sin, ropes[kind].positions)]  # fmt: skip
                shape, kinds, scalars = self.native_config
                x, residual = self.ops.decoder_layers(
                    x, self.native_layers, rope_tables, kv_caches, pools, shape, kinds[window_group is not None],
                    scalars, out_rows, *(lora.native() if lora is not None else (None, None)),
                )  # fmt: skip
                return x + residual
        stream: torch.Tensor | None = None  # the residual stream before the last layer's output
        last = len(self.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            pool = window_group if window_group is not None and self.config.is_sliding(i) else metadata
            x, stream = layer(
                x, stream, ropes, kv_cache, pool, backend, out_rows if i == last else None, lora
            )
        assert stream is not None  # the model has at least one layer
        return x + stream

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [n, hidden] rows to score -> [n, vocab] logits in the model's dtype (the sampler
        converts to float32 where it needs to), scaled and soft-capped as the family says."""
        logits: torch.Tensor = self.lm_head(self.norm(hidden))
        config = self.config
        if config.logits_scale != 1.0:
            logits = logits * config.logits_scale
        if config.final_softcap:
            logits = torch.tanh(logits / config.final_softcap) * config.final_softcap
        return logits

    def classify(self, rows: torch.Tensor) -> torch.Tensor:
        """rows: [n, hidden], each input's last hidden state after the final norm -> [n, num_labels]."""
        assert self.score is not None
        logits: torch.Tensor = self.score(rows)
        return logits

    def finalize(
        self, batch_invariant: bool = False, pack: bool = True, int8_activations: bool = False
    ) -> None:
        """After loading: tie the output projection to the embedding, pack weights for oneDNN where it pays,
        or, batch-invariant, for the one product kernel every row count takes (docs/batch-invariance.md).
        pack False: the weights stay as loaded (the CUDA worker moves them to the GPU). int8_activations:
        the products on packed blocks quantize their rows to int8 (--activation-quantization int8)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        quantized = [m for m in self.modules() if isinstance(m, (Linear, Embedding)) and m.quant is not None]
        if quantized:
            assert self.ops is not None, (
                "quantized weights kept packed need the csrc kernels (worker/quant/method.py)"
            )
            # one buffer on huge pages, as the other packings: a decode step reads every byte of it
            slots = empty_on_huge_pages([(m.quant_nbytes,) for m in quantized], torch.uint8)
            for holder, slot in zip(quantized, slots, strict=True):
                holder.finalize_quant(self.ops, slot)
        embedding = self.embed_tokens
        if (
            self.config.tie_word_embeddings
            and isinstance(embedding, Embedding)
            and embedding.quant is not None
        ):
            self.lm_head.share_quant(embedding.quant, embedding.ops)  # the embedding's blocks, not a copy
        if int8_activations:
            for module in self.modules():
                if isinstance(module, Linear) and module.quant_parts is not None:
                    module.take_int8_activations()
        for module in self.modules():
            if isinstance(module, (OffsetRMSNorm, LatentAttention)):
                module.finalize()
        if not pack:
            return
        for module in self.modules():
            if isinstance(module, Experts):
                module.pack()
        self.batch_invariant = batch_invariant and self.ops is not None
        if batch_invariant and self.ops is None:
            logger.warning("batch-invariant products need the csrc kernels; this model runs torch's")
        linears = [module for module in self.modules() if isinstance(module, Linear) and module.quant is None]
        if self.batch_invariant:
            assert self.ops is not None
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
            for linear in linears:
                linear.pack(self.ops)  # the tied lm_head packs a copy: the embedding keeps its plain one
            pairs_onto_huge_pages(linears)
        # NOTE: the native stack runs every layer in one C++ call, with no way out for an all-reduce
        if self.ops is not None and hasattr(self.ops, "decoder_layers") and self.tp is None:
            # (packed GGUF products take float32 or bf16 rows)
            dtype_ok = not quantized or self.embed_tokens.weight.dtype in (torch.float32, torch.bfloat16)
            # (experts kept packed without expert_loop' table run the Python loop: act-order ones)
            packed_experts = any(
                isinstance(m, Experts) and m.quantized is not None and m.quant_table is None
                for m in self.modules()
            )
            # (act-order products take their inputs permuted: the stack's own products do it, others not)
            ordered = [m for m in self.modules() if isinstance(m, Linear) and m.ordered]
            if ordered and native_stack_serves(self.config):
                on_stack = {id(p) for layer in self.layers for p in stack_products(cast(DecoderLayer, layer))}
                on_stack |= {  # experts kept as blocks: expert_loop takes their orders
                    id(p) for m in self.modules() if isinstance(m, Experts) and m.quant_table is not None
                    for p in m.modules()
                }  # fmt: skip
                ordered = [m for m in ordered if id(m) not in on_stack]
            # (latent attention's absorbed products on linear_rows: float32 and bf16 weights)
            latent_ok = all(m.uk_stack is not None for m in self.modules() if isinstance(m, LatentAttention))
            if (
                native_stack_serves(self.config)
                and dtype_ok
                and not packed_experts
                and not ordered
                and latent_ok
            ):
                self.native_layers = [native_weights(cast(DecoderLayer, layer)) for layer in self.layers]
                # (fixed once finalized: read per step, they took ~0.1 ms of a 4.4 ms SmolLM2 step)
                first = cast(DecoderLayer, self.layers[0])
                config = self.config
                self.native_config = (
                    native_shape(first, config),
                    {pool: layer_kinds(self.layers, pool) for pool in (False, True)},
                    [
                        config.rms_norm_eps,
                        first.self_attn.scale,
                        config.attn_softcap,
                        config.residual_multiplier,
                    ],
                )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], packed: bool = False) -> None:
        load_checkpoint(self, self.config, weights, packed)


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
