"""The cross-attention keys and values of an encoder-decoder model's running requests (Whisper).

A pool beside the decoder's paged pool, in the same layout ([blocks, 2, block_size, heads, head_dim] per
decoder layer), where each entry owns a fixed run of blocks: a request's encoder output is written once,
whole, when it is first scheduled, and read whole by each of its decoder rows. It is not in the decoder's
pool because it never grows, is never shared by a prefix (the decoder's blocks are keyed by the audio's
hash instead) and needs no block table of its own; it is in the paged layout so that the csrc decode
kernel serves cross-attention: every decoder row, a prompt's or a decode step's, is one kernel row over its
request's encoder_len keys (cross-attention is not causal), row by row as the decode kernel always is.
Its memory is the KV budget's: the worker sizes the two pools and the number of requests that may hold
an entry together (ModelInfo.max_num_encoder_outputs), and the engine runs no more requests than that.

Invariants: an entry exists from the step that first schedules its request until the request finishes
or is preempted (a preempted request comes back as new and is encoded again); at most max_entries exist;
an entry's blocks are [slot * blocks_per_entry, (slot + 1) * blocks_per_entry).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from protocol.worker_messages import NewRequestData
from worker.input_batch import StepInputs
from worker.model_config import UnsupportedModelError
from worker.models.whisper import CrossBatch, WhisperModel


class CrossAttentionStore:
    def __init__(self, model: WhisperModel, max_entries: int, block_size: int) -> None:
        config = model.config
        self.model = model
        self.max_entries = max_entries
        self.encoder_len = config.encoder_len
        self.blocks_per_entry = -(-config.encoder_len // block_size)
        dtype = model.decoder.embed_tokens.weight.dtype
        shape = (max_entries * self.blocks_per_entry, 2, block_size, config.num_heads, config.head_dim)
        # (untouched pages cost nothing: an entry's memory is committed when it is first written)
        self.caches = [torch.empty(shape, dtype=dtype) for _ in range(config.num_layers)]
        self.free_slots = list(range(max_entries - 1, -1, -1))
        self.slots: dict[str, int] = {}
        self.step_inputs = 0  # the last add()'s encoder inputs and seconds (ModelRunnerOutput's)
        self.step_seconds = 0.0

    @staticmethod
    def bytes_per_entry(model: WhisperModel, block_size: int) -> int:
        config, dtype = model.config, model.decoder.embed_tokens.weight.dtype
        positions = -(-config.encoder_len // block_size) * block_size
        return config.num_layers * 2 * positions * config.hidden_size * dtype.itemsize

    def add(self, new_requests: list[NewRequestData]) -> None:
        """Run the encoder once over the new requests' inputs (one batch) and write each one's entry."""
        self.step_inputs, self.step_seconds = 0, 0.0
        todo = [new for new in new_requests if new.encoder_input is not None]
        if not todo:
            return
        start = time.perf_counter()
        if len(todo) > len(self.free_slots):
            raise RuntimeError(
                f"{len(self.slots) + len(todo)} encoder outputs exceed the worker's {self.max_entries}"
            )
        arrays = []
        for new in todo:
            encoder_input = new.encoder_input
            assert encoder_input is not None
            array = np.frombuffer(encoder_input.data, dtype="<f4").reshape(encoder_input.shape)
            arrays.append(torch.from_numpy(array.copy()))
        for new, kv in zip(todo, self.model.encode(torch.stack(arrays)), strict=True):
            slot = self.slots[new.request_id] = self.free_slots.pop()
            first = slot * self.blocks_per_entry
            for layer, cache in enumerate(self.caches):  # kv: [positions, layers, 2, heads, head_dim]
                run = cache[first : first + self.blocks_per_entry]  # [blocks, 2, block_size, heads, head_dim]
                block_size = run.shape[2]
                whole, rest = divmod(self.encoder_len, block_size)
                run[:whole].copy_(
                    kv[: whole * block_size, layer].view(whole, block_size, *kv.shape[2:]).transpose(1, 2)
                )
                if rest:  # the last block's tail stays zero (the kernel reads encoder_len keys)
                    run[whole].zero_()
                    run[whole, :, :rest].copy_(kv[whole * block_size :, layer].transpose(0, 1))
        self.step_inputs, self.step_seconds = len(todo), time.perf_counter() - start

    def drop(self, request_id: str) -> None:
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            self.free_slots.append(slot)

    @property
    def entries(self) -> dict[str, int]:
        return self.slots

    def batch(self, inputs: StepInputs) -> CrossBatch:
        """The step's rows: each request's block run, one kernel row per token."""
        ends = np.cumsum(inputs.counts)
        slots = [self.slots[request_id] for request_id in inputs.request_ids]
        first = torch.tensor(slots, dtype=torch.long) * self.blocks_per_entry  # [R]
        runs = first[:, None] + torch.arange(self.blocks_per_entry)  # [R, blocks]
        counts = torch.from_numpy(inputs.counts)
        tables = runs.repeat_interleave(counts, dim=0)  # [num_tokens, blocks]
        seq_lens = torch.full((tables.shape[0],), self.encoder_len, dtype=torch.long)
        segments = [
            (int(end - n), int(end), slot) for n, end, slot in zip(inputs.counts, ends, slots, strict=True)
        ]
        return CrossBatch(self.caches, tables, seq_lens, segments)


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
    per_entry = CrossAttentionStore.bytes_per_entry(model, config.block_size)
    if config.num_kv_blocks:
        return config.max_num_seqs, 0
    blocks_per_request = -(-max_model_len // config.block_size)
    per_request = per_entry + blocks_per_request * bytes_per_block
    budget = config.kv_cache_memory_bytes
    entries = max(1, min(config.max_num_seqs, budget // per_request))
    return entries, max(budget - entries * per_entry, bytes_per_block)
