"""The contract between processes. Imports only the standard library and msgspec."""

from protocol.errors import EngineDeadError, InvalidParameterError, ProtocolVersionError
from protocol.media import EncoderInput
from protocol.messages import (
    PROTOCOL_VERSION,
    AbortRequests,
    AddRequest,
    EngineDead,
    EngineOutputs,
    Logprobs,
    ModelInfo,
    Ready,
    Register,
    Rejected,
    RequestError,
    RequestOutput,
    SchedulerStats,
    UtilityCall,
    UtilityResult,
)
from protocol.pooling import PooledOutput, PoolerConfig, PoolingParams
from protocol.sampling import SamplingParams
from protocol.structured_outputs import StructuredOutputsParams

__all__ = [
    "PROTOCOL_VERSION",
    "AbortRequests",
    "AddRequest",
    "EngineDead",
    "EngineDeadError",
    "EncoderInput",
    "EngineOutputs",
    "InvalidParameterError",
    "Logprobs",
    "ModelInfo",
    "PooledOutput",
    "PoolerConfig",
    "PoolingParams",
    "ProtocolVersionError",
    "Ready",
    "Register",
    "Rejected",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
    "SchedulerStats",
    "StructuredOutputsParams",
    "UtilityCall",
    "UtilityResult",
]
