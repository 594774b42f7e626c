"""A fake executor for scheduler tests: it tracks the batch from SchedulerOutput diffs exactly as a worker
does, and 'samples' a deterministic token whenever a request's known tokens are all computed."""

from __future__ import annotations

import struct
from collections import deque
from typing import Any

import msgspec

from protocol.messages import ModelInfo, RequestError
from protocol.pooling import PooledOutput, PoolerConfig
from protocol.worker_messages import ModelRunnerOutput, SchedulerOutput, WorkerCall, WorkerCallResult


class FakeExecutor:
    def __init__(
        self,
        num_kv_blocks: int = 64,
        block_size: int = 4,
        max_model_len: int = 256,
        eos: int = 2,
        *,
        pooling: str | None = None,  # a pooling model: "encoder", or a causal LM's pooling type ("LAST", ...)
        window: int = 0,  # with num_window_blocks: a model mixing windowed and full layers (two pools)
        num_window_blocks: int = 0,
        rope_switch_len: int = 0,  # a LongRoPE model's switch length
    ) -> None:
        max_model_len = min(max_model_len, num_kv_blocks * block_size)
        self.model_info = ModelInfo(
            "fake", ["fake"], max_model_len, block_size, 1000, [eos], "float32", num_kv_blocks, "0"
        )
        if num_window_blocks:
            self.model_info = msgspec.structs.replace(
                self.model_info, kv_window=window, num_window_blocks=num_window_blocks
            )
        self.model_info = msgspec.structs.replace(self.model_info, rope_switch_len=rope_switch_len)
        self.block_size = block_size
        # the tables a worker would hold: each request's block ids in each pool
        self.tables: dict[str, tuple[list[int], list[int]]] = {}
        if pooling is not None:
            kind = "MEAN" if pooling == "encoder" else pooling
            self.model_info = msgspec.structs.replace(
                self.model_info,
                runner="pooling",
                pooling_tasks=["embed", "score"],
                pooler=PoolerConfig(pooling_type=kind, normalize=True),
                is_encoder=pooling == "encoder",
            )
        self.pooling_ids: set[str] = set()
        self.num_tokens: dict[str, int] = {}
        self.num_computed: dict[str, int] = {}
        self.token_for: dict[str, list[int]] = {}  # scripted outputs per request id
        self.fail: dict[str, str] = {}  # request id -> the error its next sample reports (a grammar's)
        self.steps: list[SchedulerOutput] = []
        self.submitted: deque[SchedulerOutput] = deque()
        self.calls: list[WorkerCall] = []
        self.call_results: dict[str, Any] = {}

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        self.submitted.append(scheduler_output)

    def call(self, call: WorkerCall, timeout_s: float | None = None) -> WorkerCallResult:
        """Worker calls (LoRA, sleep, ...): recorded, and answered with `call_results` (None by default)."""
        self.calls.append(call)
        return WorkerCallResult(result=self.call_results.get(call.method))

    def collect(self) -> ModelRunnerOutput:
        """Runs the oldest step submitted, as a worker process would have by now."""
        return self.execute_model(self.submitted.popleft())

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(scheduler_output)
        for request_id in scheduler_output.finished_request_ids:
            self.num_tokens.pop(request_id, None)
            self.num_computed.pop(request_id, None)
            self.tables.pop(request_id, None)
        for new in scheduler_output.new_requests:
            assert new.request_id not in self.num_tokens, "a request was sent twice without being dropped"
            self.num_tokens[new.request_id] = len(new.prompt_token_ids) + len(new.output_token_ids)
            self.num_computed[new.request_id] = new.num_computed_tokens
            self.tables[new.request_id] = (list(new.block_ids), list(new.window_block_ids))
            if new.pooling_params is not None:
                self.pooling_ids.add(new.request_id)
        for cached in scheduler_output.cached_requests:
            assert self.num_computed[cached.request_id] == cached.num_computed_tokens
            full, sliding = self.tables[cached.request_id]
            full += cached.new_block_ids
            sliding += cached.new_window_block_ids
        sampled = {}
        pooled = {}
        for request_id, count in scheduler_output.num_scheduled_tokens.items():
            self.num_computed[request_id] += count
            assert self.num_computed[request_id] <= self.num_tokens[request_id]
            full, sliding = self.tables[request_id]
            # every token the step writes has a slot in each pool's table
            assert len(full) * self.block_size >= self.num_computed[request_id], request_id
            if self.model_info.num_window_blocks:
                assert len(sliding) == len(full), request_id
            else:
                assert not sliding, request_id
            if request_id in self.pooling_ids:
                if self.num_computed[request_id] == self.num_tokens[request_id]:  # the prompt's vector
                    pooled[request_id] = PooledOutput(
                        struct.pack("<2f", self.num_tokens[request_id], 1.0), [2]
                    )
                continue
            if self.num_computed[request_id] == self.num_tokens[request_id]:
                script = self.token_for.get(request_id, [])
                position = self.num_tokens[request_id]
                sampled[request_id] = [script.pop(0) if script else 10 + position % 50]
                self.num_tokens[request_id] += 1
        errors = {
            r: RequestError("structured_outputs", self.fail.pop(r)) for r in list(sampled) if r in self.fail
        }
        return ModelRunnerOutput(sampled, errors=errors, pooled=pooled)

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass
