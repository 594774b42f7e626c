"""Whisper (WhisperForConditionalGeneration): an audio encoder run once per request, and a text decoder on
the paged KV cache that attends to the encoder's output.

The encoder turns a [num_mel_bins, 2 * encoder_len] log-mel window into encoder_len hidden rows (two
convolutions, the second of stride 2, fixed sinusoidal positions, pre-norm layers with bidirectional
attention over the input alone). Each decoder layer then projects those rows once into the request's
cross-attention keys and values (`encode`), which the worker keeps for the request's life in a paged pool of
their own (worker/cross_attention.py), read by the csrc decode kernel; the decoder's own self-attention is
paged like any other model's.

As transformers does, a query is scaled before its product with the keys (its order of operations, for
float32 results equal to the oracle's), and Whisper's k_proj has no bias. Each self-attention's q, k and v
are one product (k's bias zeros; the query's scale, a power of two, folded into its rows, exact), and the
cross-attention keys and values of every decoder layer are one product over the encoder's rows, in the
pool's row layout. A row's result depends on its own
request alone: the products are the model's Linear kernels, norms and GELU are row by row, and
cross-attention is the decode kernel's row by row (or, without the kernels, each request's own SDPA call).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from worker.attention import AttentionBackend, AttentionMetadata
from worker.model_config import ModelConfig, UnsupportedModelError
from worker.models.bert import LayerNorm
from worker.models.layers import Embedding, Linear, can_pack
from worker.models.whisper_weights import folds, load_whisper_weights

if TYPE_CHECKING:
    from worker.csrc_ops import CpuOps

NO_SINKS = torch.empty(0)  # paged_decode_attention's "no attention sinks"


@dataclass
class CrossBatch:
    """A step's cross-attention: the caches, each row's blocks and key count, each request's rows."""

    caches: list[torch.Tensor]  # per decoder layer: [blocks, 2, block_size, heads, head_dim]
    tables: torch.Tensor  # [num_tokens, blocks_per_entry] (long): each row's request's blocks
    seq_lens: torch.Tensor  # [num_tokens] (long): encoder_len for every row
    segments: list[tuple[int, int, int]]  # (first row, end row, slot) of each request

    def keys_values(self, layer: int, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """An entry's keys and values, [heads, length, head_dim] each (the torch path)."""
        cache = self.caches[layer]
        blocks = self.tables.shape[1]
        run = cache[slot * blocks : (slot + 1) * blocks]  # [blocks, 2, block_size, heads, head_dim]
        flat = run.transpose(0, 1).reshape(2, -1, *run.shape[3:])[
            :, :length
        ]  # a copy: [2, length, heads, hd]
        return flat[0].transpose(0, 1), flat[1].transpose(0, 1)


class SelfProjections(nn.Module):
    """A self-attention's products: q, k and v stacked in one (load_weights), and out."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.qkv = Linear(hidden, 3 * hidden, bias=True, dtype=dtype)
        self.out_proj = Linear(hidden, hidden, bias=True, dtype=dtype)
        # the query's scale where load_weights could not fold it into the rows exactly (not a power of two)
        self.q_scale = 1.0 if folds(config.head_dim**-0.5) else config.head_dim**-0.5

    def split(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [rows, hidden] -> q (scaled), k and v: column views of one product, sharing its row stride."""
        qkv = self.qkv(h)
        hidden = qkv.shape[1] // 3
        q, k, v = qkv[:, :hidden], qkv[:, hidden : 2 * hidden], qkv[:, 2 * hidden :]
        if self.q_scale != 1.0:
            q.mul_(self.q_scale)  # in place, rounded as transformers' q_proj(h) * scale
        return q, k, v


class CrossProjections(nn.Module):
    """A cross-attention's query and out products (its keys and values: WhisperModel.cross_kv)."""

    def __init__(self, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.q_proj = Linear(hidden, hidden, bias=True, dtype=dtype)
        self.out_proj = Linear(hidden, hidden, bias=True, dtype=dtype)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc1 = Linear(config.hidden_size, config.intermediate_size, bias=True, dtype=dtype)
        self.fc2 = Linear(config.intermediate_size, config.hidden_size, bias=True, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(self.fc1.gelu(x))
        return out


class Conv1d(nn.Conv1d):
    """nn.Conv1d without the initialization: its weights come from the checkpoint."""

    def reset_parameters(self) -> None:
        pass


class EncoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, ops: CpuOps | None = None) -> None:
        super().__init__()
        self.ops = ops  # csrc encoder_attention, or None: torch's scaled_dot_product_attention
        hidden = config.hidden_size
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.self_attn_layer_norm = LayerNorm(hidden, config.rms_norm_eps, dtype=dtype)
        self.self_attn = SelfProjections(config, dtype)
        self.final_layer_norm = LayerNorm(hidden, config.rms_norm_eps, dtype=dtype)
        self.mlp = MLP(config, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_inputs, encoder_len, hidden]; each input attends to itself alone."""
        batch, length, hidden = x.shape
        attn = self.self_attn
        q, k, v = attn.split(self.self_attn_layer_norm(x).view(batch * length, hidden))  # [b * n, hidden]
        if self.ops is not None:  # each input its own segment of rows
            segments = torch.arange(batch + 1, dtype=torch.int64).mul_(length).unfold(0, 2, 1)
            out = self.ops.encoder_attention(q, k, v, segments, self.num_heads, 1.0)
        else:
            shape = (batch, length, self.num_heads, self.head_dim)
            q, k, v = (
                t.view(shape).transpose(1, 2).contiguous() for t in (q, k, v)
            )  # [b, heads, n, head_dim]
            out = (
                F.scaled_dot_product_attention(q, k, v, scale=1.0)
                .transpose(1, 2)
                .reshape(batch * length, hidden)
            )
        x = x + attn.out_proj(out).view(x.shape)
        mlp: torch.Tensor = self.mlp(self.final_layer_norm(x).view(batch * length, hidden)).view(x.shape)
        return x + mlp


class Encoder(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, ops: CpuOps | None = None) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.conv1 = Conv1d(config.num_mel_bins, hidden, kernel_size=3, padding=1, dtype=dtype)
        self.conv2 = Conv1d(hidden, hidden, kernel_size=3, stride=2, padding=1, dtype=dtype)
        self.embed_positions = Embedding(config.encoder_len, hidden, dtype=dtype)
        self.layers = nn.ModuleList(EncoderLayer(config, dtype, ops) for _ in range(config.encoder_layers))
        self.layer_norm = LayerNorm(hidden, config.rms_norm_eps, dtype=dtype)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features: [num_inputs, num_mel_bins, 2 * encoder_len] -> [num_inputs, encoder_len, hidden]."""
        x = F.gelu(self.conv1(features))  # [b, hidden, 2 * encoder_len]
        x = F.gelu(self.conv2(x)).transpose(1, 2).contiguous()  # [b, encoder_len, hidden], row-major
        x = x + self.embed_positions.weight
        for layer in self.layers:
            x = layer(x)
        out: torch.Tensor = self.layer_norm(x)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, index: int, ops: CpuOps | None) -> None:
        super().__init__()
        self.index, self.ops = index, ops  # its cross-attention cache; the csrc kernels, or None
        hidden = config.hidden_size
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.self_attn_layer_norm = LayerNorm(hidden, config.rms_norm_eps, dtype=dtype)
        self.self_attn = SelfProjections(config, dtype)
        self.encoder_attn_layer_norm = LayerNorm(hidden, config.rms_norm_eps, dtype=dtype)
        self.encoder_attn = CrossProjections(hidden, dtype)
        self.final_layer_norm = LayerNorm(hidden, config.rms_norm_eps, dtype=dtype)
        self.mlp = MLP(config, dtype)

    def cross_attention(self, q: torch.Tensor, cross: CrossBatch) -> torch.Tensor:
        """q: [num_tokens, heads, head_dim], scaled -> each row over its request's encoder keys: the csrc
        decode kernel, a kernel row per token (every row sees all the keys), or SDPA per request."""
        if self.ops is not None:
            cache = cross.caches[self.index]
            return self.ops.paged_decode_attention(
                q.contiguous(), cache, cross.tables, cross.seq_lens, 1.0, 0, 0.0, NO_SINKS
            )
        attended = torch.empty_like(q)
        for start, end, slot in cross.segments:
            k, v = cross.keys_values(
                self.index, slot, int(cross.seq_lens[0])
            )  # [heads, encoder_len, head_dim]
            rows = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, heads, n, head_dim]
            got = F.scaled_dot_product_attention(rows, k.unsqueeze(0), v.unsqueeze(0), scale=1.0)
            attended[start:end] = got[0].transpose(0, 1)
        return attended

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        backend: AttentionBackend,
        cross: CrossBatch,
    ) -> torch.Tensor:
        num_tokens, hidden = x.shape
        heads = (num_tokens, self.num_heads, self.head_dim)
        q, k, v = self.self_attn.split(self.self_attn_layer_norm(x))
        out = backend.forward(q.view(heads), k.view(heads), v.view(heads), kv_cache, metadata, 1.0)
        x = x + self.self_attn.out_proj(out.reshape(num_tokens, hidden))
        attn = self.encoder_attn
        q = (attn.q_proj(self.encoder_attn_layer_norm(x)) * self.head_dim**-0.5).view(heads)
        attended = self.cross_attention(q, cross)  # [num_tokens, heads, head_dim]
        x = x + attn.out_proj(attended.reshape(num_tokens, hidden))
        out_mlp: torch.Tensor = x + self.mlp(self.final_layer_norm(x))
        return out_mlp


class Decoder(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, ops: CpuOps | None) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.embed_positions = Embedding(config.max_position_embeddings, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, dtype, i, ops) for i in range(config.num_layers))
        self.layer_norm = LayerNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)


class WhisperModel(nn.Module):
    is_encoder = False

    def __init__(self, config: ModelConfig, dtype: torch.dtype, ops: CpuOps | None = None) -> None:
        super().__init__()
        self.config, self.ops = config, ops
        self.encoder = Encoder(config, dtype, ops)
        self.decoder = Decoder(config, dtype, ops)
        self.proj_out = Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        # every decoder layer's cross-attention k (no bias: zeros) and v, stacked: [layer][k, v][hidden]
        self.cross_kv = Linear(config.hidden_size, 2 * config.num_layers * config.hidden_size, dtype=dtype)
        # NOTE: Whisper's 51865 (51866) tokens are no multiple of 16 or 64: the batch-invariant kernels take
        # them padded (the pair layout 2.3 ms at 16 rows, linear_rows 6.8, a plain matmul 19; Zen 4)
        self.proj_out.pad_rows = True
        self.batch_invariant = False

    @torch.inference_mode()
    def encode(self, features: torch.Tensor) -> list[torch.Tensor]:
        """features: [num_inputs, num_mel_bins, 2 * encoder_len] -> each input's cross-attention keys and
        values, [encoder_len, decoder layers, 2 (k, v), heads, head_dim]."""
        dtype = self.decoder.embed_tokens.weight.dtype
        config = self.config
        shape = (config.encoder_len, config.num_layers, 2, config.num_heads, config.head_dim)
        # NOTE: one input a call: every product then has encoder_len rows whatever the batch, so oneDNN's
        # (or MKL's) kernels give each input the same result alone or beside others (finalize)
        return [self.cross_kv(self.encoder(one[None].to(dtype))[0]).view(shape) for one in features]

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        backend: AttentionBackend,
        out_rows: torch.Tensor | None,
        cross: CrossBatch,  # the step's cross-attention keys and values (worker/cross_attention.py)
    ) -> torch.Tensor:  # [len(out_rows) or num_tokens, hidden]
        decoder = self.decoder
        x = decoder.embed_tokens(input_ids) + decoder.embed_positions(positions)  # [num_tokens, hidden]
        for layer, kv_cache in zip(decoder.layers, kv_caches, strict=True):
            x = layer(x, kv_cache, metadata, backend, cross)
        hidden: torch.Tensor = x if out_rows is None else x.index_select(0, out_rows)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.proj_out(self.decoder.layer_norm(hidden))  # [n, vocab]
        return logits

    def finalize(
        self, batch_invariant: bool = False, pack: bool = True, int8_activations: bool = False
    ) -> None:
        """Tie the output projection to the token embedding, then pack the products as BERT's are."""
        if int8_activations:  # (--activation-quantization int8: none of its weights are kept packed)
            raise UnsupportedModelError(
                "--activation-quantization int8: Whisper keeps no quantized weights packed"
            )
        self.proj_out.weight = self.decoder.embed_tokens.weight
        if not pack:
            return
        encoder = {id(module) for module in self.encoder.modules()} | {id(self.cross_kv)}  # encoder_len rows
        linears = [module for module in self.modules() if isinstance(module, Linear)]
        self.batch_invariant = batch_invariant and self.ops is not None
        for linear in linears:
            if id(linear) in encoder:  # fixed shapes (encode): oneDNN's packing, MKL's float32 (20% faster)
                if can_pack(linear.weight.dtype):
                    linear.pack(self.ops)
            elif self.batch_invariant and self.ops is not None and linear.invariant_kernel(self.ops):
                linear.pack_invariant(self.ops)
            elif can_pack(self.decoder.embed_tokens.weight.dtype):
                linear.pack(self.ops)  # the tied proj_out packs a copy: the embedding keeps its plain one

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hugging Face names: model.encoder.*, model.decoder.*, proj_out (the embedding, tied)."""
        load_whisper_weights(dict(self.named_parameters()), self.config, weights)
