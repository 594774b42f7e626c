"""A Whisper checkpoint's config.json as our ModelConfig (the decoder's shape; the encoder's beside it)."""

from __future__ import annotations

from worker.model_config import ModelConfig
from worker.models.families.base import HFConfig


def whisper_config(hf: HFConfig, eos_token_ids: list[int]) -> ModelConfig:
    """Refuses, by name, the fields whose other values would change the model's output and that no released
    Whisper checkpoint sets (training-only fields such as dropout and SpecAugment change nothing here)."""
    hf.refuse("scale_embedding", (False,), "embeddings times sqrt(d_model)")
    hf.refuse("activation_function", ("gelu",))
    hf.refuse("tie_word_embeddings", (True,), "proj_out apart from the token embedding")
    heads = hf.get("decoder_attention_heads", 4)
    hidden = hf.get("d_model", 384)
    if hf.get("encoder_attention_heads", 4) != heads:
        raise hf.fail("encoder_attention_heads and decoder_attention_heads differ: not supported")
    if hf.get("encoder_ffn_dim", 1536) != hf.get("decoder_ffn_dim", 1536):
        raise hf.fail("encoder_ffn_dim and decoder_ffn_dim differ: not supported")
    if hidden % heads:
        raise hf.fail(f"d_model {hidden} is not a multiple of the {heads} attention heads")
    return ModelConfig(
        family="whisper",
        vocab_size=hf.get("vocab_size", 51865),
        hidden_size=hidden,
        intermediate_size=hf.get("decoder_ffn_dim", 1536),
        num_layers=hf.get("decoder_layers", 4),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        rms_norm_eps=1e-5,  # nn.LayerNorm's default, which transformers' Whisper layers keep
        rope_theta=0.0,
        max_position_embeddings=hf.get("max_target_positions", 448),
        tie_word_embeddings=True,
        eos_token_ids=eos_token_ids or [hf.get("eos_token_id", 50257)],
        torch_dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "float32"),
        architecture=hf.architecture,
        hidden_act="gelu",
        norm="layer",
        norm_bias=True,
        encoder_layers=hf.get("encoder_layers", 4),
        num_mel_bins=hf.get("num_mel_bins", 80),
        encoder_len=hf.get("max_source_positions", 1500),
    )
