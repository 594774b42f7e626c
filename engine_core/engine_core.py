"""EngineCore.step() = schedule -> executor.submit -> executor.collect -> update_from_output. No sockets.

With async scheduling the step after the one running is scheduled and submitted before the running
one's output is collected, so a worker finds its next step waiting when it finishes one (a batch queue
of depth 2); the scheduler's bookkeeping for that is in engine_core/scheduler.py. The cost: a request
that arrives while a step runs joins the step after next. Clients (a chat user's next turn, a benchmark
at fixed concurrency) send a new request when one ends, so after a step that finished requests (or an
abort) the engine collects the step in flight before scheduling again, and the newcomer is a step late
no more.

Invariants: every request added is eventually returned with a finish reason (stop, length or
abort), and once finished its blocks are back in the pool.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from engine_core.config import SchedulerConfig
from engine_core.executor import Executor
from engine_core.kv_transfer import kv_transfer_for
from engine_core.lora_table import LoraTable
from engine_core.mm_inputs import check_mm_inputs
from engine_core.request import Request, RequestStatus
from engine_core.run_state import RunState
from engine_core.scheduler import Scheduler
from engine_core.utilities import call_utility
from engine_core.weight_updates import WeightUpdates
from protocol.config import EngineConfig
from protocol.errors import InvalidParameterError
from protocol.messages import AddRequest, ModelInfo, RequestOutput, SchedulerStats

logger = logging.getLogger("engine.core")

POOLING_STEP_TOKENS = 2048  # a pooling model's smallest step budget (vLLM's default budget)


def prefix_cache_serves(info: ModelInfo) -> bool:
    """A generative model, or a causal one pooling its last token: an encoder's keys depend on the tokens
    after them, and MEAN, CLS and ALL pooling need every token's hidden state, which a cached block lacks."""
    if info.runner != "pooling":
        return True
    return not info.is_encoder and info.pooler is not None and info.pooler.pooling_type == "LAST"


def check_encoder_input(message: AddRequest, info: ModelInfo) -> None:
    """An encoder-decoder model's request carries one encoder input of the model's shape; no other does."""
    encoder = message.encoder_input
    if (encoder is not None) != (info.encoder_len > 0):
        raise InvalidParameterError(
            "model",
            "this model transcribes audio: each request needs its audio"
            if encoder is None
            else "this model takes no audio input.",
        )
    if encoder is None:
        return
    shape = [info.num_mel_bins, 2 * info.encoder_len]
    if encoder.shape != shape or len(encoder.data) != 4 * shape[0] * shape[1]:
        raise InvalidParameterError(
            "file", f"the audio's features must be float32 of shape {shape}; got {encoder.shape}."
        )
    if encoder.num_tokens != info.encoder_len:
        raise InvalidParameterError("file", f"an encoder input is {info.encoder_len} positions.")


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor) -> None:
        self.executor = executor
        # The worker reports the model and the pool; only the engine knows its prefix caching and policy.
        info = executor.model_info
        max_loras = config.worker.lora.max_loras if config.worker.lora is not None else 0
        self.model_info: ModelInfo = msgspec.structs.replace(
            info,
            enable_prefix_caching=config.enable_prefix_caching and prefix_cache_serves(info),
            scheduling_policy=config.scheduling_policy,
            max_loras=max_loras,
            data_parallel_rank=config.data_parallel_rank,
            data_parallel_addresses=config.data_parallel_addresses,
        )
        budget = config.max_num_batched_tokens
        if info.runner == "pooling":
            # no decode rows to keep waiting short: a pooling step takes at least POOLING_STEP_TOKENS (served
            # MiniLM, 1,024 inputs: 62 inputs/s with 256-token steps, 78 with 2,048; Zen 4, float32), and an
            # encoder's input runs whole in one step (vLLM turns chunked prefill off for encoders)
            least = max(POOLING_STEP_TOKENS, info.max_model_len if info.is_encoder else 0)
            if budget < least:
                logger.info("max_num_batched_tokens %d -> %d for a pooling model", budget, least)
                budget = least
        if info.whole_image_spans and budget < info.max_image_tokens:
            # NOTE: an image's span is computed in one step (its tokens see each other both ways)
            raise ValueError(
                f"max_num_batched_tokens {budget} is below one image's {info.max_image_tokens} tokens, which "
                f"{info.model} computes in one step: raise --max-num-batched-tokens"
            )
        capacity = self.model_info.num_kv_blocks * self.model_info.block_size
        if self.model_info.max_model_len > capacity:
            # NOTE: a request that cannot fit the pool alone would preempt itself forever.
            raise ValueError(
                f"max_model_len {self.model_info.max_model_len} exceeds the KV pool's {capacity} tokens: "
                "lower max_model_len or give the KV cache more memory"
            )
        max_num_seqs = config.max_num_seqs
        if info.max_num_encoder_outputs and info.max_num_encoder_outputs < max_num_seqs:
            logger.info("max_num_seqs %d -> %d: the encoder outputs the KV cache memory holds",
                        max_num_seqs, info.max_num_encoder_outputs)  # fmt: skip
            max_num_seqs = info.max_num_encoder_outputs
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=self.model_info.max_model_len,
            block_size=self.model_info.block_size,
            num_kv_blocks=self.model_info.num_kv_blocks,
            enable_prefix_caching=self.model_info.enable_prefix_caching,
            policy=config.scheduling_policy,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            decode_prefill_token_budget=config.decode_prefill_token_budget,
            decode_prefill_tokens_per_decode=config.decode_prefill_tokens_per_decode,
            decode_prefill_tokens_per_request=config.decode_prefill_tokens_per_request,
            chunked_prefill=not info.is_encoder,
            max_loras=max_loras,
            kv_window=info.kv_window,
            num_window_blocks=info.num_window_blocks,
            rope_switch_len=info.rope_switch_len,
            rope_dynamic_len=info.rope_dynamic_len,
            # NOTE: one step computes at most a step budget's encoder positions, and always one input's
            # (an image's tower too: vLLM's encoder compute budget and cache, both at least one image's)
            max_num_encoder_input_tokens=max(budget, info.encoder_len or info.max_image_tokens)
            if info.encoder_len or info.image_token_id >= 0
            else 0,
            encoder_cache_tokens=max(budget, info.max_image_tokens) if info.image_token_id >= 0 else 0,
            whole_image_spans=info.whole_image_spans,
        )
        kv_transfer = kv_transfer_for(config.worker.kv_transfer, self.model_info, config.worker.parallel)
        self.scheduler = Scheduler(self.scheduler_config, self.model_info.eos_token_ids, kv_transfer)
        self.num_steps = 0
        self.max_steps_in_flight = 2 if config.async_scheduling else 1
        self.request_ended = False  # since the last collect: run one step at a time until the next
        self.loras = LoraTable(config.worker.lora, executor, self.model_info.served_model_names)
        self.state = RunState()  # paused, asleep (the operator's endpoints)
        self.profiler_dir = config.profiler_dir
        self.weight_transfer = config.worker.weight_transfer  # None: weight updates are off
        self.weight_updates = WeightUpdates(num_ranks=config.worker.parallel.tensor_parallel_size)
        self.pending_outputs: list[tuple[Request, RequestOutput]] = []
        for module in config.lora_modules:
            try:
                self.loras.load(module.name, module.path, module.base_model_name)
            except InvalidParameterError as error:
                raise ValueError(f"--lora-modules {module.name}: {error.message}") from error

    def add_request(self, message: AddRequest, client_id: str = "") -> None:
        """Validate and queue; raises InvalidParameterError for what the frontend should have caught."""
        info = self.model_info
        self.state.check_new_request()
        if not message.prompt_token_ids:
            raise InvalidParameterError("prompt", "the prompt must contain at least one token.")
        if any(not 0 <= token_id < info.vocab_size for token_id in message.prompt_token_ids):
            raise InvalidParameterError("prompt", f"prompt token ids must be in [0, {info.vocab_size}).")
        check_encoder_input(message, info)
        check_mm_inputs(message, info, self.scheduler_config)  # engine_core/mm_inputs.py
        pooling = message.pooling_params
        if (pooling is not None) != (info.runner == "pooling"):
            runner = (
                "a pooling model: it embeds, scores and classifies"
                if pooling is None
                else "a generative model"
            )
            raise InvalidParameterError("model", f"this model is {runner}; it cannot serve this request.")
        if pooling is not None and pooling.task not in info.pooling_tasks:
            raise InvalidParameterError(
                "task",
                f"this model does not serve {pooling.task!r}; it serves {', '.join(info.pooling_tasks)}.",
            )
        if pooling is not None and pooling.dimensions is not None:
            sizes = info.pooler.matryoshka_dimensions if info.pooler is not None else []
            if pooling.dimensions not in sizes and pooling.dimensions != info.hidden_size:
                raise InvalidParameterError(
                    "dimensions",
                    f"this model's embeddings come in the sizes {sizes or [info.hidden_size]} (Matryoshka), "
                    f"not {pooling.dimensions}.",
                )
        start = pooling.token_type_start if pooling is not None else None
        if start is not None and not (info.is_encoder and 0 < start < len(message.prompt_token_ids)):
            raise InvalidParameterError(
                "token_type_start", "token types are an encoder's, from a position inside the prompt."
            )
        # a pooling request outputs no token: its prompt may fill max_model_len
        limit = info.max_model_len + (pooling is not None)
        if len(message.prompt_token_ids) >= limit:
            raise InvalidParameterError(
                "prompt",
                f"the prompt has {len(message.prompt_token_ids)} tokens; max_model_len is {info.max_model_len}.",
            )
        message.sampling_params.validate(info.vocab_size)
        if message.sampling_params.n != 1:
            raise InvalidParameterError("n", "the engine takes n == 1; the frontend fans n > 1 out.")
        lora = self.loras.resolve(message.lora_name) if message.lora_name is not None else None
        request = Request.from_add(message, client_id, info.block_size, lora)
        if message.kv_transfer_params is not None:
            if self.scheduler.kv_transfer is None:
                raise InvalidParameterError(
                    "kv_transfer_params",
                    "this engine transfers no KV: it was started without --kv-transfer-config.",
                )
            self.scheduler.kv_transfer.add(request, message.kv_transfer_params)
        self.scheduler.add_request(request)

    def abort_requests(
        self, request_ids: list[str], reason: str | None = None
    ) -> list[tuple[Request, RequestOutput]]:
        """reason: the abort outputs' stop_reason (None: the owner reads the abort as a fault)."""
        finished = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        self.request_ended |= bool(finished)
        self.loras.sweep(self.scheduler.requests.values())
        return [
            (
                request,
                RequestOutput(
                    request.request_id, [], finish_reason="abort", stop_reason=reason, num_cached_tokens=0
                ),
            )
            for request in finished
        ]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.scheduler.steps_in_flight)

    def can_step(self) -> bool:
        """Whether step() has work: a step in flight, or requests it may schedule (not while paused or
        asleep, where the busy loop blocks on its input instead)."""
        if self.scheduler.steps_in_flight:
            return True
        if self.state.frozen:
            return False
        scheduler = self.scheduler
        if scheduler.running or (len(scheduler.waiting) > 0 and self.state.admits):
            return True
        return scheduler.num_preempted_waiting > 0  # paused "wait": the preempted go on too

    def step(self) -> list[tuple[Request, RequestOutput]]:
        """Submit the next step if the queue has room, then collect the oldest once the queue is full
        (or nothing more could be scheduled); the outputs of the step collected, if any."""
        in_flight = self.scheduler.steps_in_flight
        submitted = False
        depth = 1 if self.request_ended else self.max_steps_in_flight
        self.scheduler.admit_waiting = self.state.admits
        if len(in_flight) < depth and not self.state.frozen and self.scheduler.has_unfinished_requests():
            scheduler_output = self.scheduler.schedule()
            if scheduler_output is not None:
                self.executor.submit(scheduler_output)
                submitted = True
        if not in_flight or (submitted and len(in_flight) < depth):
            return []
        model_output = self.executor.collect()
        self.num_steps += 1
        outputs = self.scheduler.update_from_output(model_output)
        self.request_ended = any(output.finish_reason for _, output in outputs)
        if self.request_ended:
            self.loras.sweep(self.scheduler.requests.values())
        return outputs

    def make_stats(self) -> SchedulerStats:
        stats = self.scheduler.make_stats()
        stats.paused, stats.sleeping, stats.sleep_level = (
            self.state.paused,
            list(self.state.sleeping),
            self.state.sleep_level,
        )
        return stats

    def call_utility(self, method: str, args: list[Any]) -> Any:
        """A frontend's UTILITY call (engine_core/utilities.py lists them)."""
        return call_utility(self, method, args)

    def take_pending_outputs(self) -> list[tuple[Request, RequestOutput]]:
        """Outputs a utility call made (a pause that aborted requests): for their owners."""
        outputs, self.pending_outputs = self.pending_outputs, []
        return outputs

    def shutdown(self) -> None:
        self.executor.shutdown()
