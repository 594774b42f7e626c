"""Scheduler and cache configuration: frozen, validated once."""

from __future__ import annotations

from dataclasses import dataclass

from protocol.config import DEFAULT_BLOCK_SIZE


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 128  # requests running at once
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_model_len: int = 2048  # prompt + output tokens of one request
    block_size: int = DEFAULT_BLOCK_SIZE  # tokens per KV block
    num_kv_blocks: int = 1024  # size of the KV pool
    enable_prefix_caching: bool = True
    policy: str = "fcfs"  # "fcfs" or "priority"
    long_prefill_token_threshold: int = 0  # >0: cap a prefill chunk below the budget
    # >0: while any request decodes, a step's prefill tokens (all chunks together) stay at most this many,
    # so that a decode row waits through a bounded prefill, not a whole budget's worth
    decode_prefill_token_budget: int = 0
    # >0: that share grows to this many prefill tokens per decoding request where that is more, so that a
    # step's prefill rows stay in proportion to its decode rows (what an inter-token gap holds)
    decode_prefill_tokens_per_decode: int = 0
    # >0: and to this many per request the engine holds (running and waiting, at most max_num_seqs), so that
    # a step prefills as many requests as finish at that concurrency, and no fewer while a burst ramps up
    decode_prefill_tokens_per_request: int = 0
    # False for encoders: a prompt is scheduled whole in one step or waits (its first token attends to
    # its last); the budget must then hold max_model_len
    chunked_prefill: bool = True
    max_loras: int = 0  # >0: the distinct LoRA adapters one step may hold (the worker's slots); 0: no LoRA
    kv_window: int = 0  # >0: every layer's window (ModelInfo.kv_window): blocks behind it are freed
    # >0: the windowed layers of a model that mixes them with full ones have a pool of their own of this
    # many blocks (ModelInfo.num_window_blocks), and kv_window applies to that pool only
    num_window_blocks: int = 0
    rope_switch_len: int = 0  # >0: ModelInfo.rope_switch_len: a request crossing it is recomputed
    rope_dynamic_len: int = (
        0  # >0: ModelInfo.rope_dynamic_len: a longer prompt's blocks are keyed by its length
    )
    # an encoder-decoder model's encoder positions per step (ModelInfo.encoder_len each new request): at
    # least one input's; 0 for a model without an encoder input
    max_num_encoder_input_tokens: int = 0
    # a vision-language model's image embeddings the worker may hold at once (scheduled, not yet consumed):
    # at least one image's; 0 for a model without images
    encoder_cache_tokens: int = 0
    # ModelInfo.whole_image_spans: a prefill chunk that would end inside an image's span stops before it
    whole_image_spans: bool = False

    def __post_init__(self) -> None:
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "block_size",
            "num_kv_blocks",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be 'fcfs' or 'priority', got {self.policy!r}")
