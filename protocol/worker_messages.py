"""Messages between the EngineCore and its worker processes. SchedulerOutput is a diff of the batch."""

from __future__ import annotations

from typing import Any

import msgspec

from protocol.kv_transfer import KVLoad, KVSave
from protocol.lora import LoraRequest
from protocol.media import EncoderInput, MultiModalInput
from protocol.messages import Logprobs, ModelInfo, RequestError
from protocol.pooling import PooledOutput, PoolingParams
from protocol.sampling import SamplingParams


class NewRequestData(msgspec.Struct, array_like=True):
    """A request the worker has not seen (or is resuming after preemption): sent in full."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty only when resuming after preemption
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # prefix-cache hit length at schedule time
    pooling_params: PoolingParams | None = None  # a pooling request: pooled when its prompt is computed
    lora: LoraRequest | None = None  # the adapter its products add (None: the base model)
    window_block_ids: list[int] = []  # its table in the windowed layers' pool (ModelInfo.num_window_blocks)
    # an encoder-decoder model's input: the worker runs the encoder on it once (this step) and keeps the
    # cross-attention keys and values until the request finishes or is preempted
    encoder_input: EncoderInput | None = None
    mm_inputs: list[MultiModalInput] = []  # its images (the engine says when each one's tower runs)


class CachedRequestData(msgspec.Struct, array_like=True):
    """A request the worker already holds: only what changed."""

    request_id: str
    new_block_ids: list[int]  # appended to its block table
    num_computed_tokens: int
    new_window_block_ids: list[int] = []  # appended to its table in the windowed layers' pool


class SchedulerOutput(msgspec.Struct, tag="schedule", array_like=True):
    """engine -> worker: the batch of one step."""

    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # request id -> tokens to compute this step
    total_num_scheduled_tokens: int
    finished_request_ids: list[str]  # finished, aborted or preempted since the last step: drop their state
    preempted_request_ids: list[str] = []  # subset of the above that will come back as new requests
    # request id -> indices of its images whose vision tower runs this step; the worker keeps each output
    # until the request's computed tokens pass the image's span (or the request leaves)
    scheduled_encoder_inputs: dict[str, list[int]] = {}
    kv_loads: list[KVLoad] = []  # remote KV to read into blocks before the forward (protocol/kv_transfer.py)
    kv_saves: list[KVSave] = []  # prompt prefixes to write out after it


class ModelRunnerOutput(msgspec.Struct, tag="model_output", array_like=True):
    """worker -> engine: the result of one step."""

    sampled_token_ids: dict[str, list[int]]  # only requests whose prompt is fully computed sample
    logprobs: dict[str, Logprobs] = {}
    prompt_logprobs: dict[str, Logprobs] = {}
    errors: dict[str, RequestError] = {}  # requests the worker cannot go on with (a grammar that failed
    # to compile in time): the engine finishes each with finish_reason "error"
    pooled: dict[str, PooledOutput] = {}  # pooling requests whose prompt this step finished
    num_encoder_inputs: int = 0  # the encoder inputs this step ran: images (a vision tower), audio (Whisper)
    encoder_seconds: float = 0.0  # and its time in them
    kv_load_errors: dict[str, str] = {}  # requests whose KV load failed, and why: their rows are not valid


class WorkerReady(msgspec.Struct, tag="worker_ready", array_like=True):
    """worker -> engine: the model is loaded and the KV pool allocated."""

    model_info: ModelInfo


class WorkerError(msgspec.Struct, tag="worker_error", array_like=True):
    """worker -> engine: a step or the load failed; the engine treats it as fatal."""

    message: str
    refused: bool = False  # the load refused the user's settings or model (one line, no traceback)


class WorkerCall(msgspec.Struct, tag="worker_call", array_like=True):
    """engine -> worker: call one of the worker's methods between steps (ModelRunner.CALLS: LoRA adapters,
    sleep and wake, the profiler, collective_rpc's allowlist); answered by WorkerCallResult in order."""

    method: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}


class WorkerCallResult(msgspec.Struct, tag="worker_call_result", array_like=True):
    """worker -> engine: a WorkerCall's return value (msgpack-able), or why it failed."""

    result: Any = None
    error: str | None = None  # the exception's message; the engine raises it to the caller
    param: str | None = None  # set when the caller's input was at fault (an InvalidParameterError)
    per_rank: list[Any] = []  # tensor parallel: ranks 1.. results, beside rank 0's in `result`


class WorkerShutdown(msgspec.Struct, tag="shutdown", array_like=True):
    """engine -> worker: exit cleanly."""


EngineToWorker = SchedulerOutput | WorkerCall | WorkerShutdown
WorkerToEngine = ModelRunnerOutput | WorkerReady | WorkerError | WorkerCallResult
