"""End to end: the gRPC front door through a Python gRPC client (the checked-in stubs, grpcio's health
and reflection clients). One engine serves HTTP and, attached to it, a gRPC frontend (`engine serve
--attach ADDR --grpc`): greedy tokens equal /v1/completions', streamed or not; abort; bad requests get
status codes with messages. A standalone `engine serve --grpc` goes NOT_SERVING while it drains and
when its engine dies. The stubs match the .proto (make grpc-stubs)."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from frontend.grpc_door import vllm_engine_pb2 as pb
from frontend.grpc_door import vllm_engine_pb2_grpc as pb_grpc
from tests.serve_helpers import Served, free_port, serving, stop, wait_until

pytestmark = pytest.mark.slow

MODEL = "smollm2"
API_KEY = "grpc-key"
FLAGS = ("--dtype", "float32", "--max-model-len", "1024", "--served-model-name", MODEL)
PROMPT = [1, 504, 3458, 282, 4649, 314]  # token ids
ROOT = pathlib.Path(__file__).parent.parent
AUTH = (("authorization", f"Bearer {API_KEY}"),)


def start_grpc(*args: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    command = [sys.executable, "-m", "frontend.cli", "serve", *args, "--grpc", "--port", str(port)]
    process = subprocess.Popen(command)
    target = f"127.0.0.1:{port}"

    def serving_now() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"the gRPC server exited with {process.returncode}")
        try:
            with grpc.insecure_channel(target) as channel:
                check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.RpcError:  # not listening yet
            return False
        return bool(check.status == health_pb2.HealthCheckResponse.SERVING)

    try:
        wait_until(serving_now, 180, "the gRPC server to serve")
    except BaseException:
        stop(process)
        raise
    return process, target


@pytest.fixture(scope="module")
def http(smollm2_gguf: str) -> Iterator[Served]:
    with serving(smollm2_gguf, *FLAGS, engine_address=True) as served:
        yield served


@pytest.fixture(scope="module")
def target(http: Served) -> Iterator[str]:
    assert http.engine_address is not None
    process, target = start_grpc("--attach", http.engine_address, "--api-key", API_KEY)
    try:
        yield target
    finally:
        stop(process)


@pytest.fixture(scope="module")
def stub(target: str) -> Iterator[pb_grpc.VllmEngineStub]:
    with grpc.insecure_channel(target) as channel:
        yield pb_grpc.VllmEngineStub(channel)


def generate(stub: pb_grpc.VllmEngineStub, stream: bool = False, **params: Any) -> list[pb.GenerateResponse]:
    request = pb.GenerateRequest(
        request_id=params.pop("request_id", ""), tokenized=pb.TokenizedInput(input_ids=PROMPT),
        sampling_params=pb.SamplingParams(**params), stream=stream,
    )  # fmt: skip
    return list(stub.Generate(request, metadata=AUTH, timeout=120))


def completion_ids(http: Served, **params: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": PROMPT, "return_token_ids": True, **params}
    return httpx.post(f"{http.base}/v1/completions", json=body, timeout=120).json()["choices"][0]  # type: ignore[no-any-return]


def test_greedy_tokens_equal_completions_streamed_or_not(stub: pb_grpc.VllmEngineStub, http: Served) -> None:
    want = completion_ids(http, max_tokens=12, temperature=0)
    (only,) = generate(stub, temperature=0, max_tokens=12)
    complete = only.complete
    assert list(complete.output_ids) == want["token_ids"] and complete.finish_reason == want["finish_reason"]
    assert complete.prompt_tokens == len(PROMPT) and complete.completion_tokens == len(want["token_ids"])
    answers = generate(stub, stream=True, temperature=0, max_tokens=12)
    chunks = [a.chunk for a in answers[:-1]]
    assert all(a.WhichOneof("response") == "chunk" for a in answers[:-1])
    assert (
        [t for c in chunks for t in c.token_ids] == want["token_ids"] == list(answers[-1].complete.output_ids)
    )
    assert [c.completion_tokens for c in chunks] == sorted(c.completion_tokens for c in chunks)
    seeded = dict(temperature=0.9, top_k=40, seed=7, max_tokens=8, stop_token_ids=[2])
    (sampled,) = generate(stub, **seeded)  # type: ignore[arg-type]
    assert list(sampled.complete.output_ids) == completion_ids(http, **seeded)["token_ids"]
    text = list(stub.Generate(pb.GenerateRequest(text="The capital of France is",
                                                 sampling_params=pb.SamplingParams(temperature=0, max_tokens=4)),
                              metadata=AUTH))  # fmt: skip
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0,
            "return_token_ids": True}  # fmt: skip
    want_text = httpx.post(f"{http.base}/v1/completions", json=body, timeout=120).json()["choices"][0]
    assert list(text[-1].complete.output_ids) == want_text["token_ids"]


def test_structured_output_and_stop(stub: pb_grpc.VllmEngineStub, http: Served) -> None:
    (choice,) = generate(stub, temperature=0, max_tokens=8, choice=pb.ChoiceConstraint(choices=["yes", "no"]))
    want = completion_ids(http, max_tokens=8, temperature=0, structured_outputs={"choice": ["yes", "no"]})
    assert list(choice.complete.output_ids) == want["token_ids"]
    (stopped,) = generate(stub, temperature=0, max_tokens=40, stop=["."])
    assert (
        list(stopped.complete.output_ids)
        == completion_ids(http, max_tokens=40, temperature=0, stop=["."])["token_ids"]
    )


def test_abort_ends_a_stream(stub: pb_grpc.VllmEngineStub) -> None:
    request = pb.GenerateRequest(
        request_id="to-abort", tokenized=pb.TokenizedInput(input_ids=PROMPT), stream=True,
        sampling_params=pb.SamplingParams(temperature=0, max_tokens=900, ignore_eos=True),
    )  # fmt: skip
    answers = stub.Generate(request, metadata=AUTH, timeout=120)
    first = next(answers)
    assert first.WhichOneof("response") == "chunk"
    stub.Abort(pb.AbortRequest(request_ids=["to-abort"]), metadata=AUTH)
    rest = list(answers)
    assert rest[-1].complete.finish_reason == "abort" and rest[-1].complete.completion_tokens < 900


@pytest.mark.parametrize(
    ("params", "code", "words"),
    [
        (dict(n=2), grpc.StatusCode.INVALID_ARGUMENT, "sampling_params.n"),
        (dict(logprobs=2), grpc.StatusCode.INVALID_ARGUMENT, "sampling_params.logprobs"),
        (dict(json_schema="{not json"), grpc.StatusCode.INVALID_ARGUMENT, "json_schema is not JSON"),
        (dict(temperature=-1), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
        (dict(max_tokens=5000), grpc.StatusCode.INVALID_ARGUMENT, "context"),
    ],
)
def test_bad_requests_get_status_codes(
    stub: pb_grpc.VllmEngineStub, params: dict[str, Any], code: grpc.StatusCode, words: str
) -> None:
    with pytest.raises(grpc.RpcError) as raised:
        generate(stub, **params)
    assert raised.value.code() == code and words in (raised.value.details() or ""), raised.value.details()


def test_keys_health_info_and_reflection(stub: pb_grpc.VllmEngineStub, target: str) -> None:
    with pytest.raises(grpc.RpcError) as raised:
        list(stub.Generate(pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=PROMPT))))
    assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as raised:
        stub.Embed(pb.EmbedRequest(tokenized=pb.TokenizedInput(input_ids=PROMPT)), metadata=AUTH)
    assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert stub.HealthCheck(pb.HealthCheckRequest(), metadata=AUTH).healthy
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=AUTH)
    assert info.is_generation and info.max_context_length == 1024 and info.vocab_size == 49152
    server = stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=AUTH)
    assert server.server_type == "engine-grpc" and server.uptime_seconds > 0 and not server.is_paused
    with grpc.insecure_channel(target) as channel:
        listing = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        names = {service.name for service in next(listing).list_services_response.service}
    assert {"vllm.grpc.engine.VllmEngine", "grpc.health.v1.Health"} <= names


@pytest.mark.long  # a failure drill: two engines of its own, one killed
def test_health_while_draining_and_when_the_engine_dies(smollm2_gguf: str) -> None:
    process, target = start_grpc(smollm2_gguf, *FLAGS, "--shutdown-timeout", "20")
    try:
        with grpc.insecure_channel(target) as channel:
            stub, health = pb_grpc.VllmEngineStub(channel), health_pb2_grpc.HealthStub(channel)
            long = pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=PROMPT), stream=True,
                                      sampling_params=pb.SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))  # fmt: skip
            answers = stub.Generate(long, timeout=120)
            next(answers)
            grpc_server = next(
                p
                for p in psutil.Process(process.pid).children()
                if "frontend.server.main" in " ".join(p.cmdline())
            )
            grpc_server.send_signal(signal.SIGTERM)  # the drain: this one's open request may finish

            def not_serving() -> bool:
                status = health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                return bool(status == health_pb2.HealthCheckResponse.NOT_SERVING)

            wait_until(not_serving, 30, "NOT_SERVING while draining")
            with pytest.raises(grpc.RpcError) as raised:
                list(
                    stub.Generate(
                        pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=PROMPT)), timeout=30
                    )
                )
            assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
            finished = list(answers)
            assert finished[-1].complete.finish_reason == "length"
    finally:
        stop(process)
    process, target = start_grpc(smollm2_gguf, *FLAGS)
    try:
        engine = next(
            p for p in psutil.Process(process.pid).children() if "engine_core" in " ".join(p.cmdline())
        )
        watched: list[int] = []
        with grpc.insecure_channel(target) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=60)

            def follow() -> None:
                try:
                    watched.extend(update.status for update in watch)
                except grpc.RpcError:  # cancelled below
                    pass

            thread = threading.Thread(target=follow, daemon=True)
            thread.start()
            os.kill(engine.pid, signal.SIGKILL)
            wait_until(
                lambda: health_pb2.HealthCheckResponse.NOT_SERVING in watched,
                30,
                "NOT_SERVING once the engine died",
            )
            watch.cancel()
    finally:
        process.wait(timeout=60)  # the launcher stops itself when its engine dies
        stop(process)


def test_embed_equals_the_embeddings_door(minilm: str) -> None:
    with serving(minilm, engine_address=True) as http:
        assert http.engine_address is not None
        process, target = start_grpc("--attach", http.engine_address)
        try:
            ids = [101, 7592, 2088, 102]
            body = {"input": [ids], "model": minilm}
            want = httpx.post(f"{http.base}/v1/embeddings", json=body, timeout=60).json()["data"][0][
                "embedding"
            ]
            with grpc.insecure_channel(target) as channel:
                stub = pb_grpc.VllmEngineStub(channel)
                got = stub.Embed(pb.EmbedRequest(tokenized=pb.TokenizedInput(input_ids=ids)), timeout=60)
                assert not stub.GetModelInfo(pb.GetModelInfoRequest()).is_generation
                with pytest.raises(grpc.RpcError) as raised:
                    list(stub.Generate(pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=ids))))
            assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED
            assert got.prompt_tokens == 4 and got.embedding_dim == len(want) == 384
            assert list(got.embedding) == pytest.approx(want, abs=1e-6)
        finally:
            stop(process)


def test_the_checked_in_stubs_match_the_proto(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("grpc_tools")
    proto = "frontend/grpc_door/vllm_engine.proto"
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", ".", f"--python_out={tmp_path}",
                    f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", proto], cwd=ROOT, check=True)  # fmt: skip
    for name in ("vllm_engine_pb2.py", "vllm_engine_pb2.pyi", "vllm_engine_pb2_grpc.py"):
        fresh = without_tool_versions((tmp_path / "frontend" / "grpc_door" / name).read_text())
        ours = without_tool_versions((ROOT / "frontend" / "grpc_door" / name).read_text())
        assert fresh == ours, f"{name}: run make grpc-stubs"


def without_tool_versions(stub: str) -> str:
    """A generated stub without the versions of the tools that made it: those only set the least grpcio
    and protobuf it runs on, and a newer grpcio-tools release must not fail the check of the messages."""
    stub = re.sub(r"GRPC_GENERATED_VERSION = '[^']*'", "GRPC_GENERATED_VERSION = ''", stub)
    stub = re.sub(r"# Protobuf Python Version: .*", "", stub)
    return re.sub(r"ValidateProtobufRuntimeVersion\([^)]*\)", "ValidateProtobufRuntimeVersion()", stub)
