"""The cross-attention keys and values of an encoder-decoder model's running requests (Whisper).

A store beside the paged pool, not in it: a request's encoder output is written once, whole, when it is
first scheduled, and read whole by every decoder step; it never grows, is never shared by a prefix (the
decoder's blocks are keyed by the audio's hash instead) and needs no block table. The paged kernels attend
causally over a request's own tokens, which cross-attention is not. Its memory is still the KV budget's:
the worker sizes the pool and the number of requests that may hold an entry together
(ModelInfo.max_num_encoder_outputs), and the engine runs no more requests than that.

Invariants: an entry exists from the step that first schedules its request until the request finishes
or is preempted (a preempted request comes back as new and is encoded again); at most max_entries exist.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from protocol.worker_messages import NewRequestData
from worker.input_batch import StepInputs
from worker.model_config import UnsupportedModelError
from worker.models.whisper import CrossKV, WhisperModel


class CrossAttentionStore:
    def __init__(self, model: WhisperModel, max_entries: int) -> None:
        self.model = model
        self.max_entries = max_entries
        self.entries: dict[str, CrossKV] = {}

    @staticmethod
    def bytes_per_entry(model: WhisperModel) -> int:
        config, dtype = model.config, model.decoder.embed_tokens.weight.dtype
        return config.num_layers * 2 * config.encoder_len * config.hidden_size * dtype.itemsize

    def add(self, new_requests: list[NewRequestData]) -> None:
        """Run the encoder once over the new requests' inputs (one batch) and keep each one's keys and values."""
        todo = [new for new in new_requests if new.encoder_input is not None]
        if not todo:
            return
        if len(self.entries) + len(todo) > self.max_entries:
            raise RuntimeError(
                f"{len(self.entries) + len(todo)} encoder outputs exceed the worker's {self.max_entries}"
            )
        arrays = []
        for new in todo:
            encoder_input = new.encoder_input
            assert encoder_input is not None
            array = np.frombuffer(encoder_input.data, dtype="<f4").reshape(encoder_input.shape)
            arrays.append(torch.from_numpy(array.copy()))
        for new, kv in zip(todo, self.model.encode(torch.stack(arrays)), strict=True):
            self.entries[new.request_id] = kv

    def drop(self, request_id: str) -> None:
        self.entries.pop(request_id, None)

    def segments(self, inputs: StepInputs) -> list[tuple[int, int, CrossKV]]:
        """Each scheduled request's rows in the step's flattened tokens, with its keys and values."""
        ends = np.cumsum(inputs.counts)
        return [
            (int(end - count), int(end), self.entries[request_id])
            for request_id, count, end in zip(inputs.request_ids, inputs.counts, ends, strict=True)
        ]


def check_encoder_decoder(config: Any, device: str) -> None:
    """What an encoder-decoder model does not run with yet: each an UnsupportedModelError naming it."""
    refused = [
        ("--device cuda", device != "cpu"),
        ("--tensor-parallel-size > 1", config.parallel.tensor_parallel_size > 1),
        ("--enable-lora", config.lora is not None),
        (f"--quantization {config.quantization}", config.quantization not in (None, "none")),
    ]
    for flag, applies in refused:
        if applies:
            raise UnsupportedModelError(f"WhisperForConditionalGeneration does not run with {flag} yet")


def plan_cross_entries(
    model: WhisperModel, config: Any, bytes_per_block: int, max_model_len: int
) -> tuple[int, int]:
    """How many requests may hold encoder outputs at once, and the KV budget left for the paged pool: each
    such request also needs the blocks of a whole decoder sequence, so the two shares are planned together
    (an explicit --num-kv-blocks leaves the store at max_num_seqs)."""
    per_entry = CrossAttentionStore.bytes_per_entry(model)
    if config.num_kv_blocks:
        return config.max_num_seqs, 0
    blocks_per_request = -(-max_model_len // config.block_size)
    per_request = per_entry + blocks_per_request * bytes_per_block
    budget = config.kv_cache_memory_bytes
    entries = max(1, min(config.max_num_seqs, budget // per_request))
    return entries, max(budget - entries * per_entry, bytes_per_block)
