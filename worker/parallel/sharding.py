"""Megatron sharding of a decoder: which slice of each checkpoint tensor a tensor-parallel rank holds.

Column-parallel (split by output rows): q, k, v and gate, up, and the vocabulary of the embedding and the
lm_head; row-parallel (split by input columns): o and down, each followed by one all-reduce. Norms are
replicated, but for q/k norms that have a weight per head (Command R, StableLM: the rank's heads' rows) or
span the whole projection (OLMo 2: the rank's columns; attention all-reduces the sums of squares). A bias
after a row-parallel product is rank 0's alone (zeros elsewhere), so the all-reduce adds it once. Fused
checkpoint tensors are sliced part by part: Phi-3's qkv_proj ([q; k; v]) and gate_up_proj ([gate; up]), GLM's
gate_up_proj, GPT-NeoX's query_key_value (head by head: a rank's heads are one run of rows).
Multi-head latent attention splits its heads (q, kv_b's per-head keys and values, o) and keeps
the latent products (q_a, kv_a) and its cache whole on every rank. Experts are split by width, each rank holding a slice of every expert (and of the shared
expert) and the whole router: every rank does its share of every routed token's work whatever the routing
picks, where a split by expert leaves ranks idle when a step's tokens favour a few experts; the layer's sum
is all-reduced once, as a dense MLP's. When the ranks outnumber the KV heads, each KV head is replicated on size / num_kv_heads
ranks, as vLLM does; a head count that neither divides nor is divided by the size is refused at start.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator

import torch

from worker.model_config import ModelConfig
from worker.models.families import our_name
from worker.quant.blocks import QuantWeight


class ShardingError(ValueError):
    """The model's shape cannot be split over this many ranks."""


def check_shardable(config: ModelConfig, size: int) -> None:
    """One line naming the sizes, before anything loads."""
    if config.is_encoder:
        raise ShardingError(
            f"--tensor-parallel-size {size}: tensor parallel serves decoders; an encoder ({config.family}) "
            "runs with --tensor-parallel-size 1"
        )
    if reason := unshardable(config):
        raise ShardingError(f"--tensor-parallel-size {size}: {config.architecture or config.family} {reason}; "
                            "serve it with --tensor-parallel-size 1")  # fmt: skip
    heads, kv_heads, inter = config.num_heads, config.num_kv_heads, config.intermediate_size
    if heads % size:
        raise ShardingError(
            f"--tensor-parallel-size {size} does not divide the model's {heads} attention heads "
            f"({kv_heads} KV heads); sizes that do: {_divisors(heads)}"
        )
    if kv_heads % size and size % kv_heads:
        raise ShardingError(
            f"--tensor-parallel-size {size} neither divides nor is a multiple of the model's {kv_heads} KV "
            f"heads ({heads} attention heads)"
        )
    if inter % size:
        raise ShardingError(
            f"--tensor-parallel-size {size} does not divide the model's intermediate size {inter}"
        )
    for what, width in (("experts' width", config.moe_intermediate_size),
                        ("shared expert's width", config.shared_expert_intermediate_size)):  # fmt: skip
        if width % size:
            raise ShardingError(f"--tensor-parallel-size {size} does not divide the model's {what} {width}")


def unshardable(config: ModelConfig) -> str:
    """Why a decoder family's layers do not shard yet ("" when they do)."""
    if config.expert_bias:
        return "has biases on its experts' down products"
    return ""


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def shard_config(config: ModelConfig, size: int) -> ModelConfig:
    """The shape one rank's layers have; the vocabulary stays whole (the model pads its shards)."""
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // size,
        num_kv_heads=max(1, config.num_kv_heads // size),
        intermediate_size=config.intermediate_size // size,
        moe_intermediate_size=config.moe_intermediate_size // size,
        shared_expert_intermediate_size=config.shared_expert_intermediate_size // size,
    )


def vocab_shard(vocab_size: int, rank: int, size: int) -> tuple[int, int]:
    """(first token id, rows) of a rank's vocabulary shard; the last shard is padded to the same rows."""
    rows = -(-vocab_size // size)
    return rank * rows, rows


class Shard:
    """One rank's slices of the checkpoint's tensors, by their Hugging Face names (classified by ours)."""

    def __init__(self, config: ModelConfig, rank: int, size: int) -> None:
        self.config, self.rank, self.size = config, rank, size
        head_dim = config.head_dim
        q_rows = config.num_heads // size * head_dim
        kv_heads = max(1, config.num_kv_heads // size)
        first_kv = rank * config.num_kv_heads // size  # a replicated head: the one this rank's q heads use
        inter = config.intermediate_size // size
        self.heads = (rank * config.num_heads // size, config.num_heads // size)  # (first, count)
        self.kv_heads = (first_kv, kv_heads)
        # fused tensors: their parts' (start, length) in the checkpoint, each sliced as its own tensor
        q_size, kv_size = config.num_heads * head_dim, config.num_kv_heads * head_dim
        self.fused = {
            "qkv_proj": [(0, q_size, "q_proj"), (q_size, kv_size, "k_proj"), (q_size + kv_size, kv_size, "v_proj")],
            "gate_up_proj": [(0, config.intermediate_size, "gate_proj"),
                             (config.intermediate_size, config.intermediate_size, "up_proj")],
        }  # fmt: skip
        # name part -> (dim, start, length)
        if (
            config.kv_lora_rank
        ):  # MLA: heads of q (nope + rope), of kv_b (nope + v) and of o (v); the latent whole
            heads, v_rows = config.num_heads // size, config.num_heads // size * config.v_head_dim
            kv_b_rows = heads * (config.qk_nope_head_dim + config.v_head_dim)
            self.slices = {
                "q_proj": (0, rank * q_rows, q_rows),
                "q_b_proj": (0, rank * q_rows, q_rows),
                "kv_b_proj": (0, rank * kv_b_rows, kv_b_rows),
                "o_proj": (1, rank * v_rows, v_rows),
                **self.mlp_slices(config.intermediate_size // size),
            }
            return
        self.slices = {
            "q_proj": (0, rank * q_rows, q_rows),
            "k_proj": (0, first_kv * head_dim, kv_heads * head_dim),
            "v_proj": (0, first_kv * head_dim, kv_heads * head_dim),
            "o_proj": (1, rank * q_rows, q_rows),
            **self.mlp_slices(inter),
        }
        if config.qk_norm == "proj":  # a weight over the whole projection: the rank's columns of it
            self.slices["q_norm"] = (0, rank * q_rows, q_rows)
            self.slices["k_norm"] = (0, first_kv * head_dim, kv_heads * head_dim)
        elif config.qk_norm == "head_each":  # [heads, head_dim]: the rank's heads
            self.slices["q_norm"] = (0, self.heads[0], self.heads[1])
            self.slices["k_norm"] = (0, first_kv, kv_heads)

    def mlp_slices(self, inter: int) -> dict[str, tuple[int, int, int]]:
        return {
            "gate_proj": (0, self.rank * inter, inter),
            "up_proj": (0, self.rank * inter, inter),
            "down_proj": (1, self.rank * inter, inter),
        }

    def tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        ours = our_name(self.config.family, name).partition("#")[0]
        if isinstance(tensor, QuantWeight):
            return self.quant(name, ours, tensor)
        if ours in ("embed_tokens.weight", "lm_head.weight"):
            start, rows = vocab_shard(self.config.vocab_size, self.rank, self.size)
            part = tensor[start : start + rows]
            if len(part) < rows:  # the last shard's padding: rows no token id reaches
                part = torch.cat([part, part.new_zeros(rows - len(part), *part.shape[1:])])
            return part
        shared = ".shared_expert." in name or ".shared_experts." in name  # Qwen2-MoE's, DeepSeek's
        if ".experts." in name or shared:  # by width, as a dense MLP
            width = (
                self.config.shared_expert_intermediate_size if shared else self.config.moe_intermediate_size
            )
            width //= self.size
            dim = 1 if name.split(".")[-2] in ("down_proj", "w2") else 0  # Mixtral's w1 / w3 / w2
            return tensor.narrow(dim, self.rank * width, width)
        if ".qkv_proj." in ours and self.config.family == "gpt_neox":  # [head, (q, k, v), head_dim] rows
            rows = tensor.shape[0] // self.config.num_heads
            return tensor.narrow(0, self.heads[0] * rows, self.heads[1] * rows)
        for key, parts in self.fused.items():
            if f".{key}." in ours:
                return torch.cat([self.slice(part, tensor.narrow(0, start, length))
                                  for start, length, part in parts])  # fmt: skip
        return self.slice(ours, tensor)

    def quant(self, name: str, ours: str, weight: QuantWeight) -> QuantWeight:
        """A rank's slice of a weight kept packed: whole rows, or whole blocks of its input dims."""
        try:
            if ours in ("embed_tokens.weight", "lm_head.weight"):
                start, rows = vocab_shard(self.config.vocab_size, self.rank, self.size)
                part = weight.narrow(0, start, min(rows, weight.shape[0] - start))
                return part if part.shape[0] == rows else part.pad_rows(rows)
            if (
                ".experts." in name
                or ".shared_expert" in name
                or any(f".{key}." in ours for key in self.fused)
            ):
                raise ValueError("fused or expert tensors kept packed are not sliced yet")
            where = self.slice_of(ours)
            return weight if where is None else weight.narrow(*where)
        except ValueError as error:
            raise ShardingError(
                f"--tensor-parallel-size {self.size}: {name} ({weight.type_name}, kept packed): {error}; "
                "--quantization none serves it dequantized"
            ) from error

    def slice_of(self, ours: str) -> tuple[int, int, int] | None:
        """(dim, start, length) of the rank's part of a tensor by our name (or a fused tensor's part name);
        None: every rank holds it whole (norms)."""
        return next((where for key, where in self.slices.items() if f".{key}." in f".{ours}."), None)

    def slice(self, ours: str, tensor: torch.Tensor) -> torch.Tensor:
        where = self.slice_of(ours)
        if where is None:
            return tensor
        if where[0] == 1 and ours.endswith(".bias"):  # after a row-parallel product: added once, by rank 0
            return tensor if self.rank == 0 else torch.zeros_like(tensor)
        return tensor.narrow(*where)

    def weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            ours = our_name(self.config.family, name)
            if "#" in ours and self.config.qk_norm == "head_each":  # StableLM's norms, a tensor per head
                head = int(ours.partition("#")[2])
                first, count = self.heads if ".q_norm." in ours else self.kv_heads
                if not first <= head < first + count:
                    continue  # another rank's head
                yield re.sub(rf"\.{head}\.weight$", f".{head - first}.weight", name), tensor
                continue
            yield name, self.tensor(name, tensor)
