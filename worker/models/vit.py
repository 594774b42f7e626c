"""The vision transformer of a vision-language model (CLIP's and SigLIP's vision towers, Idefics3's SigLIP on
tiles of any size), and the projectors that map its features onto the language model's width (LLaVA's two
products with an activation between; Idefics3's pixel shuffle and one product).

Parameter names are the checkpoint's below its `vision_tower.vision_model.` and `multi_modal_projector.`
prefixes, so that loading is a name-for-name copy. The tower runs in torch (MKL / oneDNN products), its
attention on csrc encoder_attention (torch's scaled_dot_product_attention without the kernels), one image a
call: an image's embeddings are the same whatever else the step holds. It runs only the layers the features
come from (LLaVA's come from the second to last).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

from worker.model_config import VisionConfig
from worker.models.norms import OffsetRMSNorm

if TYPE_CHECKING:
    from worker.csrc_ops import CpuOps


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": quick_gelu,
    "gelu": F.gelu,
    "gelu_tanh": gelu_tanh,
    "relu": F.relu,
    "silu": F.silu,
}


class VisionEmbeddings(nn.Module):
    def __init__(self, config: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        width = config.hidden_size
        self.patch_embedding = nn.Conv2d(
            config.num_channels,
            width,
            config.patch_size,
            config.patch_size,
            bias=config.patch_bias,
            dtype=dtype,
        )
        self.class_embedding = nn.Parameter(torch.empty(width, dtype=dtype)) if config.class_token else None
        positions = config.num_patches + config.class_token
        self.position_embedding = nn.Embedding(positions, width, dtype=dtype)
        self.side = config.image_size // config.patch_size
        self.bucketed = config.connector == "pixel_shuffle"  # Idefics3's tiles of any size

    def forward(
        self, pixel_values: torch.Tensor
    ) -> torch.Tensor:  # [1, channels, H, W] -> [positions, width]
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        rows, cols = patches.shape[-2:]
        x = patches.flatten(2).transpose(1, 2)[0]  # [patches, width]
        if self.class_embedding is not None:
            x = torch.cat([self.class_embedding[None], x])
        if self.bucketed:
            out: torch.Tensor = x + self.position_embedding(bucket_positions(rows, cols, self.side))
        else:
            out = x + self.position_embedding.weight
        return out


def bucket_positions(rows: int, cols: int, side: int) -> torch.Tensor:
    """Idefics3's positions of a tile of rows x cols patches on a tower trained on side x side: each patch's
    fractional place on the tile, bucketized onto the trained grid (transformers' float32 arithmetic, so
    that a tile of another size takes the positions it takes there)."""
    boundaries = torch.arange(1 / side, 1.0, 1 / side)

    def buckets(n: int) -> torch.Tensor:
        place = torch.arange(n, dtype=torch.float32) * (1.0 / torch.tensor(n))
        return torch.bucketize(place.clamp(max=1.0 - 1e-6), boundaries, right=True)

    return (buckets(rows)[:, None] * side + buckets(cols)[None, :]).flatten()


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig, dtype: torch.dtype, ops: CpuOps | None = None) -> None:
        super().__init__()
        width = config.hidden_size
        self.num_heads, self.ops = config.num_heads, ops
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (
            nn.Linear(width, width, dtype=dtype) for _ in range(4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [positions, width]
        n, width = x.shape
        if self.ops is not None:  # every position sees all: one segment
            q, k, v = (proj(x) for proj in (self.q_proj, self.k_proj, self.v_proj))
            whole = torch.tensor([[0, n]])
            out = self.ops.encoder_attention(
                q, k, v, whole, self.num_heads, (width // self.num_heads) ** -0.5
            )
            attended: torch.Tensor = self.out_proj(out)
            return attended
        q, k, v = (
            proj(x).view(1, n, self.num_heads, -1).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        # [1, heads, positions, head_dim]: the 4-d form takes torch's fused CPU attention; a 3-d one falls back
        # to the math path (66% of a bf16 tower's time at 1,025 positions, EPYC)
        out = F.scaled_dot_product_attention(q, k, v)  # every position sees all
        result: torch.Tensor = self.out_proj(out[0].transpose(0, 1).reshape(n, width))
        return result


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size, dtype=dtype)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size, dtype=dtype)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(self.act(self.fc1(x)))
        return out


class VisionLayer(nn.Module):
    def __init__(self, config: VisionConfig, dtype: torch.dtype, ops: CpuOps | None = None) -> None:
        super().__init__()
        eps = config.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=eps, dtype=dtype)
        self.self_attn = VisionAttention(config, dtype, ops)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=eps, dtype=dtype)
        self.mlp = VisionMLP(config, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        out: torch.Tensor = x + self.mlp(self.layer_norm2(x))
        return out


class VisionEncoder(nn.Module):
    """`encoder.layers`, named as the checkpoint names them."""

    def __init__(self, config: VisionConfig, dtype: torch.dtype, ops: CpuOps | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(config, dtype, ops) for _ in range(config.num_layers))


class VisionTransformer(nn.Module):
    def __init__(self, config: VisionConfig, dtype: torch.dtype, ops: CpuOps | None = None) -> None:
        super().__init__()
        self.config = config
        width, eps = config.hidden_size, config.layer_norm_eps
        self.embeddings = VisionEmbeddings(config, dtype)
        self.pre_layrnorm = nn.LayerNorm(width, eps=eps, dtype=dtype) if config.pre_norm else None
        self.encoder = VisionEncoder(config, dtype, ops)
        self.post_layernorm = nn.LayerNorm(width, eps=eps, dtype=dtype) if config.post_norm else None

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # -> [features, width]
        x: torch.Tensor = self.embeddings(pixel_values)
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        for layer in self.encoder.layers:
            x = layer(x)
        if self.post_layernorm is not None:
            x = self.post_layernorm(x)
        if self.config.drop_first:
            x = x[1:]
        return x


class Projector(nn.Module):
    """LLaVA's multi_modal_projector: linear_2(act(linear_1(features)))."""

    def __init__(self, config: VisionConfig, text_width: int, dtype: torch.dtype) -> None:
        super().__init__()
        bias = config.projector_bias
        self.linear_1 = nn.Linear(config.hidden_size, text_width, bias=bias, dtype=dtype)
        self.linear_2 = nn.Linear(text_width, text_width, bias=bias, dtype=dtype)
        self.act = ACTIVATIONS[config.projector_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear_2(self.act(self.linear_1(x)))
        return out


class PixelShuffleProjector(nn.Module):
    """Idefics3's connector: each scale x scale block of a tile's square feature grid folded into one
    position (transformers' pixel_shuffle order), then one product onto the language model's width."""

    def __init__(self, config: VisionConfig, text_width: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.scale = config.scale_factor
        self.proj = nn.Linear(config.hidden_size * self.scale**2, text_width, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [positions, width] of one tile
        n, width = x.shape
        side, s = math.isqrt(n), self.scale
        x = x.view(side, side // s, width * s).transpose(0, 1)
        x = x.reshape(side // s, side // s, width * s * s).transpose(0, 1)
        out: torch.Tensor = self.proj(x.reshape(n // (s * s), width * s * s))
        return out


class PoolProjector(nn.Module):
    """Gemma 3's multi_modal_projector: the tower's square feature grid average-pooled onto
    tokens_per_image positions, a (1 + w) RMSNorm in float32, then one product (a bare weight matrix)."""

    def __init__(self, config: VisionConfig, text_width: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.side = config.image_size // config.patch_size
        self.kernel = self.side // math.isqrt(config.tokens_per_image)
        self.mm_input_projection_weight = nn.Parameter(
            torch.empty(config.hidden_size, text_width, dtype=dtype)
        )
        self.mm_soft_emb_norm = OffsetRMSNorm(config.hidden_size, config.layer_norm_eps, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [positions, width] of one image
        width = x.shape[1]
        grid = x.transpose(0, 1).reshape(1, width, self.side, self.side).contiguous()
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2)[0].transpose(0, 1)  # [tokens, width]
        out: torch.Tensor = self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight
        return out
