"""Persistent batch state: one row per request the worker holds, updated from SchedulerOutput diffs.

Invariants: a request keeps its row until finished or preempted; token_ids[row, :num_tokens] are the
prompt then the output tokens; block_table[row, :num_blocks] is the request's block table, and for a model
with a pool for its windowed layers window_table[row, :num_window_blocks] its table there (entries behind
the window may be stale: never read).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from protocol.lora import LoraRequest
from protocol.pooling import PoolingParams
from protocol.sampling import SamplingParams
from protocol.worker_messages import CachedRequestData, NewRequestData
from worker.attention import AttentionMetadata, PrefillChunk


@dataclass
class RequestState:
    request_id: str
    row: int
    num_prompt_tokens: int
    sampling_params: SamplingParams
    pooling_params: PoolingParams | None = None
    lora: LoraRequest | None = None  # the adapter its products add
    argmax_only: bool = False  # sampling_params.argmax_only, taken once


class InputBatch:
    def __init__(
        self,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        rope_switch: int = 0,
        rope_dynamic: bool = False,
    ) -> None:
        self.block_size = block_size
        self.rope_switch = rope_switch  # >0: a request with more known tokens runs on the long rope
        self.rope_dynamic = rope_dynamic  # dynamic NTK: a row's rotation depends on its prompt's length
        max_blocks = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_seqs, max_model_len), dtype=np.int64)
        self.block_table = np.zeros((max_num_seqs, max_blocks), dtype=np.int64)
        self.num_blocks = np.zeros(max_num_seqs, dtype=np.int64)
        self.window_table = np.zeros((max_num_seqs, max_blocks), dtype=np.int64)
        self.num_window_blocks = np.zeros(max_num_seqs, dtype=np.int64)
        self.num_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))
        self.requests: dict[str, RequestState] = {}

    def add(self, data: NewRequestData) -> None:
        if not self.free_rows:
            raise RuntimeError("the worker's batch is full: max_num_seqs is smaller than the engine's")
        row = self.free_rows.pop()
        tokens = data.prompt_token_ids + data.output_token_ids
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_computed_tokens[row] = data.num_computed_tokens
        self.num_prompt_tokens[row] = len(data.prompt_token_ids)
        self.block_table[row, : len(data.block_ids)] = data.block_ids
        self.num_blocks[row] = len(data.block_ids)
        self.window_table[row, : len(data.window_block_ids)] = data.window_block_ids
        self.num_window_blocks[row] = len(data.window_block_ids)
        self.requests[data.request_id] = RequestState(
            data.request_id,
            row,
            len(data.prompt_token_ids),
            data.sampling_params,
            data.pooling_params,
            data.lora,
            data.sampling_params.argmax_only,
        )

    def update(self, data: CachedRequestData) -> None:
        row = self.requests[data.request_id].row
        start = self.num_blocks[row]
        self.block_table[row, start : start + len(data.new_block_ids)] = data.new_block_ids
        self.num_blocks[row] = start + len(data.new_block_ids)
        start = self.num_window_blocks[row]
        self.window_table[row, start : start + len(data.new_window_block_ids)] = data.new_window_block_ids
        self.num_window_blocks[row] = start + len(data.new_window_block_ids)
        self.num_computed_tokens[row] = data.num_computed_tokens

    def remove(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is not None:
            self.free_rows.append(state.row)

    def append_token(self, row: int, token_id: int) -> None:
        self.token_ids[row, self.num_tokens[row]] = token_id
        self.num_tokens[row] += 1

    def output_token_ids(self, state: RequestState) -> np.ndarray:
        return self.token_ids[state.row, state.num_prompt_tokens : self.num_tokens[state.row]]

    def prompt_token_ids(self, state: RequestState) -> np.ndarray:
        return self.token_ids[state.row, : state.num_prompt_tokens]

    def prepare_inputs(self, scheduled: dict[str, int], window_pool: bool) -> StepInputs:
        """The step's flattened tokens and attention metadata (window_pool: also over the windowed
        layers' pool). Host tensors: a CUDA worker moves them (an eager step) or stages them (a graph's)."""
        # Decode requests (one query token) first, so attention handles them as one batch.
        request_ids = sorted(scheduled, key=lambda request_id: scheduled[request_id] != 1)
        rows = np.array([self.requests[r].row for r in request_ids], dtype=np.int64)
        counts = np.array([scheduled[r] for r in request_ids], dtype=np.int64)
        starts = self.num_computed_tokens[rows]
        total = sum(scheduled.values())
        if total == len(rows):  # a decode step: one token a request, at its next position
            first, positions, row_per_token = np.arange(total), starts.copy(), rows
        else:
            first = np.cumsum(counts) - counts
            positions = np.repeat(starts, counts) + np.arange(total) - np.repeat(first, counts)  # [T]
            row_per_token = np.repeat(rows, counts)  # [T]
        input_ids = self.token_ids[row_per_token, positions]
        flat = (rows, counts, starts, first, positions, row_per_token)
        metadata = self._metadata(self.block_table, *flat)
        if window_pool:
            metadata.window_group = self._metadata(self.window_table, *flat)
        if self.rope_switch:
            metadata.long_rope = torch.from_numpy(
                (self.num_tokens[row_per_token] > self.rope_switch).astype(np.int64)
            )
        if self.rope_dynamic:
            metadata.prompt_lens = torch.from_numpy(self.num_prompt_tokens[row_per_token])
        return StepInputs(
            request_ids,
            rows,
            counts,
            starts,
            torch.from_numpy(input_ids),
            torch.from_numpy(positions),
            metadata,
        )

    def _metadata(
        self,
        table: np.ndarray,  # [max_num_seqs, max_blocks] a pool's block tables
        rows: np.ndarray,  # [R] the scheduled requests' rows, decode requests first
        counts: np.ndarray,  # [R] tokens scheduled
        starts: np.ndarray,  # [R] computed tokens before the step
        first: np.ndarray,  # [R] each request's first row in the flattened tokens
        positions: np.ndarray,  # [T]
        row_per_token: np.ndarray,  # [T]
    ) -> AttentionMetadata:
        bs = self.block_size
        seq_lens = starts + counts
        num_decode = int((counts == 1).sum())
        metadata = AttentionMetadata(
            num_decode_tokens=num_decode,
            slot_block_ids=torch.from_numpy(table[row_per_token, positions // bs]),
            slot_offsets=torch.from_numpy(positions % bs),
        )
        if num_decode:
            max_blocks = int(-(-seq_lens[:num_decode].max() // bs))
            tables = table[rows[:num_decode], :max_blocks]
            metadata.decode_block_tables = torch.from_numpy(np.ascontiguousarray(tables))
            metadata.decode_seq_lens = torch.from_numpy(seq_lens[:num_decode])
        for i in range(num_decode, len(rows)):
            start, n, context = int(first[i]), int(counts[i]), int(starts[i])
            seq_len = context + n
            block_ids = torch.from_numpy(table[rows[i], : -(-seq_len // bs)].copy())
            metadata.prefills.append(PrefillChunk(start, start + n, context, block_ids))
        return metadata


@dataclass
class StepInputs:
    request_ids: list[str]  # in flattened order
    rows: np.ndarray  # [R] batch rows
    counts: np.ndarray  # [R] tokens scheduled
    starts: np.ndarray  # [R] computed tokens before the step
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    metadata: AttentionMetadata
