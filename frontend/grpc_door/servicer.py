"""The gRPC door's VllmEngine service over an API server's OpenAIServing: the same engine, checks and
sampling rules as POST /inference/v1/generate (tokens in, tokens out), so its greedy tokens equal
/v1/completions' for the same ids.

proto3 cannot tell a scalar left at zero from one set to zero, so zero means "the default" for top_p,
top_k, min_p, repetition_penalty, min_tokens and n (as vLLM's servicer reads them); `temperature`,
`max_tokens` and `seed` are `optional`, so a set 0 is greedy. What the proto asks for and we cannot
answer in it (logprobs: the proto has no field for them; n > 1: no choice index) is INVALID_ARGUMENT
naming the field, never dropped. Errors are gRPC status codes with the HTTP doors' messages."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc

from frontend.engine.output_processor import SHUTDOWN_REASON
from frontend.openai.serving import OpenAIServing
from frontend.scale_out.generate import token_request
from frontend.scale_out.schemas import completion_body
from frontend.server.errors import OpenAIError, to_openai_error
from protocol.pooling import PoolingParams
from protocol.sampling import MAX_N

from . import vllm_engine_pb2 as pb
from . import vllm_engine_pb2_grpc as pb_grpc

logger = logging.getLogger("engine.api")

STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND, 413: grpc.StatusCode.INVALID_ARGUMENT,
          429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE}  # fmt: skip
POSITIVE = ("top_p", "top_k", "min_p", "repetition_penalty", "min_tokens")  # 0: unset
CONSTRAINTS = {"json_schema": "json", "regex": "regex", "grammar": "grammar", "structural_tag": "structural_tag",
               "json_object": "json_object"}  # fmt: skip


def sampling_dict(params: pb.SamplingParams) -> dict[str, Any]:
    """The proto's SamplingParams by vLLM's names, what was left unset left out."""
    for name in ("logprobs", "prompt_logprobs", "truncate_prompt_tokens"):
        if params.HasField(name):
            raise OpenAIError(
                f"sampling_params.{name} is not supported on the gRPC door: its answer has no field for it "
                "(POST /inference/v1/generate returns logprobs).",
                param=f"sampling_params.{name}",
            )
    if params.n > 1:
        raise OpenAIError(
            "sampling_params.n > 1 is not supported on the gRPC door: its answer has no choice index.",
            param="sampling_params.n",
        )
    out: dict[str, Any] = {}
    for name in ("temperature", "max_tokens", "seed"):
        if params.HasField(name):
            out[name] = getattr(params, name)
    for name in POSITIVE:
        if getattr(params, name) > 0:
            out[name] = getattr(params, name)
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(params, name) != 0:
            out[name] = getattr(params, name)
    if params.stop:
        out["stop"] = list(params.stop)
    if params.stop_token_ids:
        out["stop_token_ids"] = list(params.stop_token_ids)
    if params.logit_bias:
        out["logit_bias"] = {str(token): bias for token, bias in params.logit_bias.items()}
    out["skip_special_tokens"] = params.skip_special_tokens
    out["spaces_between_special_tokens"] = params.spaces_between_special_tokens
    out["ignore_eos"] = params.ignore_eos
    out["include_stop_str_in_output"] = params.include_stop_str_in_output
    out["detokenize"] = bool(params.stop)  # as vLLM's: the text is only for stop strings
    constraint = params.WhichOneof("constraint")
    if constraint == "choice":
        out["structured_outputs"] = {"choice": list(params.choice.choices)}
    elif constraint == "json_schema":
        try:
            out["structured_outputs"] = {"json": json.loads(params.json_schema)}
        except ValueError as error:
            raise OpenAIError(
                f"sampling_params.json_schema is not JSON: {error}", param="sampling_params.json_schema"
            ) from None
    elif constraint is not None:
        out["structured_outputs"] = {CONSTRAINTS[constraint]: getattr(params, constraint)}
    return out


class VllmEngineServicer(pb_grpc.VllmEngineServicer):
    def __init__(self, serving: OpenAIServing, started_at: float) -> None:
        self.serving = serving
        self.started_at = started_at

    async def Generate(  # noqa: N802 (the proto's name)
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.GenerateResponse]:
        serving = self.serving
        if serving.model_info.runner != "generate":
            await context.abort(
                grpc.StatusCode.UNIMPLEMENTED, f"{serving.model_info.model} does not generate."
            )
        try:
            serving.admit()
            kind = request.WhichOneof("input")
            if kind is None or (kind == "tokenized" and not request.tokenized.input_ids):
                raise OpenAIError("a GenerateRequest needs tokenized.input_ids or text.", param="input")
            prompt = list(request.tokenized.input_ids) if kind == "tokenized" else request.text
            body, _ = completion_body(prompt, sampling_dict(request.sampling_params), stream=request.stream)
            prompt_ids, params, _ = token_request(serving, body)
            caller_id = request.request_id or uuid.uuid4().hex
            stream = serving.llm.generate(f"grpc-{caller_id}", prompt_ids, params, log_id=caller_id)
            async for state, delta in stream:
                choice = state.choices[0]
                counts = {"prompt_tokens": len(state.prompt_token_ids), "completion_tokens": len(choice.token_ids),
                          "cached_tokens": state.num_cached_tokens}  # fmt: skip
                if request.stream and delta.token_ids:
                    yield pb.GenerateResponse(
                        chunk=pb.GenerateStreamChunk(token_ids=delta.token_ids, **counts)
                    )
                if delta.finish_reason is not None:
                    reason = "abort" if delta.finish_reason == "abort" else delta.finish_reason
                    complete = pb.GenerateComplete(
                        output_ids=choice.token_ids, finish_reason=reason, **counts
                    )
                    yield pb.GenerateResponse(complete=complete)
        except Exception as error:
            await abort_with(context, error)

    async def Embed(
        self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.EmbedResponse:  # noqa: N802
        serving = self.serving
        try:
            if "embed" not in serving.model_info.pooling_tasks:
                await context.abort(
                    grpc.StatusCode.UNIMPLEMENTED, f"{serving.model_info.model} is not an embedding model."
                )
            serving.admit()
            ids = list(request.tokenized.input_ids)
            if not ids:
                raise OpenAIError("an EmbedRequest needs tokenized.input_ids.", param="tokenized")
            request_id = f"grpc-embd-{request.request_id or uuid.uuid4().hex}"
            pooled = await serving.llm.encode(request_id, ids, PoolingParams(task="embed"))
        except Exception as error:
            await abort_with(context, error)
        import numpy as np

        vector = np.frombuffer(pooled.data, dtype="<f4")
        return pb.EmbedResponse(
            embedding=vector.tolist(), prompt_tokens=len(ids), embedding_dim=vector.shape[0]
        )

    async def HealthCheck(
        self, request: pb.HealthCheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.HealthCheckResponse:  # noqa: N802
        problem = health_problem(self.serving)
        return pb.HealthCheckResponse(healthy=problem is None, message=problem or "ok")

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.AbortResponse:  # noqa: N802
        ids = [f"grpc-{name}-{index}" for name in request.request_ids for index in range(MAX_N)]
        await self.serving.client.cancel(ids, "abort")
        return pb.AbortResponse()

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetModelInfoResponse:  # noqa: N802
        info = self.serving.model_info
        return pb.GetModelInfoResponse(
            model_path=info.model, is_generation=info.runner == "generate", max_context_length=info.max_model_len,
            vocab_size=info.vocab_size, supports_vision=info.image_token_id >= 0,
        )  # fmt: skip

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetServerInfoResponse:  # noqa: N802
        client = self.serving.client
        stats = client.last_stats
        return pb.GetServerInfoResponse(
            active_requests=client.num_open_requests, is_paused=bool(stats is not None and stats.paused),
            last_receive_timestamp=self.last_receive(), uptime_seconds=time.time() - self.started_at,
            server_type="engine-grpc",
        )  # fmt: skip

    def last_receive(self) -> float:
        """When the engine last sent us anything (its heartbeat included), as a Unix time."""
        client = self.serving.client
        engines = getattr(client, "engines", [client])
        loop_time = max(engine.last_message_at for engine in engines)
        import asyncio

        return time.time() - (asyncio.get_running_loop().time() - loop_time) if loop_time else 0.0


def health_problem(serving: OpenAIServing, stall_timeout_s: float = 120.0) -> str | None:
    """What /health would answer 503 for, or None."""
    client = serving.client
    if client.is_dead:
        return f"engine is dead: {client.dead_reason}"
    if serving.draining:
        return "the server is shutting down"
    if (stalled := client.stalled_for()) > stall_timeout_s:
        return f"engine has made no progress for {stalled:.0f} s with requests open"
    return None


async def abort_with(context: grpc.aio.ServicerContext[Any, Any], error: Exception) -> None:
    if isinstance(error, grpc.aio.AbortError):
        raise error
    openai_error = to_openai_error(error)
    if openai_error.code == SHUTDOWN_REASON:
        code = grpc.StatusCode.UNAVAILABLE
    else:
        code = STATUS.get(openai_error.status, grpc.StatusCode.INTERNAL)
    where = f" ({openai_error.param})" if openai_error.param else ""
    await context.abort(code, f"{openai_error.message}{where}")
