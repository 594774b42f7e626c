"""`engine serve -tp 2` through the openai SDK (greedy tokens equal HF transformers'), and a rank's faults
with real processes: killed while the model loads, killed mid-stream, and stopped mid-stream (a rank hung
in a collective, caught by --distributed-timeout). Each ends the engine with the fault semantics of one
worker: open requests end with an error, an attached frontend's /health answers 503, the launcher exits
non-zero, and no process is left."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import httpx
import openai
import psutil
import pytest
import torch

from tests.hf_oracle import compare_greedy, hf_greedy
from tests.serve_helpers import free_engine_port, free_port, serving, stop, wait_until
from tests.test_reliability import Stream, stream_on
from tests.test_tensor_parallel import build

pytestmark = pytest.mark.slow
ENGINE_ARGS = [
    "--dtype",
    "float32",
    "--num-kv-blocks",
    "64",
    "--max-model-len",
    "2048",
    "--stats-log-interval",
    "0",
]


@pytest.fixture(scope="module")
def tiny_chat(smollm2_tokenizer, tmp_path_factory: pytest.TempPathFactory) -> str:  # type: ignore[no-untyped-def]
    """A tiny random llama (8 heads, 4 KV heads) with SmolLM2's tokenizer, so the chat door can render."""
    folder = tmp_path_factory.mktemp("tiny-chat")
    tokenizer = smollm2_tokenizer
    build(str(folder), "llama", 8, 4, vocab_size=len(tokenizer))
    tokenizer.save_pretrained(str(folder))
    return str(folder)


def ranks(launcher: subprocess.Popen[bytes]) -> list[psutil.Process]:
    """The launcher's worker processes, rank 0 first (the others start with no engine address: "-")."""
    tree = psutil.Process(launcher.pid).children(recursive=True)
    workers = [p for p in tree if "worker.main" in " ".join(p.cmdline())]
    return sorted(workers, key=lambda p: "-" in p.cmdline())


def test_tp2_chat_through_the_openai_sdk_equals_hf(tiny_chat: str) -> None:
    from transformers import AutoModelForCausalLM

    with serving(tiny_chat, "-tp", "2", *ENGINE_ARGS) as served:
        client = openai.OpenAI(base_url=f"{served.base}/v1", api_key="none")
        chat = client.chat.completions.create(
            model=tiny_chat,
            messages=[{"role": "user", "content": "Say something."}],
            max_tokens=16,
            temperature=0,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        prompt_ids = chat.model_extra["prompt_token_ids"]  # type: ignore[index]
        ours = chat.choices[0].model_extra["token_ids"]  # type: ignore[index]
        stream = client.completions.create(
            model=tiny_chat, prompt=prompt_ids, max_tokens=16, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        assert streamed == chat.choices[0].message.content
    hf = AutoModelForCausalLM.from_pretrained(tiny_chat, dtype=torch.float32).eval()
    compare_greedy(ours, hf_greedy(hf, prompt_ids, 16, eos_token_id=None))


def test_a_rank_killed_while_the_model_loads_stops_the_launcher(tiny_chat: str) -> None:
    port = free_port()
    launcher = subprocess.Popen([sys.executable, "-m", "frontend.cli", "serve", tiny_chat, "--port", str(port),
                                 "-tp", "2", *ENGINE_ARGS])  # fmt: skip
    try:
        rank_1 = wait_until(lambda: next(iter(ranks(launcher)[1:]), None), 60, "rank 1's process")
        tree = psutil.Process(launcher.pid).children(recursive=True)
        rank_1.send_signal(signal.SIGKILL)
        assert launcher.wait(timeout=120) != 0
        _, alive = psutil.wait_procs(tree, timeout=30)
        assert not alive, f"orphans: {alive}"
    finally:
        if launcher.poll() is None:
            stop(launcher)


@pytest.mark.long  # make test-long
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_a_rank_that_dies_or_hangs_mid_stream_fails_the_engine_cleanly(
    tiny_chat: str, fault: str, rank: int
) -> None:
    """Headless engine, attached frontend: the frontend outlives the engine, so its 503 can be read."""
    address = f"tcp://127.0.0.1:{free_engine_port()}"
    timeout = ["--distributed-timeout", "3"] if fault == "hung" else []
    engine = subprocess.Popen([sys.executable, "-m", "frontend.cli", "serve", tiny_chat, "--headless",
                               "--engine-address", address, "-tp", "2", *ENGINE_ARGS, *timeout])  # fmt: skip
    try:
        with serving(None, "--attach", address) as frontend:
            port = int(frontend.base.rsplit(":", 1)[1])
            streams = [stream_on(port, 1900)] + [Stream(port, 1900) for _ in range(2)]
            for stream in streams[1:]:
                stream.start()
            tree = psutil.Process(engine.pid).children(recursive=True)
            victim = ranks(engine)[rank]
            if fault == "killed":
                victim.send_signal(signal.SIGKILL)
            else:
                victim.suspend()  # the other rank waits in its next collective until the timeout
            for stream in streams:
                stream.join(60)
                assert not stream.is_alive() and stream.error is not None, stream.__dict__
                assert stream.finish_reason is None, stream.__dict__
            wait_until(lambda: httpx.get(f"{frontend.base}/health").status_code == 503, 30, "/health 503")
            assert engine.wait(timeout=60) != 0
            _, alive = psutil.wait_procs(tree, timeout=30)
            assert not alive, f"orphans: {alive}"
    finally:
        if engine.poll() is None:
            stop(engine)


@pytest.mark.long  # make test-long
def test_two_nodes_on_loopback(tiny_chat: str) -> None:
    """--nnodes 2: node 0 runs the engine, the API server and rank 0; node 1 (--headless) runs rank 1, which
    joins at --master-addr. Node 0 stopping stops node 1's rank (it passes the shutdown on), and node 1's
    launcher exits 0; rank 1 killed instead would fail the engine as above."""
    from transformers import AutoModelForCausalLM

    common = [
        "-tp",
        "2",
        "--nnodes",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_engine_port()),
    ]
    node_1 = subprocess.Popen([sys.executable, "-m", "frontend.cli", "serve", tiny_chat, "--node-rank", "1",
                               "--headless", *common, *ENGINE_ARGS])  # fmt: skip
    try:
        with serving(tiny_chat, "--node-rank", "0", *common, *ENGINE_ARGS) as served:
            assert len(ranks(served.process)) == 1  # rank 1 is node 1's
            client = openai.OpenAI(base_url=f"{served.base}/v1", api_key="none")
            prompt = list(range(100, 140))
            completion = client.completions.create(
                model=tiny_chat, prompt=prompt, max_tokens=12, temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )  # fmt: skip
            ours = completion.choices[0].model_extra["token_ids"]  # type: ignore[index]
        assert node_1.wait(timeout=60) == 0
    finally:
        if node_1.poll() is None:
            stop(node_1)
    hf = AutoModelForCausalLM.from_pretrained(tiny_chat, dtype=torch.float32).eval()
    compare_greedy(ours, hf_greedy(hf, prompt, 12, eos_token_id=None))


def under_a_ray_actor(process: psutil.Process) -> bool:
    """Whether the process's parent is a Ray worker (its command line reads ray::RankHost...)."""
    try:
        parent = process.parent()
        return parent is not None and "ray::" in " ".join(parent.cmdline())
    except psutil.Error:
        return False


@pytest.fixture
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A local Ray cluster (`ray start --head` on 127.0.0.1, two CPUs), stopped after: its address."""
    pytest.importorskip("ray")
    port = free_engine_port()
    temp = tempfile.mkdtemp(prefix="ray-")  # short: Ray's sockets live under it
    command = ["ray", "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1", "--num-cpus=2",
               f"--temp-dir={temp}", "--include-dashboard=false", "--disable-usage-stats"]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, timeout=120)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run(["ray", "stop", "--force"], capture_output=True, timeout=120)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.long  # make test-long
def test_ray_ranks_on_a_local_cluster(tiny_chat: str, ray_cluster: str) -> None:
    """--distributed-executor-backend ray: the two ranks are Ray actors' workers in a placement group; the
    tokens equal HF's, and stopping the server leaves no worker behind."""
    from transformers import AutoModelForCausalLM

    prompt = list(range(200, 230))
    with serving(tiny_chat, "-tp", "2", "--distributed-executor-backend", "ray", *ENGINE_ARGS,
                 env={"RAY_ADDRESS": ray_cluster}) as served:  # fmt: skip
        client = openai.OpenAI(base_url=f"{served.base}/v1", api_key="none")
        completion = client.completions.create(
            model=tiny_chat, prompt=prompt, max_tokens=12, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
        ours = completion.choices[0].model_extra["token_ids"]  # type: ignore[index]
        workers = [p for p in psutil.process_iter(["cmdline"]) if "worker.main" in " ".join(p.info["cmdline"] or [])
                   and under_a_ray_actor(p)]  # fmt: skip
        assert len(workers) == 2, workers  # under the actors, not the launcher
        assert not ranks(served.process)
    _, alive = psutil.wait_procs(workers, timeout=30)
    assert not alive, f"workers outlived the server: {alive}"
    hf = AutoModelForCausalLM.from_pretrained(tiny_chat, dtype=torch.float32).eval()
    compare_greedy(ours, hf_greedy(hf, prompt, 12, eos_token_id=None))
