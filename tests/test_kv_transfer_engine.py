"""Disaggregated prefill and decode on in-process engines (real scheduler and worker, no processes): a
producer engine computes each prompt and writes its KV to a shared folder; a consumer engine loads it and
decodes. The consumer's greedy tokens equal HF transformers' (float32, a tiny random Llama), with chunked
prefill, a prefix hit on the decode side and async scheduling; a missing, corrupt or foreign entry is an
error or a recompute as kv_load_failure_policy says, never a wrong token; no block leaks on either side.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_core.engine_core import EngineCore
from engine_core.request import Request
from protocol.config import EngineConfig, WorkerConfig
from protocol.errors import InvalidParameterError
from protocol.kv_transfer import KVTransferConfig, entry_path, parse_kv_transfer_config
from protocol.messages import AddRequest, RequestOutput
from protocol.sampling import SamplingParams
from tests.family_models import TINY_KV_TOKENS
from tests.hf_oracle import compare_greedy, hf_greedy
from tests.serve_helpers import wait_until
from tests.test_correctness_tiny import build_tiny
from worker.executor import InprocExecutor

MAX_NEW_TOKENS = 12
PRODUCE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}  # fmt: skip  (vLLM's proxy's)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    folder = str(tmp_path_factory.mktemp("llama"))
    build_tiny("llama", folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rng = random.Random(11)
    shared = [rng.randrange(512) for _ in range(37)]
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (5, 16, 17, 40, 70)]
    prompts += [shared + [1, 2, 3, 4], shared + [9] * 20]  # a 32-token block-aligned prefix in common
    oracle = [hf_greedy(hf, p, MAX_NEW_TOKENS, None) for p in prompts]
    return folder, prompts, oracle


def engine(folder: str, role: str, storage: Path, policy: str = "fail", **kwargs: Any) -> EngineCore:
    config = KVTransferConfig(kv_connector="SharedStorageConnector", kv_role=role, kv_load_failure_policy=policy,
                              kv_connector_extra_config={"shared_storage_path": str(storage)})  # fmt: skip
    worker = WorkerConfig(model=folder, dtype=kwargs.pop("dtype", "float32"), block_size=16, kv_transfer=config,
                          num_kv_blocks=TINY_KV_TOKENS // 16)  # fmt: skip
    return EngineCore(EngineConfig(worker=worker, **kwargs), InprocExecutor(worker))


def run(
    core: EngineCore, prompts: list[list[int]], params: list[dict[str, Any] | None]
) -> list[RequestOutput]:
    """Each prompt to its end; per request, its tokens and last output (finish reason, params, error)."""
    sampling = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    ids = [f"r{len(core.scheduler.requests)}-{i}-{random.random()}" for i in range(len(prompts))]
    for request_id, prompt, kv in zip(ids, prompts, params, strict=True):
        core.add_request(AddRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=sampling,
                                    arrival_time=0.0, kv_transfer_params=kv))  # fmt: skip
    results = {request_id: RequestOutput(request_id, []) for request_id in ids}
    while core.has_unfinished_requests():
        for _, output in core.step():
            result = results[output.request_id]
            result.new_token_ids += output.new_token_ids
            result.finish_reason, result.error = output.finish_reason, output.error
            result.kv_transfer_params = output.kv_transfer_params
        core.scheduler.check_invariants()
    assert core.scheduler.kv_cache.pool.num_free_blocks == core.scheduler.config.num_kv_blocks  # no leak
    return [results[request_id] for request_id in ids]


def prefill(core: EngineCore, prompts: list[list[int]]) -> list[dict[str, Any]]:
    outputs = run(core, prompts, [PRODUCE] * len(prompts))
    assert all(o.kv_transfer_params is not None for o in outputs)
    return [o.kv_transfer_params for o in outputs]  # type: ignore[misc]


def loaded_tokens(core: EngineCore) -> int:
    return core.executor.runner.kv_transfer.num_bytes_loaded  # type: ignore[attr-defined,no-any-return]


CONSUMERS = {
    "default": {},
    "chunk_16": {"max_num_batched_tokens": 16},
    "async_no_prefix_caching": {"async_scheduling": True, "enable_prefix_caching": False},
}


@pytest.mark.parametrize("name", list(CONSUMERS))
def test_decode_from_remote_kv_equals_hf(tiny, tmp_path: Path, name: str) -> None:  # type: ignore[no-untyped-def]
    folder, prompts, oracle = tiny
    producer = engine(
        folder, "kv_producer", tmp_path, max_num_batched_tokens=32
    )  # chunked: 70 in three steps
    params = prefill(producer, prompts)
    for prompt, kv in zip(prompts, params, strict=True):
        tokens = (len(prompt) - 1) // 16 * 16
        assert kv["do_remote_prefill"] and not kv["do_remote_decode"] and kv["remote_num_tokens"] == tokens
        assert (kv["remote_key"] is None) == (tokens == 0)
        if tokens:
            assert entry_path(str(tmp_path), kv["remote_key"]).is_file()
    consumer = engine(folder, "kv_consumer", tmp_path, **CONSUMERS[name])
    outputs = run(consumer, prompts, params)
    for output, expected in zip(outputs, oracle, strict=True):
        assert output.finish_reason == "length", output.error
        compare_greedy(output.new_token_ids, expected)
    assert loaded_tokens(consumer) > 0
    stats = consumer.scheduler.make_stats()
    # the consumer computed only each prompt's tail past its entry (and its outputs)
    assert stats.num_prompt_tokens == sum(len(p) - (len(p) - 1) // 16 * 16 for p in prompts)


def test_a_prefix_hit_on_the_decode_side_loads_only_the_rest(tiny, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    folder, prompts, oracle = tiny
    producer = engine(folder, "kv_producer", tmp_path)
    params = prefill(producer, prompts[-2:])
    consumer = engine(folder, "kv_both", tmp_path)
    first = run(consumer, prompts[-2:-1], params[:1])  # loads two blocks (32 of its 41 tokens)
    compare_greedy(first[0].new_token_ids, oracle[-2])
    before = loaded_tokens(consumer)
    second = run(consumer, prompts[-1:], params[1:])  # its first two blocks hit; only the third loads
    compare_greedy(second[0].new_token_ids, oracle[-1])
    assert loaded_tokens(consumer) - before == before / 2  # one block where the first loaded two


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_corrupt_or_foreign_entry_is_an_error_or_a_recompute(tiny, tmp_path: Path, policy: str) -> None:  # type: ignore[no-untyped-def]
    folder, prompts, oracle = tiny
    producer = engine(folder, "kv_producer", tmp_path)
    params = prefill(producer, prompts[3:5])
    entry_path(str(tmp_path), params[0]["remote_key"]).write_bytes(b"not a safetensors file")
    consumer = engine(folder, "kv_consumer", tmp_path, policy)
    outputs = run(consumer, prompts[3:5], params)
    if policy == "fail":
        assert outputs[0].finish_reason == "error" and not outputs[0].new_token_ids
        assert outputs[0].error is not None and "could not be loaded" in outputs[0].error.message
    else:
        compare_greedy(outputs[0].new_token_ids, oracle[3])
    compare_greedy(outputs[1].new_token_ids, oracle[4])  # its neighbour's entry is whole
    # an entry of another dtype (a bfloat16 producer): refused before a block is written
    other = tmp_path / "bf16"
    other.mkdir()
    bf16 = prefill(engine(folder, "kv_producer", other, dtype="bfloat16"), prompts[3:4])
    outputs = run(engine(folder, "kv_consumer", other, policy), prompts[3:4], bf16)
    if policy == "fail":
        assert outputs[0].error is not None and "bfloat16" in outputs[0].error.message
    else:
        compare_greedy(outputs[0].new_token_ids, oracle[3])


def test_missing_entries_and_roles(tiny, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    folder, prompts, oracle = tiny
    consumer = engine(folder, "kv_consumer", tmp_path)
    sampling = SamplingParams(max_tokens=2)
    for params, words in (
        ({"do_remote_prefill": True}, "no KV for this prompt"),  # (no producer wrote it)
        (PRODUCE, "does not produce KV"),
        ({"do_remote_prefill": True, "remote_key": "ab" * 32}, "another prompt's KV"),
        ({"do_remote_prefill": True, "remote_num_tokens": 48}, "block size"),  # (its entry is 32)
        ({"do_remote_prefill": True, "surprise": 1}, "unknown key 'surprise'"),
        ({"do_remote_prefill": True, "do_remote_decode": True}, "either produces"),
        (
            {"do_remote_prefill": True, "remote_block_ids": [3, 4], "remote_host": "10.0.0.2"},
            "not SharedStorageConnector's",
        ),
    ):
        with pytest.raises(InvalidParameterError, match=words):
            consumer.add_request(AddRequest(request_id="x", prompt_token_ids=prompts[3], sampling_params=sampling,
                                            arrival_time=0.0, kv_transfer_params=params))  # fmt: skip
    assert not consumer.scheduler.requests
    lenient = engine(folder, "kv_consumer", tmp_path, "recompute")  # no entry: computed here
    compare_greedy(run(lenient, prompts[3:4], [{"do_remote_prefill": True}])[0].new_token_ids, oracle[3])


def test_kv_transfer_config_refuses_by_name() -> None:
    base = {"kv_connector": "SharedStorageConnector", "kv_role": "kv_both"}
    assert parse_kv_transfer_config({**base, "kv_ip": "127.0.0.1", "kv_rank": None}).storage_path == "/tmp"
    assert parse_kv_transfer_config(
        {"kv_connector": "ExampleConnector", "kv_role": "kv_consumer"}
    ).is_consumer
    for extra, words in (
        ({"kv_connector": "P2pNcclConnector"}, "'P2pNcclConnector' is not one of ours"),
        ({"kv_buffer_size": 1e6}, "kv_buffer_size is NixlConnector's"),
        (
            {"kv_connector": "NixlConnector", "kv_connector_extra_config": {"shared_storage_path": "/x"}},
            "NixlConnector reads",
        ),
        ({"kv_role": "kv_decoder"}, "kv_role must be"),
        ({"kv_ip": "10.0.0.2"}, "kv_ip is not supported"),
        ({"kv_load_failure_policy": "retry"}, "kv_load_failure_policy"),
        ({"kv_connector_extra_config": {"backend": "x"}}, "'backend'"),
        ({"kv_buffer_device": "cuda"}, "kv_buffer_device"),
        ({"colour": 1}, "unknown key 'colour'"),
    ):
        with pytest.raises(ValueError, match=words):
            parse_kv_transfer_config({**base, **extra})


# ---- the NIXL connector: a producer's registered staging buffer, read with a NIXL READ ----


def free_tcp_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def nixl_engine(folder: str, role: str, port: int, policy: str = "fail", **extra: Any) -> EngineCore:
    config = KVTransferConfig(kv_connector="NixlConnector", kv_role=role, kv_load_failure_policy=policy,
                              kv_buffer_size=8 << 20, kv_connector_extra_config={"side_channel_port": port, **extra})  # fmt: skip
    worker = WorkerConfig(model=folder, dtype="float32", block_size=16, kv_transfer=config,
                          num_kv_blocks=TINY_KV_TOKENS // 16)  # fmt: skip
    return EngineCore(EngineConfig(worker=worker), InprocExecutor(worker))


def connector(core: EngineCore) -> Any:
    return core.executor.runner.kv_transfer  # type: ignore[attr-defined]


@pytest.fixture
def pair(tiny):  # type: ignore[no-untyped-def]
    folder = tiny[0]
    port = free_tcp_port()
    cores = [
        nixl_engine(folder, "kv_producer", port, expiry_s=120.0),
        nixl_engine(folder, "kv_consumer", port),
    ]
    yield cores
    for core in cores:
        connector(core).close()


def test_decode_from_a_nixl_read_equals_hf(tiny, pair) -> None:  # type: ignore[no-untyped-def]
    folder, prompts, oracle = tiny
    producer, consumer = pair
    params = prefill(producer, prompts)
    assert all(p["remote_host"] == "127.0.0.1" and isinstance(p["remote_port"], int) for p in params)
    held = len(connector(producer).entries)
    assert held == sum(1 for p in prompts if len(p) > 16)  # an entry for each prompt of a block and more
    outputs = run(consumer, prompts, params)
    for output, expected in zip(outputs, oracle, strict=True):
        assert output.finish_reason == "length", output.error
        compare_greedy(output.new_token_ids, expected)
    assert connector(consumer).num_bytes_loaded > 0
    stats = consumer.scheduler.make_stats()
    assert stats.num_prompt_tokens == sum(len(p) - (len(p) - 1) // 16 * 16 for p in prompts)
    # read, so freed: the whole staging buffer is free again
    wait_until(lambda: not connector(producer).entries, 10, "the entries freed once read")
    assert connector(producer).arena.free == [(0, 8 << 20)]
    # a second read of a freed entry (its blocks no longer in the consumer's prefix cache): an error, never a token
    assert consumer.scheduler.kv_cache.reset_prefix_cache()
    again = run(consumer, prompts[3:4], params[3:4])
    assert again[0].finish_reason == "error" and "no such entry" in again[0].error.message  # type: ignore[union-attr]


def test_an_entry_nobody_reads_expires_and_recompute_still_answers(tiny) -> None:  # type: ignore[no-untyped-def]
    folder, prompts, oracle = tiny
    port = free_tcp_port()
    producer = nixl_engine(folder, "kv_producer", port, expiry_s=0.5)
    consumer = nixl_engine(folder, "kv_consumer", port, "recompute")
    try:
        params = prefill(producer, prompts[4:5])
        assert connector(producer).num_bytes_saved > 0 and params[0]["remote_key"] is not None
        wait_until(lambda: not connector(producer).entries, 10, "the unread entry to expire")
        assert connector(producer).arena.free == [(0, 8 << 20)]
        outputs = run(consumer, prompts[4:5], params)  # its entry is gone: computed here
        compare_greedy(outputs[0].new_token_ids, oracle[4])
        assert connector(consumer).num_bytes_loaded == 0
    finally:
        connector(producer).close()
        connector(consumer).close()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_producer_gone_before_the_read(tiny, policy: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The prefill's worker dies after its answer (its side channel and agent gone): the read fails in
    ANSWER_TIMEOUT_MS, and the policy decides; never a token of KV that did not arrive."""
    import worker.kv_transfer_nixl

    monkeypatch.setattr(worker.kv_transfer_nixl, "ANSWER_TIMEOUT_MS", 300)
    folder, prompts, oracle = tiny
    port = free_tcp_port()
    producer = nixl_engine(folder, "kv_producer", port)
    consumer = nixl_engine(folder, "kv_consumer", port, policy)
    try:
        params = prefill(producer, prompts[3:4])
        connector(producer).close()
        outputs = run(consumer, prompts[3:4], params)
        if policy == "fail":
            assert outputs[0].finish_reason == "error" and "did not answer" in outputs[0].error.message  # type: ignore[union-attr]
        else:
            compare_greedy(outputs[0].new_token_ids, oracle[3])
    finally:
        connector(consumer).close()


def test_a_hostile_producer_or_a_named_host_is_refused(tiny, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A decode request may name only producers on remote_hosts (no connection anywhere a client says);
    a producer answering garbage, a wrong shape or too much is the request's load error, never a crash."""
    import threading

    import msgspec
    import zmq

    import worker.kv_transfer_nixl

    monkeypatch.setattr(
        worker.kv_transfer_nixl, "ANSWER_TIMEOUT_MS", 1000
    )  # (an oversized answer never comes)

    from protocol.kv_transfer import KVLoad
    from worker.kv_transfer import kv_connector_for

    folder, prompts, _ = tiny
    port = free_tcp_port()
    consumer = nixl_engine(folder, "kv_consumer", port)
    try:
        for host, port_, words in (("10.0.0.2", port, "remote_hosts"), ("127.0.0.1", 0, "remote_port")):
            key = consumer.scheduler.kv_transfer.entry_key(
                Request("p", prompts[4], SamplingParams(), block_size=16)
            )  # type: ignore[union-attr]
            params = {"do_remote_prefill": True, "remote_host": host, "remote_port": port_, "remote_key": key}
            with pytest.raises(InvalidParameterError, match=words):
                consumer.add_request(AddRequest(request_id="h", prompt_token_ids=prompts[4],
                                                sampling_params=SamplingParams(max_tokens=2), arrival_time=0.0,
                                                kv_transfer_params=params))  # fmt: skip
    finally:
        connector(consumer).close()
    answers = [b"\xc1 not msgpack", msgspec.msgpack.encode({"agent": 3}), b"x" * (2 << 20)]
    context = zmq.Context()
    server = context.socket(zmq.REP)
    hostile = free_tcp_port()
    server.bind(f"tcp://127.0.0.1:{hostile}")

    def serve() -> None:
        for answer in answers:
            if server.poll(10_000):
                server.recv()
                server.send(answer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    reader = kv_connector_for(KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_consumer"))
    pool = [torch.zeros(4, 2, 16, 2, 8) for _ in range(2)]
    try:
        for _ in answers:
            errors = reader.load([KVLoad("r", "ab" * 32, 0, [1, 2], f"127.0.0.1:{hostile}")], pool)  # type: ignore[union-attr]
            assert list(errors) == ["r"], errors
        assert all(not layer.any() for layer in pool)  # nothing written
    finally:
        reader.close()  # type: ignore[union-attr]
        thread.join(timeout=10)
        context.destroy(linger=0)


def test_a_taken_side_channel_port_fails_the_start_and_closes_its_context(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A producer whose side-channel port is taken fails its start, naming the address, and leaves no zmq
    context open: one left to the collector waited in Context.__del__ on its socket (a later test's import
    hung 600 s in CI)."""
    import zmq

    import worker.kv_transfer_nixl as nixl_kv

    made: list[zmq.Context] = []

    class Recording(zmq.Context):  # type: ignore[misc,type-arg]
        def __init__(self) -> None:
            super().__init__()
            made.append(self)

    monkeypatch.setattr(nixl_kv.zmq, "Context", Recording)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        config = KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_producer", kv_buffer_size=1 << 20,
                                  kv_connector_extra_config={"side_channel_port": taken.getsockname()[1]})  # fmt: skip
        with pytest.raises(zmq.ZMQError, match="Address already in use"):
            nixl_kv.NixlKV(config)
    assert len(made) == 1 and made[0].closed
