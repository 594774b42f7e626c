"""The scheduler: one token budget per step, no prefill or decode phases.

Each request has num_computed_tokens chasing num_tokens (prompt + output). A step gives each
running request, then waiting ones, as many tokens as the budget allows, so chunked prefill,
prefix-cache hits and mixed batches are one rule. When blocks run out, the lowest-priority running
request is preempted: its blocks are freed and it goes back to the front of the queue to be
recomputed (it usually hits its own blocks in the prefix cache).

Async scheduling: the engine may schedule a step while the step before it is still running. A request
in flight then has tokens ahead of its computed count (num_tokens_ahead) and, if that step samples
for it, one output ahead (num_outputs_ahead) that only the worker knows yet; the next step computes
that output as its input token. Outputs come back in step order and are matched to the Request objects
they were scheduled for, so a request finished, aborted or preempted meanwhile drops its stale output.

Invariants (check_invariants):
- scheduled tokens never exceed max_num_batched_tokens; running requests never exceed max_num_seqs;
- a step's new encoder inputs (whole) fit max_num_encoder_input_tokens: new audio cannot starve decodes;
  likewise the images whose tower a step runs (a prefill chunk stops before an image that does not fit),
  and the images the worker holds (scheduled, span not yet computed past) fit encoder_cache_tokens;
- the running requests use at most max_loras distinct LoRA adapters (the worker's slots), so every step
  fits them; a waiting request whose adapter would be one more waits, and later ones may go first;
- every running request holds blocks for its computed tokens; waiting ones hold none;
- a finished request is in neither queue and holds no blocks;
- the step-token histogram (iteration_tokens_buckets) counts each step executed once: it sums to num_steps.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from engine_core.config import SchedulerConfig
from engine_core.encoder_room import embeds_of, encoder_room, fit_encoder_inputs, take_encoder_inputs
from engine_core.hybrid_kv_cache import kv_cache_for
from engine_core.kv_transfer import KVTransferScheduler
from engine_core.prefill_share import prefill_share
from engine_core.request import Request, RequestStatus
from engine_core.scheduler_invariants import check_scheduler
from engine_core.waiting_queue import WaitingQueue
from protocol.errors import InvalidParameterError
from protocol.kv_transfer import KVSave
from protocol.messages import ITERATION_TOKENS_BUCKETS, RequestOutput, SchedulerStats
from protocol.worker_messages import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput


@dataclass
class ScheduledRequest:
    request: Request
    num_tokens: int
    samples: bool  # the step computes the request's last known token, so it samples the next
    run: int  # the request's Request.num_runs when scheduled: an output of an earlier run is stale


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, eos: list[int], kv_transfer: KVTransferScheduler | None = None
    ):
        self.config = config
        self.eos_token_ids = frozenset(eos)
        self.kv_cache = kv_cache_for(config)
        self.kv_transfer = kv_transfer  # --kv-transfer-config (engine_core/kv_transfer.py)
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue(config.policy)
        self.running: list[Request] = []
        self.finished_request_ids: list[str] = []  # since the last schedule(): workers drop their state
        self.preempted_request_ids: list[str] = []
        self.sent_to_worker: set[str] = set()  # requests whose state the worker holds
        self.steps_in_flight: deque[dict[str, ScheduledRequest]] = deque()  # scheduled, no output yet
        self.num_preemptions = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_steps = 0
        self.iteration_tokens_buckets = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)  # SchedulerStats' layout
        self.iteration_tokens_sum = 0
        self.num_encoder_inputs = 0
        self.encoder_seconds = 0.0
        # False while the engine is paused: running requests go on (preempted ones come back), no new ones
        self.admit_waiting = True

    # ---- requests in and out ----

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise InvalidParameterError("request_id", f"request id {request.request_id!r} is already in use")
        if request.num_tokens >= self.config.max_model_len + (request.pooling_params is not None):
            raise ValueError(
                f"prompt of {request.num_tokens} tokens does not fit max_model_len {self.config.max_model_len}"
            )
        if request.num_tokens > self.config.num_kv_blocks * self.config.block_size:
            raise ValueError(f"prompt of {request.num_tokens} tokens does not fit the KV pool")
        request.passes_rope_switch(self.config.rope_switch_len)  # a prompt past it: long from the start
        request.key_dynamic_rope(self.config.rope_dynamic_len)
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """Finish (e.g. abort) requests by id; unknown or finished ids are ignored."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)
            finished.append(request)
        return finished

    def _free_request(self, request: Request) -> None:
        self.kv_cache.free(request)
        del self.requests[request.request_id]
        if request.request_id in self.sent_to_worker:
            self.sent_to_worker.discard(request.request_id)
            self.finished_request_ids.append(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    @property
    def num_preempted_waiting(self) -> int:
        """Waiting requests that ran before (preempted): a pause lets them back, as it lets running ones go on."""
        return sum(1 for request in self.waiting if request.status == RequestStatus.PREEMPTED)

    # ---- one step ----

    def schedule(self) -> SchedulerOutput | None:
        """The next step, or None when there is nothing for a worker to do (no tokens, no state to drop)."""
        budget = self.config.max_num_batched_tokens
        prefill_budget = self._prefill_budget()
        encoder_budget = self.config.max_num_encoder_input_tokens  # an encoder-decoder model's, per step
        num_scheduled: dict[str, int] = {}
        new_block_ids: dict[str, list[int]] = {}
        encoder_items: dict[str, list[int]] = {}  # the images whose tower runs this step
        room = encoder_room(self.running, self.config)
        preempted = False

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if request.num_outputs_ahead and self._length_capped_ahead(request):
                index += 1  # the step in flight samples its last token
                continue
            num_new = min(
                request.num_tokens_after_flight - request.num_computed_after_flight,
                budget,
                self._prefill_cap(),
            )
            prefill = num_new > 1 or request.num_computed_after_flight < request.num_prompt_tokens
            if prefill:
                num_new = min(num_new, prefill_budget)
            num_new, items = fit_encoder_inputs(
                request, request.num_computed_after_flight, num_new, room, self.config.whole_image_spans
            )
            if num_new <= 0:
                index += 1
                continue
            while True:
                new_blocks = self.kv_cache.allocate_slots(request, num_new)
                if new_blocks is not None:
                    break
                victim = self._pick_victim()
                if self.running.index(victim) < index:
                    index -= 1
                budget += num_scheduled.pop(victim.request_id, 0)
                new_block_ids.pop(victim.request_id, None)
                room.budget += embeds_of(victim, encoder_items.pop(victim.request_id, []))
                room.free += embeds_of(victim, victim.encoder_held)  # the worker drops them with it
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if new_blocks is None:
                continue  # the request itself was preempted; running shrank under index
            num_scheduled[request.request_id] = num_new
            new_block_ids[request.request_id] = [block.block_id for block in new_blocks]
            take_encoder_inputs(request, items, room, encoder_items)
            budget -= num_new
            if prefill:
                prefill_budget -= num_new
            index += 1

        # NOTE: after a preemption the pool is tight; admitting new work would only thrash.
        loras = (
            {r.lora.lora_id for r in self.running if r.lora is not None} if self.config.max_loras else set()
        )
        skipped: list[Request] = []  # waiting requests whose adapter would be one too many for the step
        while (
            not preempted
            and len(self.waiting) > 0
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting.peek()
            if not self.admit_waiting and request.status != RequestStatus.PREEMPTED:
                skipped.append(self.waiting.pop())  # paused: only the preempted go back to running
                continue
            if request.lora is not None and request.lora.lora_id not in loras:
                if len(loras) >= self.config.max_loras:
                    skipped.append(self.waiting.pop())  # vLLM's rule: later requests may still go
                    continue
            encoder_tokens = request.encoder_tokens_needed
            if encoder_tokens > encoder_budget:
                break  # its encoder waits for a step with room (running decodes go on meanwhile)
            computed_blocks, num_local = self.kv_cache.get_computed_blocks(request)
            # remote KV past the local hit counts as computed too: the worker loads it before the forward
            num_remote = self.kv_transfer.remote_tokens(request, num_local) if self.kv_transfer else 0
            num_cached = num_local + num_remote
            num_new = min(request.num_tokens - num_cached, budget, self._prefill_cap(), prefill_budget)
            if num_new <= 0 or (
                not self.config.chunked_prefill and num_new < request.num_tokens - num_cached
            ):
                break  # (an encoder's input waits for a step with room for all of it)
            num_new, items = fit_encoder_inputs(
                request, num_cached, num_new, room, self.config.whole_image_spans
            )
            if num_new <= 0:
                break  # its first image's tower waits for a step with room
            new_blocks = self.kv_cache.allocate_slots(request, num_remote + num_new, computed_blocks)
            if new_blocks is None:
                break
            self.waiting.pop()
            if num_remote:
                assert self.kv_transfer is not None
                block_ids = self.kv_cache.get_block_ids(request.request_id)
                self.kv_transfer.plan_load(request, block_ids, num_local, num_remote)
            encoder_budget -= encoder_tokens
            request.encoder_done = request.encoder_input is not None  # the worker runs it in this step
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
                request.first_scheduled_time = time.monotonic()
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if request.lora is not None:
                loras.add(request.lora.lora_id)
            take_encoder_inputs(request, items, room, encoder_items)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            prefill_budget -= num_new
        for request in reversed(skipped):
            self.waiting.add_front(request)

        return self._make_output(num_scheduled, new_block_ids, encoder_items)

    def _length_capped_ahead(self, request: Request) -> bool:
        """Whether the outputs in flight take the request to max_tokens or max_model_len (a pooling request:
        its one output, the pooled value)."""
        if request.pooling_params is not None:
            return True
        max_tokens = request.sampling_params.max_tokens
        num_outputs = request.num_output_tokens + request.num_outputs_ahead
        return (max_tokens is not None and num_outputs >= max_tokens) or (
            request.num_tokens_after_flight >= self.config.max_model_len
        )

    def _prefill_budget(self) -> int:
        """The step's prefill tokens (engine_core/prefill_share.py)."""
        decoding = sum(
            1
            for r in self.running
            if r.num_computed_after_flight >= r.num_prompt_tokens and r.pooling_params is None
        )  # a pooling request whose last chunk is in flight decodes nothing
        return prefill_share(self.config, decoding, len(self.running) + len(self.waiting))

    def _prefill_cap(self) -> int:
        cap = self.config.long_prefill_token_threshold
        # an encoder's input is never cut: the threshold would keep a long one waiting forever
        return cap if cap > 0 and self.config.chunked_prefill else self.config.max_num_batched_tokens

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running)
        return self.running[-1]

    def _preempt(self, request: Request, counted: bool = True) -> None:
        """counted: for want of blocks (a LongRoPE switch is not)."""
        self.running.remove(request)
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_tokens_ahead = request.num_outputs_ahead = 0  # the output in flight is dropped
        request.encoder_done = False  # the worker drops its cross-attention keys and values too
        request.encoder_held = set()  # and its images' tower outputs
        request.num_preemptions += counted
        request.num_runs += 1
        self.num_preemptions += counted
        if request.request_id in self.sent_to_worker:
            self.sent_to_worker.discard(request.request_id)
            self.preempted_request_ids.append(request.request_id)
        self.waiting.add_front(request)

    def _make_output(
        self,
        num_scheduled: dict[str, int],
        new_block_ids: dict[str, list[int]],
        encoder_items: dict[str, list[int]],
    ) -> SchedulerOutput | None:
        if not num_scheduled and not self.finished_request_ids and not self.preempted_request_ids:
            return None
        new_requests = []
        cached_requests = []
        kv_saves: list[KVSave] = []
        step: dict[str, ScheduledRequest] = {}
        for request in self.running:
            request_id = request.request_id
            if request_id not in num_scheduled:
                continue
            if request_id in self.sent_to_worker:
                num_computed = request.num_computed_after_flight  # once the worker ran the steps before
                cached_requests.append(
                    CachedRequestData(
                        request_id,
                        new_block_ids[request_id],
                        num_computed,
                        self.kv_cache.take_window_block_ids(request_id, False),
                    )
                )
            else:
                new_requests.append(
                    NewRequestData(
                        request_id,
                        request.prompt_token_ids,
                        request.output_token_ids,
                        request.sampling_params,
                        self.kv_cache.get_block_ids(request_id),
                        request.num_computed_tokens,
                        request.pooling_params,
                        request.lora,
                        self.kv_cache.take_window_block_ids(request_id, True),
                        request.encoder_input,
                        request.mm_inputs,
                    )
                )
                self.sent_to_worker.add(request_id)
            num_tokens = num_scheduled[request_id]
            request.num_tokens_ahead += num_tokens
            samples = request.num_computed_after_flight >= request.num_tokens_after_flight
            request.num_outputs_ahead += samples
            step[request_id] = ScheduledRequest(request, num_tokens, samples, request.num_runs)
            if request.kv_save and self.kv_transfer is not None:
                kv_saves += self.kv_transfer.plan_save(request, self.kv_cache.get_block_ids(request_id))
        self.steps_in_flight.append(step)
        output = SchedulerOutput(
            new_requests=new_requests,
            cached_requests=cached_requests,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_request_ids=self.finished_request_ids + self.preempted_request_ids,
            preempted_request_ids=self.preempted_request_ids,
            scheduled_encoder_inputs=encoder_items,
            kv_loads=self.kv_transfer.take_loads() if self.kv_transfer else [],
            kv_saves=kv_saves,
        )
        self.finished_request_ids = []
        self.preempted_request_ids = []
        return output

    # ---- after the step ----

    def update_from_output(self, model_output: ModelRunnerOutput) -> list[tuple[Request, RequestOutput]]:
        """Advance computed counts, append sampled tokens, apply engine-side stops, for the oldest step in
        flight: outputs come back in the order their steps were scheduled."""
        self.num_steps += 1
        self.num_encoder_inputs += model_output.num_encoder_inputs
        self.encoder_seconds += model_output.encoder_seconds
        outputs = []
        stopped = []
        step = self.steps_in_flight.popleft()
        assert model_output.sampled_token_ids.keys() <= step.keys(), "outputs out of step order"
        # NOTE: every token scheduled counts, stale ones included: the worker computed them.
        num_step_tokens = sum(scheduled.num_tokens for scheduled in step.values())
        self.iteration_tokens_buckets[bisect.bisect_left(ITERATION_TOKENS_BUCKETS, num_step_tokens)] += 1
        self.iteration_tokens_sum += num_step_tokens
        for request_id, scheduled in step.items():
            request, num_tokens = scheduled.request, scheduled.num_tokens
            if (
                request.status != RequestStatus.RUNNING
                or self.requests.get(request_id) is not request
                or scheduled.run != request.num_runs
            ):
                continue  # preempted (and maybe back), finished or aborted since it was scheduled: stale
            request.num_tokens_ahead -= num_tokens
            request.num_outputs_ahead -= scheduled.samples
            if (load_error := model_output.kv_load_errors.get(request_id)) and self.kv_transfer:
                failed = self.kv_transfer.load_failed(request, load_error)  # loaded blocks never indexed
                if failed is None:
                    self._preempt(request, counted=False)  # "recompute": its blocks are freed unindexed
                else:
                    outputs.append((request, failed))
                    stopped.append(request)
                continue
            was_prefill = request.num_computed_tokens < request.num_prompt_tokens
            if was_prefill:
                self.num_prompt_tokens += min(
                    num_tokens, request.num_prompt_tokens - request.num_computed_tokens
                )
            request.num_computed_tokens += num_tokens
            self.kv_cache.cache_blocks(request)
            self.kv_cache.free_behind_window(request)
            new_token_ids = model_output.sampled_token_ids.get(request_id, [])
            error = model_output.errors.get(request_id)
            if error is not None:
                new_token_ids = []  # sampled without its constraint: never shown
                request.status = RequestStatus.FINISHED_ERROR
            if new_token_ids:
                if request.first_token_time is None:
                    request.first_token_time = time.monotonic()
                request.append_output_token_ids(new_token_ids)
                self.num_generation_tokens += len(new_token_ids)
                self._check_stop(request)
                if not request.is_finished and request.passes_rope_switch(self.config.rope_switch_len):
                    self._preempt(request, counted=False)  # recomputed on the long factors, as in HF
            pooled = model_output.pooled.get(request_id)
            if pooled is not None and error is None:
                request.first_token_time = time.monotonic()
                request.status = RequestStatus.FINISHED_STOPPED
            prompt_logprobs = model_output.prompt_logprobs.get(request_id)
            if new_token_ids or prompt_logprobs is not None or error is not None or pooled is not None:
                output = RequestOutput(
                    request_id,
                    new_token_ids,
                    finish_reason=request.status.finish_reason,
                    stop_reason=request.stop_reason,
                    new_logprobs=model_output.logprobs.get(request_id),
                    new_prompt_logprobs=prompt_logprobs,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    error=error,
                    pooled=pooled,
                )
                if request.is_finished:
                    output.queue_time_s, output.prefill_time_s, output.decode_time_s = request.timings()
                    if self.kv_transfer is not None:
                        output.kv_transfer_params = self.kv_transfer.finished_params(request)
                outputs.append((request, output))
            if request.is_finished:
                stopped.append(request)
        for request in stopped:
            self.running.remove(request)
            self._free_request(request)
        return outputs

    def _check_stop(self, request: Request) -> None:
        params = request.sampling_params
        last = request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                return
            if last in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = last
                return
        max_tokens = params.max_tokens
        if (max_tokens is not None and request.num_output_tokens >= max_tokens) or (
            request.num_tokens >= self.config.max_model_len
        ):
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED

    # ---- stats and checks ----

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv_cache.usage,
            prefix_cache_queries=self.kv_cache.prefix_cache_queries,
            prefix_cache_hits=self.kv_cache.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            num_waiting_tokens=sum(r.num_tokens - r.num_computed_tokens for r in self.waiting),
            num_steps=self.num_steps,
            iteration_tokens_buckets=list(self.iteration_tokens_buckets),  # a copy: sent from another thread
            iteration_tokens_sum=self.iteration_tokens_sum,
            running_loras=self._lora_names(self.running),
            waiting_loras=self._lora_names(self.waiting),
            max_loras=self.config.max_loras,
            num_encoder_inputs=self.num_encoder_inputs,
            encoder_seconds=self.encoder_seconds,
        )

    def _lora_names(self, requests: Iterable[Request]) -> list[str]:
        if not self.config.max_loras:
            return []
        return sorted({r.lora.name for r in requests if r.lora is not None})

    def check_invariants(self, scheduler_output: SchedulerOutput | None = None) -> None:
        check_scheduler(self, scheduler_output)  # engine_core/scheduler_invariants.py
