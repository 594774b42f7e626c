"""The scheduler's invariants (engine_core/scheduler.py's docstring lists them), checked: tests call this after
every step. (`scheduler` is an engine_core.scheduler.Scheduler, which imports this module.)"""

from __future__ import annotations

from typing import Any

from engine_core.encoder_room import embeds_of
from engine_core.kv_cache_manager import cdiv
from engine_core.request import RequestStatus
from protocol.worker_messages import SchedulerOutput


def check_scheduler(scheduler: Any, scheduler_output: SchedulerOutput | None = None) -> None:
    scheduler.kv_cache.check_invariants()
    assert len(scheduler.running) <= scheduler.config.max_num_seqs
    if scheduler.config.max_loras:
        assert (
            len({r.lora.lora_id for r in scheduler.running if r.lora is not None})
            <= scheduler.config.max_loras
        )
    if scheduler_output is not None:
        assert scheduler_output.total_num_scheduled_tokens <= scheduler.config.max_num_batched_tokens
        encoders = [
            new.encoder_input.num_tokens for new in scheduler_output.new_requests if new.encoder_input
        ]
        assert sum(encoders) <= scheduler.config.max_num_encoder_input_tokens
        images = scheduler_output.scheduled_encoder_inputs
        assert sum(embeds_of(scheduler.requests[rid], items) for rid, items in images.items()) <= (
            scheduler.config.max_num_encoder_input_tokens
        )
    assert sum(embeds_of(r, r.encoder_held) for r in scheduler.running) <= max(
        scheduler.config.encoder_cache_tokens, 0
    )
    block_size = scheduler.config.block_size
    for request in scheduler.running:
        assert request.status == RequestStatus.RUNNING, request
        num_blocks = len(scheduler.kv_cache.req_to_blocks.get(request.request_id, []))
        assert num_blocks >= cdiv(request.num_computed_after_flight, block_size), request
        scheduler.kv_cache.check_window(request)
        assert request.num_computed_after_flight <= request.num_tokens_after_flight, request
        assert request.num_outputs_ahead <= len(scheduler.steps_in_flight), request
    for request in scheduler.waiting:
        assert not request.is_finished, request
        assert request.request_id not in scheduler.kv_cache.req_to_blocks, request
    assert len(scheduler.running) + len(scheduler.waiting) == len(scheduler.requests)
    assert sum(scheduler.iteration_tokens_buckets) == scheduler.num_steps
