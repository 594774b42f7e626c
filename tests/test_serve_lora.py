"""LoRA through a real `engine serve` of SmolLM2 (float32, two API servers, runtime updating on) and a
frontend attached to it: each door with an adapter as its `model`, greedy equal to HF transformers + peft,
four adapters and the base at once, /v1/models, load and unload over HTTP seen by every frontend, the
errors, the metrics; and `engine run-batch` with an adapter."""

from __future__ import annotations

import asyncio
import json
import pathlib
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.hf_oracle import hf_folder_of_gguf, hf_greedy
from tests.lora_helpers import make_adapter, peft_model
from tests.serve_helpers import Served, attached_frontend, serving

pytestmark = pytest.mark.slow

BASE = "smol"
MAX_TOKENS = 12
PROMPT = "The capital of France is"
# name -> (rank, alpha, targets, rslora, seed)
SPECS = {
    "qv": (8, 24, ["q_proj", "v_proj"], False, 1),
    "all": (16, 8, "all-linear", True, 2),
    "mlp": (8, 4, ["gate_proj", "up_proj", "down_proj"], False, 3),
    "ko": (16, 32, ["k_proj", "o_proj"], False, 4),
}
FLAGS = (
    "--dtype",
    "float32",
    "--max-model-len",
    "512",
    "--served-model-name",
    BASE,
    "--enable-lora",
    "--max-loras",
    "4",
)


@pytest.fixture(scope="module")
def adapters(smollm2_gguf: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    base = str(hf_folder_of_gguf(smollm2_gguf))
    root = tmp_path_factory.mktemp("smol-loras")
    for name, (rank, alpha, targets, rslora, seed) in SPECS.items():
        make_adapter(base, str(root / name), rank, alpha, targets, rslora=rslora, seed=seed, scale=0.05)
    return {name: root / name for name in SPECS}


@pytest.fixture(scope="module")
def oracle(
    smollm2_gguf: str, smollm2_tokenizer, hf_smollm2, adapters: dict[str, pathlib.Path]
) -> dict[str | None, str]:  # type: ignore[no-untyped-def]
    """peft's greedy text of PROMPT per adapter (None: the base model)."""
    tokenizer = smollm2_tokenizer
    ids = tokenizer(PROMPT)["input_ids"]
    base = str(hf_folder_of_gguf(smollm2_gguf))
    models: dict[str | None, Any] = {None: hf_smollm2}
    models.update({name: peft_model(base, str(path)) for name, path in adapters.items()})
    eos = tokenizer.eos_token_id  # generation stops there, as ours does
    runs = {name: hf_greedy(m, ids, MAX_TOKENS, eos).token_ids for name, m in models.items()}
    return {name: tokenizer.decode(tokens, skip_special_tokens=True) for name, tokens in runs.items()}


@pytest.fixture(scope="module")
def server(smollm2_gguf: str, adapters: dict[str, pathlib.Path]) -> Iterator[Served]:
    modules = ["qv=" + str(adapters["qv"]), json.dumps({"name": "all", "path": str(adapters["all"])})]
    with serving(
        smollm2_gguf,
        *FLAGS,
        "--api-server-count",
        "2",
        "--lora-modules",
        *modules,
        env={"ENGINE_ALLOW_RUNTIME_LORA_UPDATING": "true"},
        engine_address=True,
    ) as served:
        yield served


@pytest.fixture(scope="module")
def attached(server: Served) -> Iterator[Served]:
    with attached_frontend(server, env={"ENGINE_ALLOW_RUNTIME_LORA_UPDATING": "1"}) as served:
        yield served


def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.base + "/v1", api_key="none", max_retries=0, timeout=120)


def complete(served: Served, model: str) -> str:
    response = client(served).completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0
    )
    return response.choices[0].text


def load(served: Served, name: str, path: pathlib.Path | str, **extra: Any) -> httpx.Response:
    body = {"lora_name": name, "lora_path": str(path), **extra}
    return httpx.post(served.base + "/v1/load_lora_adapter", json=body, timeout=60)


def unload(served: Served, name: str) -> httpx.Response:
    return httpx.post(served.base + "/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)


def test_completions_per_adapter_equal_peft(server: Served, oracle: dict[str | None, str]) -> None:
    assert complete(server, BASE) == oracle[None]
    for name in ("qv", "all"):
        assert complete(server, name) == oracle[name], name
        assert oracle[name] != oracle[None]


def test_every_door_takes_an_adapter_as_its_model(server: Served) -> None:
    oa = client(server)
    messages = [{"role": "user", "content": "Name a color."}]
    chat = oa.chat.completions.create(model="qv", messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    text = chat.choices[0].message.content
    assert chat.model == "qv"
    base = oa.chat.completions.create(model=BASE, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    assert base.choices[0].message.content != text
    stream = oa.chat.completions.create(
        model="qv", messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == text
    response = oa.responses.create(model="qv", input=messages, max_output_tokens=MAX_TOKENS, temperature=0)
    assert response.output_text == text and response.model == "qv"
    an = anthropic.Anthropic(base_url=server.base, api_key="none", max_retries=0, timeout=120)
    message = an.messages.create(
        model="qv", messages=messages, max_tokens=MAX_TOKENS, extra_body={"temperature": 0}
    )  # type: ignore[arg-type]
    assert message.content[0].text == text and message.model == "qv"  # type: ignore[union-attr]
    tokens = httpx.post(server.base + "/tokenize", json={"model": "qv", "prompt": PROMPT}).json()
    assert tokens["count"] > 0


def test_four_adapters_and_the_base_at_once(server: Served, adapters, oracle) -> None:  # type: ignore[no-untyped-def]
    for name in ("mlp", "ko"):
        assert load(server, name, adapters[name]).status_code == 200
    try:

        async def all_at_once() -> list[str]:
            aclient = openai.AsyncOpenAI(
                base_url=server.base + "/v1", api_key="none", max_retries=0, timeout=120
            )
            names = [BASE, *SPECS] * 2
            work = [
                aclient.completions.create(model=n, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
                for n in names
            ]
            return [r.choices[0].text for r in await asyncio.gather(*work)]

        texts = asyncio.run(all_at_once())
        names = [None, *SPECS] * 2
        assert texts == [oracle[name] for name in names]
    finally:
        for name in ("mlp", "ko"):
            unload(server, name)


def test_models_lists_adapters_with_parent_and_root(server: Served, adapters) -> None:  # type: ignore[no-untyped-def]
    models = {m.id: m for m in client(server).models.list().data}
    assert {BASE, "qv", "all"} <= set(models)
    card = models["qv"].model_dump()
    assert card["parent"] == BASE and card["root"] == str(adapters["qv"])
    assert models[BASE].model_dump()["parent"] is None
    assert client(server).models.retrieve("all").model_dump()["root"] == str(adapters["all"])
    with pytest.raises(openai.NotFoundError):
        client(server).models.retrieve("nope")


def test_unknown_adapter_is_a_404_on_every_door(server: Served) -> None:
    oa = client(server)
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.NotFoundError, match="`nope` does not exist"):
        oa.chat.completions.create(model="nope", messages=messages, max_tokens=2, stream=True)
    with pytest.raises(openai.NotFoundError):
        oa.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        oa.responses.create(model="nope", input="x", max_output_tokens=2)


def test_load_and_unload_are_seen_by_every_frontend(
    server: Served, attached: Served, adapters, oracle
) -> None:  # type: ignore[no-untyped-def]
    """Loaded through the attached frontend: every API server of the first sees it with its next
    request (the engine owns the table); unloaded through the first: the attached one answers 404."""
    assert load(attached, "mlp", adapters["mlp"]).text == "Success: LoRA adapter 'mlp' added successfully."
    for _ in range(4):  # round robin over the two API servers sharing the port
        assert complete(server, "mlp") == oracle["mlp"]
    assert "mlp" in {m.id for m in client(attached).models.list().data}
    assert unload(server, "mlp").status_code == 200
    with pytest.raises(openai.NotFoundError):
        complete(attached, "mlp")
    again = unload(attached, "mlp")
    assert again.status_code == 404 and "not loaded" in again.json()["error"]["message"]


def test_bad_loads_are_400s_naming_the_problem(server: Served, adapters, tmp_path: pathlib.Path) -> None:  # type: ignore[no-untyped-def]
    before = client(server).models.list().data
    (tmp_path / "empty").mkdir()
    cases = [
        (load(server, "x", tmp_path / "missing"), "no LoRA adapter folder"),
        (load(server, "x", tmp_path / "empty"), "no adapter_config.json"),
        (load(server, "qv", adapters["qv"]), "already loaded"),
        (load(server, "x", adapters["qv"], bogus=1), "bogus"),
        (httpx.post(server.base + "/v1/load_lora_adapter", json={"lora_name": "x"}), "lora_path"),
    ]
    for response, words in cases:
        assert response.status_code == 400, response.text
        assert words in response.json()["error"]["message"] or words in response.text
    assert client(server).models.list().data == before
    replaced = load(server, "qv", adapters["ko"], load_inplace=True)
    assert replaced.status_code == 200
    assert client(server).models.retrieve("qv").model_dump()["root"] == str(adapters["ko"])
    assert load(server, "qv", adapters["qv"], load_inplace=True).status_code == 200


def test_metrics_name_the_adapters(server: Served) -> None:
    complete(server, "all")
    text = httpx.get(server.base + "/metrics").text
    assert re.search(
        r'engine:request_success_total\{engine="0",finished_reason="\w+",model_name="all"\} [1-9]', text
    )
    assert "engine:lora_requests_info{" in text and 'max_lora="4"' in text


def test_run_batch_with_an_adapter(smollm2_gguf: str, adapters, oracle, tmp_path: pathlib.Path) -> None:  # type: ignore[no-untyped-def]
    lines = [
        {"custom_id": name or "base", "method": "POST", "url": "/v1/completions",
         "body": {"model": name or BASE, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}}
        for name in (None, "qv", "nope")
    ]  # fmt: skip
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    command = [sys.executable, "-m", "frontend.cli", "run-batch", smollm2_gguf, *FLAGS, "--lora-modules",
               f"qv={adapters['qv']}", "-i", str(source), "-o", str(target)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    records = {r["custom_id"]: r for r in map(json.loads, target.read_text().splitlines())}
    assert records["base"]["response"]["body"]["choices"][0]["text"] == oracle[None]
    assert records["qv"]["response"]["body"]["choices"][0]["text"] == oracle["qv"]
    assert records["nope"]["response"]["status_code"] == 404


def test_offline_generate_with_lora_requests(smollm2_gguf: str, adapters, oracle) -> None:  # type: ignore[no-untyped-def]
    """vLLM's LLM.generate(..., lora_request=LoRARequest(name, id, path)): loaded on first use, one for
    every prompt or one per prompt (None: the base model)."""
    from frontend import LLM, LoRARequest, SamplingParams

    llm = LLM(smollm2_gguf, dtype="float32", max_model_len=512, enable_lora=True, max_loras=2)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        qv, ko = LoRARequest("qv", 1, str(adapters["qv"])), LoRARequest("ko", 2, str(adapters["ko"]))
        assert llm.generate(PROMPT, params, lora_request=qv)[0].outputs[0].text == oracle["qv"]
        results = llm.generate([PROMPT] * 3, params, lora_request=[ko, None, qv])
        assert [r.outputs[0].text for r in results] == [oracle["ko"], oracle[None], oracle["qv"]]
        with pytest.raises(ValueError, match="lora_int_id 1 is 'qv'"):
            llm.generate(PROMPT, params, lora_request=LoRARequest("other", 1, str(adapters["all"])))
    finally:
        llm.shutdown()


def test_bench_serve_compares_adapters_with_the_base(server: Served, tmp_path: pathlib.Path) -> None:
    report = tmp_path / "lora.json"
    command = [sys.executable, "-m", "frontend.cli", "bench", "serve", "--base-url", server.base, "--model", BASE,
               "--num-prompts", "4", "--input-len", "16", "--output-len", "4", "--max-concurrency", "2",
               "--lora-modules", "qv", "all", "--lora-compare", "--quiet", "--output-json", str(report)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Output throughput, adapters / base:" in done.stdout
    body = json.loads(report.read_text())
    assert body["output_throughput_ratio"] > 0 and body["rounds"][0]["adapters"]["failed"] == 0
