"""Messages between frontends and the EngineCore. Tagged msgspec structs; field order is an ABI.

Append defaulted fields only, and bump PROTOCOL_VERSION for anything else.
"""

from __future__ import annotations

from typing import Any

import msgspec

from protocol.media import EncoderInput, MultiModalInput
from protocol.pooling import PooledOutput, PoolerConfig, PoolingParams
from protocol.sampling import SamplingParams

PROTOCOL_VERSION = 14  # 2: RequestOutput gained queue/prefill/decode times; 3: SchedulerStats grew;
# 4: RequestOutput.error (typed rejections), SamplingParams.allowed_token_ids and bad_words_token_ids;
# 5: SamplingParams.structured_outputs, ModelInfo.structured_outputs_backend; 6: pooling (ModelInfo's
# runner and tasks, AddRequest.pooling_params, RequestOutput.pooled); 7: LoRA (RequestError.code,
# SchedulerStats' adapters, NewRequestData.lora, the worker calls); 8: data parallel (ModelInfo's
# data_parallel_rank and data_parallel_addresses); 9: encoder-decoder models (AddRequest.encoder_input,
# ModelInfo's encoder fields, NewRequestData.encoder_input); 10: images (AddRequest.mm_inputs, ModelInfo's
# image fields, NewRequestData.mm_inputs, SchedulerOutput.scheduled_encoder_inputs); 11:
# ModelInfo.whole_image_spans (Gemma 3); 12: SamplingParams.logprob_token_ids; 13: KV transfer
# (AddRequest and RequestOutput kv_transfer_params, SchedulerOutput's kv_loads and kv_saves,
# ModelRunnerOutput.kv_load_errors); 14: elastic data parallel (EngineSet)

# Inclusive upper bounds of SchedulerStats.iteration_tokens_buckets: vLLM's for iteration_tokens_total.
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class Register(msgspec.Struct, tag="register", array_like=True):
    """frontend -> engine: join. The engine answers Ready (or Rejected) on the output socket."""

    protocol_version: int  # must equal the engine's PROTOCOL_VERSION
    client_id: str  # the frontend's ZMQ identity; outputs for its requests are routed to it


class ModelInfo(msgspec.Struct, array_like=True):
    """What a frontend needs to know of the model the engine serves."""

    model: str  # path of the folder or .gguf file the worker loaded
    served_model_names: list[str]  # names the API accepts in `model`
    max_model_len: int  # prompt + output tokens per request
    block_size: int  # tokens per KV block
    vocab_size: int  # logits width
    eos_token_ids: list[int]  # ids that end generation unless ignore_eos
    dtype: str  # weights and activations dtype, e.g. "bfloat16"
    num_kv_blocks: int  # size of the KV pool
    engine_version: str  # package version of the engine
    enable_prefix_caching: bool = True  # set by the EngineCore from its config (the worker cannot know)
    scheduling_policy: str = "fcfs"  # likewise: "priority" is the only policy that reads `priority`
    structured_outputs_backend: str = "guidance"  # the worker's grammar backend: frontends validate with it
    batch_invariant: bool = False  # whether greedy output is independent of the batch (the worker's kernels)
    # what an operator should know of how the worker serves (e.g. without the csrc kernels): /health's detail
    notices: list[str] = msgspec.field(default_factory=list)
    # or "pooling": the model returns pooled values, not tokens; or "transcription": an encoder-decoder
    # speech model (Whisper) that generates tokens from each request's encoder input
    runner: str = "generate"
    pooling_tasks: list[str] = msgspec.field(
        default_factory=list
    )  # what a pooling model does (POOLING_TASKS)
    pooler: PoolerConfig | None = None  # a pooling model's resolved defaults
    hidden_size: int = 0  # the width of a pooled vector before `dimensions`
    id2label: dict[str, str] = msgspec.field(default_factory=dict)  # a classifier's labels, by index
    is_encoder: bool = False  # bidirectional attention: no prefix cache, an input in one step
    max_loras: int = 0  # >0: LoRA is on (set by the EngineCore); requests may name an adapter as `model`
    data_parallel_rank: int = 0  # which of the deployment's engines this is (set by the EngineCore)
    # every engine's [input, output] addresses in rank order, this one's included ([]: the only engine), so
    # that a frontend attached to one engine finds the others
    data_parallel_addresses: list[list[str]] = msgspec.field(default_factory=list)
    # >0: every layer attends to at most this many keys (a sliding window): the engine frees a request's
    # KV blocks once they fall out of it
    kv_window: int = 0
    # >0: a model mixing windowed and full layers: the windowed layers (window kv_window) have their own
    # pool of this many blocks and each request a second block table (engine_core/hybrid_kv_cache.py)
    num_window_blocks: int = 0
    # >0: a LongRoPE model: a request with more tokens runs on the long factors at every position, so the
    # engine recomputes one that crosses it (as transformers does) and keys its prefix-cache blocks apart
    rope_switch_len: int = 0
    # >0: a dynamic NTK rope served past max_position_embeddings (this many): the keys of a longer prompt
    # are rotated on frequencies of the prompt's length, so the engine keys its prefix-cache blocks apart
    rope_dynamic_len: int = 0
    # >0: an encoder-decoder model (Whisper, runner "transcription"): each request carries one encoder input
    # (AddRequest.encoder_input) of this many encoder positions, run once when the request is first scheduled
    encoder_len: int = 0
    num_mel_bins: int = 0  # the encoder's input: [num_mel_bins, 2 * encoder_len] (Whisper's log-mel bins)
    # requests that may hold an encoder output at once (the worker's store of cross-attention keys and
    # values): the engine runs at most this many
    max_num_encoder_outputs: int = 0
    # >=0: a vision-language model: the token an image's embeddings replace (MultiModalInput)
    image_token_id: int = -1
    max_image_tokens: int = 0  # the most embeddings one image makes: a step's encoder budget is at least this
    # an image's span is computed in one step, never cut between steps (Gemma 3: its tokens see each other
    # both ways); vLLM's --disable-chunked-mm-input, which such a model needs
    whole_image_spans: bool = False


class Ready(msgspec.Struct, tag="ready", array_like=True):
    """engine -> frontend: registration accepted."""

    protocol_version: int
    model_info: ModelInfo


class Rejected(msgspec.Struct, tag="rejected", array_like=True):
    """engine -> frontend: registration refused (e.g. protocol version mismatch)."""

    reason: str


class AddRequest(msgspec.Struct, tag="add", array_like=True, kw_only=True):
    """frontend -> engine: start generating for one request."""

    request_id: str  # unique across all frontends (frontends prefix their own id)
    prompt_token_ids: list[int]  # the tokenized prompt
    sampling_params: SamplingParams  # with n == 1: the frontend fans n > 1 out
    arrival_time: float  # time.time() when the frontend received it
    priority: int = 0  # lower is served first under the priority policy
    lora_name: str | None = None  # part of the prefix-cache key
    cache_salt: str | None = None  # isolates prefix-cache entries between tenants
    pooling_params: PoolingParams | None = None  # a pooling request: prefill only, finished with `pooled`
    encoder_input: EncoderInput | None = None  # an encoder-decoder model's input (ModelInfo.encoder_len)
    mm_inputs: list[MultiModalInput] = []  # a vision-language model's images, in prompt order
    kv_transfer_params: dict[str, Any] | None = None  # vLLM's: produce KV for a remote decode, or load it


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    """frontend -> engine: stop these requests and free their blocks. Idempotent."""

    request_ids: list[str]
    reason: str | None = None  # the abort outputs' stop_reason: a deliberate end (e.g. a cancel), not a fault


class UtilityCall(msgspec.Struct, tag="utility", array_like=True):
    """frontend -> engine: call a named engine method; answered by UtilityResult."""

    call_id: int  # chosen by the frontend, echoed in the result
    method: str  # e.g. "reset_prefix_cache", "get_stats"
    args: list[msgspec.Raw] = []  # msgpack-encoded positional arguments


class UtilityResult(msgspec.Struct, tag="utility_result", array_like=True):
    """engine -> frontend: the answer to a UtilityCall."""

    call_id: int
    result: msgspec.Raw  # msgpack-encoded return value (nil when the call raised)
    error: str | None = None  # set when the call raised
    param: str | None = None  # set when the caller's input was at fault: the HTTP edge answers 400
    code: str | None = None  # e.g. "model_not_found": 404


class Logprobs(msgspec.Struct, array_like=True):
    """Logprobs for a run of positions. Row i: the chosen token first, then the top alternatives."""

    token_ids: list[list[int]]  # [num_positions][1 + num_top]
    logprobs: list[list[float]]  # [num_positions][1 + num_top], same order
    ranks: list[int]  # [num_positions] rank of the chosen token (1 = most likely)


class RequestError(msgspec.Struct, array_like=True):
    """Why the engine refused a request: the HTTP edge answers 400 with `param` and `message`."""

    param: str  # the request field at fault, e.g. "prompt" or "max_tokens"
    message: str  # a sentence for the caller
    code: str | None = None  # e.g. "model_not_found" (an adapter the engine does not have): a 404


class RequestOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one request produced in one engine step."""

    request_id: str
    new_token_ids: list[int]  # tokens sampled this step (0 or 1 today)
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"; None while running
    stop_reason: int | str | None = None  # the stop token id that matched, if any
    new_logprobs: Logprobs | None = None  # for new_token_ids, when asked
    new_prompt_logprobs: Logprobs | None = None  # for the prompt positions computed this step
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    queue_time_s: float = 0.0  # set when finished: received by the engine -> first scheduled
    prefill_time_s: float = 0.0  # set when finished: first scheduled -> first token
    decode_time_s: float = 0.0  # set when finished: first token -> last token
    error: RequestError | None = None  # set (with finish_reason "error") when the engine refused it
    pooled: PooledOutput | None = None  # a pooling request's value, with finish_reason "stop"
    kv_transfer_params: dict[str, Any] | None = None  # set when finished: where a decode engine finds its KV


class SchedulerStats(msgspec.Struct, array_like=True):
    """A snapshot of the engine after a step; counters are cumulative since start."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of blocks in use, 0..1
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found
    num_preemptions: int = 0
    num_prompt_tokens: int = 0  # prompt tokens computed (not cached)
    num_generation_tokens: int = 0
    num_waiting_tokens: int = 0  # prompt tokens of the waiting requests (admission control)
    num_steps: int = 0  # steps executed: frozen while requests are open means a stalled engine
    # steps by tokens scheduled: [i] counts steps with ITERATION_TOKENS_BUCKETS[i-1] < tokens <= [i],
    # the last entry those above the largest bound (per bucket, not cumulative; the sum is num_steps)
    iteration_tokens_buckets: list[int] = msgspec.field(
        default_factory=lambda: [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
    )
    iteration_tokens_sum: int = 0  # tokens scheduled over all steps executed
    running_loras: list[str] = []  # adapters of the running requests (vLLM's lora_requests_info)
    waiting_loras: list[str] = []  # adapters of the waiting requests
    max_loras: int = 0  # adapters one step may mix; 0: LoRA off
    paused: str = ""  # "abort", "wait" or "keep" while paused (POST /pause); "" when running
    sleeping: list[str] = []  # what sleeps (POST /sleep): "weights", "kv_cache"; [] when awake
    sleep_level: int = 0  # 1: weights kept in a file; 2: weights dropped (reloaded on wake)
    num_encoder_inputs: int = 0  # encoder inputs run: images (a vision tower), audio (a Whisper encoder)
    encoder_seconds: float = 0.0  # the worker's time in those encoders


class EngineOutputs(msgspec.Struct, tag="outputs", array_like=True):
    """engine -> frontend: this frontend's share of one step."""

    outputs: list[RequestOutput]
    timestamp: float  # time.time() after the step
    scheduler_stats: SchedulerStats | None = None


class EngineDead(msgspec.Struct, tag="dead", array_like=True):
    """engine -> all frontends: sent before the engine exits on a fatal error."""

    reason: str


class EngineAnnounce(msgspec.Struct, tag="announce", array_like=True):
    """data-parallel engine -> engine 0, once it listens: where it is (engine 0 lists every engine's
    addresses in its ModelInfo, and answers frontends' registrations once it knows them all)."""

    protocol_version: int
    data_parallel_rank: int
    input_address: str
    output_address: str


class EngineSet(msgspec.Struct, tag="engine_set", array_like=True):
    """engine 0 -> all frontends: the data-parallel engines now (elastic scaling, docs/parallel.md), in rank
    order, and whether a change is under way (new requests get 503 meanwhile). A frontend connects to the
    engines it lacks and drops those no longer listed (their requests drained before)."""

    addresses: list[list[str]]  # [input, output] per engine
    scaling: bool


FrontendMessage = Register | AddRequest | AbortRequests | UtilityCall | EngineAnnounce
EngineMessage = Ready | Rejected | EngineOutputs | UtilityResult | EngineDead | EngineSet
