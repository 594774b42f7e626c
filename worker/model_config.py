"""ModelConfig: the architecture facts the model code needs (read from a checkpoint by
worker/config_files.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class UnsupportedModelError(ValueError):
    """The model folder or file holds an architecture or format we do not run."""


@dataclass(frozen=True)
class VisionConfig:
    """A vision-language model's image side (worker/models/vit.py, worker/models/vision_config.py): the
    vision transformer, the layer its features come from, the projector onto the language model's width."""

    hidden_size: int
    intermediate_size: int
    num_layers: int  # the tower's layers that run: up to the feature layer (the rest change nothing)
    num_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    hidden_act: str  # "quick_gelu" (CLIP), "gelu_tanh" (SigLIP), "gelu"
    class_token: bool  # CLIP: a learned first position
    patch_bias: bool  # the patch convolution's bias (SigLIP)
    pre_norm: bool  # CLIP's pre_layrnorm on the embeddings
    post_norm: bool  # the features pass the tower's post_layernorm (only when they come from its last layer)
    drop_first: (
        bool  # the features skip the first position (LLaVA's vision_feature_select_strategy "default")
    )
    projector_act: str
    projector_bias: bool
    image_token_id: int
    num_channels: int = 3
    # Idefics3 / SmolVLM: an image is up to max_tiles tiles, each tile's features pixel-shuffled by
    # scale_factor (scale_factor**2 positions into one) onto a linear projection; its positions bucketized
    connector: str = "mlp"  # "mlp": LLaVA's two products; "pixel_shuffle": Idefics3's; "pool": Gemma 3's
    scale_factor: int = 1
    max_tiles: int = 1
    # Gemma 3: each image's features average-pooled to tokens_per_image; its tokens attend to each other
    # both ways in the language model (a run of them is computed in one step: engine_core/encoder_room.py)
    tokens_per_image: int = 0
    bidirectional: bool = False

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_image_tokens(self) -> int:
        """The most embeddings one image makes."""
        if self.connector == "pool":
            return self.tokens_per_image * self.max_tiles
        per_tile = (self.num_patches + self.class_token - self.drop_first) // self.scale_factor**2
        return per_tile * self.max_tiles


@dataclass(frozen=True)
class ModelConfig:
    family: str  # a decoder family's name (worker/models/families/) or "bert"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    # "": none; "head": one [head_dim] norm shared by the heads (Qwen3, Gemma 3); "head_each": a weight per
    # head, [heads, head_dim] (Command R, StableLM); "proj": over the whole q and k projections (OLMo 2)
    qk_norm: str = ""
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str = "float32"  # the checkpoint's dtype, used for dtype="auto"
    architecture: str = ""  # the checkpoint's class, e.g. "BertModel" (GGUF: its general.architecture)
    # encoders (BERT): rms_norm_eps holds layer_norm_eps; token types and the activation of the MLP
    type_vocab_size: int = 0
    hidden_act: str = "silu"
    num_labels: int = 0  # a *ForSequenceClassification head's outputs (0: none)
    id2label: dict[int, str] = field(default_factory=dict)
    # ---- what a family changes in the shared decoder (worker/models/families/) ----
    o_bias: bool = False  # o_proj carries a bias
    mlp_bias: bool = False  # the MLP's products carry biases
    mlp: str = "gated"  # "gated": down(act(gate) * up); "plain": down(act(up)) (StarCoder2, GPT-NeoX)
    # "rms"; "rms_offset" (Gemma: x * (1 + w) in float32); "layer" (LayerNorm, a bias when norm_bias);
    # "cohere" (Command R's LayerNorm: its float32 formula, no bias)
    norm: str = "rms"
    norm_bias: bool = False
    # where the norms sit: "pre" (Llama); "sandwich" (Gemma 2/3, GLM-4: the attention's and the MLP's
    # outputs normed too); "post" (OLMo 2: those two only); "parallel" (GPT-NeoX: attention and MLP of
    # one input, each with its norm, out = (mlp + attn) + x); "parallel_shared" (Command R, StableLM: one
    # norm for both, out = (x + attn) + mlp)
    layout: str = "pre"
    attention_scale: float = 0.0  # the query scale; 0: head_dim ** -0.5
    attn_softcap: float = 0.0  # scores -> cap * tanh(scores / cap) (Gemma 2); 0: none
    sliding_window: int = 0  # keys a windowed layer's query sees, itself included
    layer_types: list[str] = field(default_factory=list)  # per layer "full_attention" or "sliding_attention"
    rotary_dim: int = 0  # the leading dims of a head that rotate (partial rotary); 0: all of them
    rope_interleaved: bool = False  # rotate pairs (2i, 2i + 1) (Command R, GLM), not (i, i + dim / 2)
    rope_local_theta: float = 0.0  # the sliding layers' own rope base, unscaled (Gemma 3, OLMo 3); 0: shared
    nope_layers: list[int] = field(default_factory=list)  # layers without rotary (SmolLM3)
    embedding_multiplier: float = 1.0  # embeddings times this (Gemma's sqrt(hidden), Granite's)
    residual_multiplier: float = 1.0  # each branch's output times this before its residual add (Granite)
    logits_scale: float = 1.0  # logits times this (Granite's 1 / logits_scaling, Command R's logit_scale)
    final_softcap: float = 0.0  # logits -> cap * tanh(logits / cap) (Gemma 2); 0: none
    attention_sinks: bool = False  # a learned logit per head in the softmax's sum, with no value (gpt-oss)
    # ---- mixture of experts (worker/models/moe.py) ----
    num_experts: int = 0  # 0: every layer's MLP is dense
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's
    moe_router: str = "softmax"  # "softmax" then top k (Mixtral, Qwen); "topk_softmax" (gpt-oss)
    norm_topk_prob: bool = True  # the top k's weights renormalized to sum to 1
    router_bias: bool = False
    expert_bias: bool = False  # biases on the experts' products (gpt-oss)
    moe_act: str = "silu"  # the experts' gated activation: "silu", "gelu_tanh", "swiglu_clamped" (gpt-oss)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # a shared expert beside the routed ones (Qwen2-MoE, DeepSeek); gated: times sigmoid(a learned gate)
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    dense_layers: list[int] = field(default_factory=list)  # layers of a MoE model whose MLP is dense
    # DeepSeek's routers: experts in n_group groups, the top topk_group groups' experts eligible; the chosen
    # weights times routed_scaling_factor; "sigmoid_grouped" adds a learned bias to the scores it chooses by
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # ---- multi-head latent attention (DeepSeek-V2/V3; worker/models/mla.py) ----
    kv_lora_rank: int = 0  # > 0: MLA, the cache holds a latent row a token (kv_entry)
    q_lora_rank: int = 0  # 0: one q_proj
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    # ---- an encoder-decoder model (Whisper; worker/models/whisper.py): num_layers counts the decoder's ----
    encoder_layers: int = 0
    num_mel_bins: int = 0  # the encoder's input rows
    encoder_len: int = 0  # the encoder's output positions (its input has twice as many frames)
    vision: VisionConfig | None = None  # a vision-language model's image side (its text model is the rest)

    @property
    def is_encoder_decoder(self) -> bool:
        return self.encoder_len > 0

    @property
    def kv_entry(self) -> tuple[int, int, int]:
        """A layer's cache per token: (halves, heads, width). Keys and values of the KV heads, or MLA's one
        latent row (no value half: the values are the latents' leading kv_lora_rank dims)."""
        if self.kv_lora_rank:
            return 1, 1, self.kv_lora_rank + self.qk_rope_head_dim
        return 2, self.num_kv_heads, self.head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def kv_window(self) -> int:
        """The window every layer attends within (0 unless all are windowed): older KV is never read."""
        every = all(self.is_sliding(layer) for layer in range(self.num_layers))
        return self.sliding_window if self.sliding_window and every and not self.is_encoder else 0

    def is_sliding(self, layer: int) -> bool:
        if not self.sliding_window:
            return False
        return not self.layer_types or self.layer_types[layer] == "sliding_attention"

    @property
    def query_scale(self) -> float:
        return self.attention_scale or self.head_dim**-0.5

    @property
    def is_encoder(self) -> bool:
        """Bidirectional attention over the whole input (BERT): no KV cache, no chunked prefill."""
        return self.family == "bert"


def eos_ids(value: int | list[int] | None) -> list[int]:
    """A config's eos_token_id (one, a list, or none) as a list."""
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]
