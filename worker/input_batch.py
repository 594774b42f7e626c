"""Persistent batch state: one row per request the worker holds, updated from SchedulerOutput diffs.

Invariants: a request keeps its row until finished or preempted; token_ids[row, :num_tokens] are the
prompt then the output tokens; block_table[row, :num_blocks] is the request's block table.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from protocol.lora import LoraRequest
from protocol.pooling import PoolingParams
from protocol.sampling import SamplingParams
from protocol.worker_messages import CachedRequestData, NewRequestData
from worker.attention import AttentionMetadata


@dataclass
class RequestState:
    request_id: str
    row: int
    num_prompt_tokens: int
    sampling_params: SamplingParams
    pooling_params: PoolingParams | None = None
    lora: LoraRequest | None = None  # the adapter its products add


class InputBatch:
    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int) -> None:
        max_blocks = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_seqs, max_model_len), dtype=np.int64)
        self.block_table = np.zeros((max_num_seqs, max_blocks), dtype=np.int64)
        self.num_blocks = np.zeros(max_num_seqs, dtype=np.int64)
        self.num_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_seqs, dtype=np.int64)
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
        self.block_table[row, : len(data.block_ids)] = data.block_ids
        self.num_blocks[row] = len(data.block_ids)
        self.requests[data.request_id] = RequestState(
            data.request_id,
            row,
            len(data.prompt_token_ids),
            data.sampling_params,
            data.pooling_params,
            data.lora,
        )

    def update(self, data: CachedRequestData) -> None:
        row = self.requests[data.request_id].row
        start = self.num_blocks[row]
        self.block_table[row, start : start + len(data.new_block_ids)] = data.new_block_ids
        self.num_blocks[row] = start + len(data.new_block_ids)
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


@dataclass
class StepInputs:
    request_ids: list[str]  # in flattened order
    rows: np.ndarray  # [R] batch rows
    counts: np.ndarray  # [R] tokens scheduled
    starts: np.ndarray  # [R] computed tokens before the step
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    metadata: AttentionMetadata
