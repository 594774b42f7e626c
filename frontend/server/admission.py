"""Admission control: refuse new work the server cannot take, before paying for templates or
tokenization (503 while draining or when the engine's queue is full, 429 over this server's limit)."""

from __future__ import annotations

from dataclasses import dataclass

from frontend.engine.data_parallel import EngineClient
from frontend.server.errors import OpenAIError


@dataclass
class AdmissionLimits:
    """Checked before any tokenization; 0 means no limit."""

    max_queued_requests: int = 0  # engine-wide waiting requests (the engine's stats + ours since them)
    max_queued_tokens: int = 0  # engine-wide prompt tokens waiting
    max_inflight_requests: int = 0  # this API server's open engine requests
    max_messages: int = 2048  # chat messages per request
    max_prompts: int = 1024  # prompts per completions request
    retry_after_s: int = 1


def admit(limits: AdmissionLimits, client: EngineClient, draining: bool) -> None:
    """Raise the 503 or 429 a new request gets now, if any."""
    stats = client.last_stats
    waiting = (stats.num_waiting if stats else 0) + client.added_since_stats
    waiting_tokens = stats.num_waiting_tokens if stats else 0
    refusal = None
    if draining:
        refusal = (503, "service_unavailable_error", "server_shutting_down", "The server is shutting down.")
    elif getattr(client, "scaling", False):  # elastic data parallel: the engines change (vLLM answers 503)
        refusal = (
            503,
            "service_unavailable_error",
            "engine_scaling",
            "The deployment is scaling its data-parallel engines; retry shortly.",
        )
    elif stats is not None and stats.sleeping:
        refusal = (
            503,
            "service_unavailable_error",
            "engine_sleeping",
            "The engine is asleep; POST /wake_up wakes it.",
        )
    elif stats is not None and stats.paused == "abort":
        refusal = (
            503,
            "service_unavailable_error",
            "engine_paused",
            "The engine is paused (mode abort); POST /resume resumes it.",
        )
    elif limits.max_inflight_requests and client.num_open_requests >= limits.max_inflight_requests:
        refusal = (
            429,
            "rate_limit_error",
            "too_many_requests",
            f"This API server has {client.num_open_requests} requests in flight, its limit is "
            f"{limits.max_inflight_requests}. Retry later.",
        )
    elif limits.max_queued_requests and waiting >= limits.max_queued_requests:
        refusal = (
            503,
            "service_unavailable_error",
            "queue_full",
            f"The engine queue is full ({waiting} requests waiting, limit {limits.max_queued_requests}). "
            "Retry later.",
        )
    elif limits.max_queued_tokens and waiting_tokens >= limits.max_queued_tokens:
        refusal = (
            503,
            "service_unavailable_error",
            "queue_full",
            f"The engine queue is full ({waiting_tokens} prompt tokens waiting, limit "
            f"{limits.max_queued_tokens}). Retry later.",
        )
    if refusal is not None:
        status, kind, code, message = refusal
        retry = {"Retry-After": str(limits.retry_after_s)}
        raise OpenAIError(message, status=status, type=kind, code=code, headers=retry)
