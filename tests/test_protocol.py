"""Codec round trips and the wire ABI (golden bytes: field order must not change silently)."""

from __future__ import annotations

import msgspec
import pytest

from protocol import PROTOCOL_VERSION, InvalidParameterError, SamplingParams
from protocol.codec import (
    TYPE_BYTES,
    encode_value,
    engine_codec,
    frontend_codec,
    worker_input_codec,
    worker_output_codec,
)
from protocol.messages import (
    AbortRequests,
    AddRequest,
    EngineDead,
    EngineOutputs,
    Logprobs,
    ModelInfo,
    Ready,
    Register,
    RequestError,
    RequestOutput,
    SchedulerStats,
    UtilityCall,
    UtilityResult,
)
from protocol.worker_messages import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput

INFO = ModelInfo("m", ["m"], 2048, 16, 100, [2], "float32", 64, "0.1.0")


@pytest.mark.parametrize(
    "message",
    [
        Register(PROTOCOL_VERSION, "fe-1"),
        AddRequest(
            request_id="r1",
            prompt_token_ids=[1, 2, 3],
            sampling_params=SamplingParams(temperature=0.5, stop=["x"], logit_bias={5: -1.0}),
            arrival_time=12.5,
            priority=-1,
            cache_salt="s",
        ),
        AbortRequests(["a", "b"]),
        UtilityCall(1, "get_stats", [encode_value(3)]),
    ],
)
def test_frontend_messages_round_trip(message: msgspec.Struct) -> None:
    codec = frontend_codec()
    frames = codec.encode(message)
    assert frames[0] == TYPE_BYTES[type(message).__struct_config__.tag]
    assert codec.decode(frames) == message


@pytest.mark.parametrize(
    "message",
    [
        Ready(PROTOCOL_VERSION, INFO),
        EngineOutputs(
            [
                RequestOutput("r1", [7], "stop", 7, Logprobs([[7, 8]], [[-0.1, -2.0]], [1]), None, 16),
                RequestOutput("r2", []),
            ],
            3.0,
            SchedulerStats(num_running=1, kv_cache_usage=0.5),
        ),
        UtilityResult(1, encode_value({"a": 1})),
        EngineDead("boom"),
    ],
)
def test_engine_messages_round_trip(message: msgspec.Struct) -> None:
    codec = engine_codec()
    assert codec.decode(codec.encode(message)) == message


def test_worker_messages_round_trip() -> None:
    output = SchedulerOutput(
        new_requests=[NewRequestData("a", [1, 2], [], SamplingParams(), [0, 1], 0)],
        cached_requests=[CachedRequestData("b", [3], 17)],
        num_scheduled_tokens={"a": 2, "b": 1},
        total_num_scheduled_tokens=3,
        finished_request_ids=["c"],
    )
    codec = worker_input_codec()
    assert codec.decode(codec.encode(output)) == output
    result = ModelRunnerOutput({"a": [5]}, {"a": Logprobs([[5]], [[-0.5]], [1])})
    out_codec = worker_output_codec()
    assert out_codec.decode(out_codec.encode(result)) == result


def test_add_request_golden_bytes() -> None:
    """The ADD frame is an ABI: changing field order or tags breaks attached frontends and harnesses."""
    message = AddRequest(
        request_id="r",
        prompt_token_ids=[1, 2],
        sampling_params=SamplingParams(temperature=0.0, max_tokens=4),
        arrival_time=1.0,
    )
    body = frontend_codec().encode(message)[1]
    assert body.hex() == (
        "9ca3616464a172920102dc001a01cb0000000000000000cb3ff000000000000000cb0000000000000000c0"
        "cb0000000000000000cb0000000000000000cb3ff0000000000000c004009090c2c0c0c2c3c3c090c0"
        "90c0"  # SamplingParams.begin_suppress_token_ids, timestamp_rules (PROTOCOL_VERSION 9)
        "c0"  # SamplingParams.logprob_token_ids (PROTOCOL_VERSION 12; its 26 fields: dc001a)
        "cb3ff000000000000000c0c0c0"  # the third nil: pooling_params (PROTOCOL_VERSION 6)
        "c0"  # encoder_input (PROTOCOL_VERSION 9)
        "90"  # mm_inputs (PROTOCOL_VERSION 10)
        "c0"  # kv_transfer_params (PROTOCOL_VERSION 13; 12 fields: 9c)
    )


def test_output_golden_bytes() -> None:
    body = engine_codec().encode(EngineOutputs([RequestOutput("r", [9], "length")], 2.0, None))[1]
    assert body.hex() == (
        "94a76f757470757473919da1729109a66c656e677468c0c0c000"
        "cb0000000000000000cb0000000000000000cb0000000000000000c0c0c0cb4000000000000000c0"
    )  # RequestOutput's last nils: pooled (PROTOCOL_VERSION 6), kv_transfer_params (13)


def test_a_rejection_is_a_typed_error_in_the_output() -> None:
    output = RequestOutput("r", [], "error", error=RequestError("max_tokens", "too many"))
    codec = engine_codec()
    decoded = codec.decode(codec.encode(EngineOutputs([output], 1.0)))
    assert decoded.outputs[0].error == RequestError("max_tokens", "too many")
    assert decoded.outputs[0].finish_reason == "error"


def test_allowed_token_ids_and_bad_words_are_validated() -> None:
    for params, name in (
        (SamplingParams(allowed_token_ids=[]), "allowed_token_ids"),
        (SamplingParams(allowed_token_ids=[5, 500]), "allowed_token_ids"),
        (SamplingParams(bad_words_token_ids=[[]]), "bad_words"),
        (SamplingParams(bad_words_token_ids=[[1, 900]]), "bad_words"),
    ):
        with pytest.raises(InvalidParameterError) as error:
            params.validate(vocab_size=100)
        assert error.value.param == name
    SamplingParams(allowed_token_ids=[1, 2], bad_words_token_ids=[[3], [4, 5]]).validate(vocab_size=100)


def test_sampling_params_validation_names_the_parameter() -> None:
    with pytest.raises(InvalidParameterError) as error:
        SamplingParams(temperature=-1).validate()
    assert error.value.param == "temperature"
    with pytest.raises(InvalidParameterError) as error:
        SamplingParams(top_p=0).validate()
    assert error.value.param == "top_p"
    with pytest.raises(InvalidParameterError) as error:
        SamplingParams(logit_bias={1000: 1.0}).validate(vocab_size=100)
    assert error.value.param == "logit_bias"
    with pytest.raises(InvalidParameterError) as error:
        SamplingParams(max_tokens=2, min_tokens=3).validate()
    assert error.value.param == "min_tokens"
    SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=1, logprobs=5).validate(vocab_size=100)
