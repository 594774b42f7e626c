"""LoRA adapters made with peft: float32 greedy per adapter equals HF transformers + peft token for token,
alone and in steps that mix four adapters and the base model; fewer slots than adapters; the prefix cache
keyed by adapter; bad folders refused with the engine unchanged; unloading while requests run.

The EngineCore runs with the in-process executor (the real scheduler and worker code, no processes).
"""

from __future__ import annotations

import json
import os
import random
import shutil

import pytest
import torch

from engine_core.engine_core import EngineCore
from protocol.config import EngineConfig, WorkerConfig
from protocol.errors import InvalidParameterError
from protocol.lora import LoraAdapter, LoraConfig
from protocol.messages import AddRequest
from protocol.sampling import SamplingParams
from tests.family_models import TINY_KV_TOKENS
from tests.hf_oracle import compare_greedy, hf_greedy
from tests.lora_helpers import make_adapter, peft_model
from tests.test_correctness_tiny import build_tiny
from worker.executor import InprocExecutor

MAX_NEW_TOKENS = 16
# name -> (rank, lora_alpha, target_modules, use_rslora): ranks 8 and 16, alpha unequal to rank, rsLoRA
ADAPTERS = {
    "qv8": (8, 24, ["q_proj", "v_proj"], False),
    "all16": (16, 8, "all-linear", False),
    "rslora8": (8, 16, ["k_proj", "o_proj", "down_proj"], True),
    "mlp16": (16, 32, ["gate_proj", "up_proj"], False),
}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_loras(request, tmp_path_factory):  # type: ignore[no-untyped-def]
    """A tiny model, four peft adapters of it, prompts and each (prompt, adapter)'s peft greedy tokens."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    folder = str(root / "base")
    build_tiny(request.param, folder)
    for seed, (name, (rank, alpha, targets, rslora)) in enumerate(ADAPTERS.items()):
        make_adapter(folder, str(root / name), rank, alpha, targets, rslora=rslora, seed=seed)
    rng = random.Random(5)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(3, 60))] for _ in range(5)]
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    models = {None: base, **{name: peft_model(folder, str(root / name)) for name in ADAPTERS}}
    oracle = {
        (i, name): hf_greedy(model, prompt, MAX_NEW_TOKENS, None)
        for name, model in models.items()
        for i, prompt in enumerate(prompts)
    }
    return root, prompts, oracle


def make_engine(root, max_loras: int = 4, max_cpu_loras: int | None = None, **engine_kwargs) -> EngineCore:  # type: ignore[no-untyped-def]
    lora = LoraConfig(max_loras=max_loras, max_lora_rank=16, max_cpu_loras=max_cpu_loras)
    worker = WorkerConfig(model=str(root / "base"), dtype="float32", block_size=16, lora=lora,
                          num_kv_blocks=TINY_KV_TOKENS // 16)  # fmt: skip
    modules = [LoraAdapter(name=name, path=str(root / name)) for name in ADAPTERS]
    return EngineCore(
        EngineConfig(worker=worker, lora_modules=modules, **engine_kwargs), InprocExecutor(worker)
    )


def submit(
    core: EngineCore, request_id: str, prompt: list[int], lora: str | None, max_tokens: int = MAX_NEW_TOKENS
) -> None:
    """A greedy request on the adapter `lora` (None: the base model)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    message = AddRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling_params=params, arrival_time=0, lora_name=lora
    )
    core.add_request(message)


def run(core: EngineCore, jobs: list[tuple[list[int], str | None]]) -> list[list[int]]:
    for i, (prompt, lora) in enumerate(jobs):
        submit(core, f"r{i}", prompt, lora)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(jobs))}
    while core.has_unfinished_requests():
        for _, output in core.step():
            tokens[output.request_id].extend(output.new_token_ids)
        core.scheduler.check_invariants()
    assert core.scheduler.kv_cache.pool.num_free_blocks == core.scheduler.config.num_kv_blocks
    return [tokens[f"r{i}"] for i in range(len(jobs))]


def mixed_jobs(prompts: list[list[int]]) -> list[tuple[list[int], str | None]]:
    """Every prompt on the base model and on each adapter: 25 requests, mixed in every step."""
    names: list[str | None] = [None, *ADAPTERS]
    return [
        (prompt, names[(i + j) % len(names)]) for j in range(len(names)) for i, prompt in enumerate(prompts)
    ]


def check(jobs, outputs, prompts, oracle) -> None:  # type: ignore[no-untyped-def]
    for (prompt, name), ours in zip(jobs, outputs, strict=True):
        compare_greedy(ours, oracle[(prompts.index(prompt), name)])


def test_each_adapter_alone_equals_peft(tiny_loras) -> None:  # type: ignore[no-untyped-def]
    root, prompts, oracle = tiny_loras
    core = make_engine(root)
    for name in [None, *ADAPTERS]:
        jobs = [(prompts[0], name)]
        check(jobs, run(core, jobs), prompts, oracle)
    base = oracle[(0, None)].token_ids
    assert all(oracle[(0, name)].token_ids != base for name in ADAPTERS), "each adapter changes the output"


CONFIGS = {
    "mixed": {},
    "chunk_16_async": dict(max_num_batched_tokens=16, async_scheduling=True),
    "no_prefix_caching": dict(enable_prefix_caching=False),
}


@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_one_batch_mixing_four_adapters_and_the_base_equals_peft(tiny_loras, config_name: str) -> None:  # type: ignore[no-untyped-def]
    root, prompts, oracle = tiny_loras
    core = make_engine(root, **CONFIGS[config_name])
    seen: list[set[int]] = []
    execute = core.executor.runner.execute_model  # type: ignore[attr-defined]

    def recording(scheduler_output):  # type: ignore[no-untyped-def]
        batch = core.executor.runner.batch  # type: ignore[attr-defined]
        output = execute(scheduler_output)
        ids = {
            batch.requests[r].lora.lora_id if batch.requests[r].lora else 0
            for r in scheduler_output.num_scheduled_tokens
        }
        seen.append(ids)
        return output

    core.executor.runner.execute_model = recording  # type: ignore[attr-defined]
    jobs = mixed_jobs(prompts)
    check(jobs, run(core, jobs), prompts, oracle)
    assert any(len(ids) == 5 for ids in seen), "some step held the base model and all four adapters"


def test_the_python_layers_add_the_same_products(tiny_loras) -> None:  # type: ignore[no-untyped-def]
    """Without the native decoder stack (the layers in Python, as steps it does not take run), the LoRA
    products go through LoraBatch.add after each fused product: the same tokens as peft."""
    root, prompts, oracle = tiny_loras
    core = make_engine(root)
    core.executor.runner.model.native_layers = None  # type: ignore[attr-defined]
    jobs = mixed_jobs(prompts)[:10]
    check(jobs, run(core, jobs), prompts, oracle)


def test_fewer_slots_than_adapters(tiny_loras) -> None:  # type: ignore[no-untyped-def]
    """max_loras 2: no step holds more than two adapters (later requests pass one that would be a third),
    slots are reused; max_cpu_loras 2: adapters the cache let go of are read again from their folders."""
    root, prompts, oracle = tiny_loras
    core = make_engine(root, max_loras=2, max_cpu_loras=2)
    lora_counts: list[int] = []
    schedule = core.scheduler.schedule

    def counting():  # type: ignore[no-untyped-def]
        output = schedule()
        running = {r.lora.lora_id for r in core.scheduler.running if r.lora is not None}
        lora_counts.append(len(running))
        return output

    core.scheduler.schedule = counting  # type: ignore[method-assign]
    jobs = mixed_jobs(prompts)
    check(jobs, run(core, jobs), prompts, oracle)
    assert max(lora_counts) == 2
    assert len(core.executor.runner.lora.cache) <= 2  # type: ignore[attr-defined]


def test_the_prefix_cache_is_keyed_by_adapter(tiny_loras) -> None:  # type: ignore[no-untyped-def]
    root, prompts, oracle = tiny_loras
    core = make_engine(root)
    prompt = prompts[1] + prompts[2]  # long enough for full blocks
    cached = []
    for name in ("qv8", "all16", "qv8", None):
        submit(core, f"p{len(cached)}", prompt, name, max_tokens=2)
        hit = 0
        while core.has_unfinished_requests():
            for _, output in core.step():
                hit = output.num_cached_tokens
        cached.append(hit)
    assert cached[0] == 0 and cached[1] == 0, "another adapter's KV is never served"
    assert cached[2] > 0, "the same adapter hits its own blocks"
    assert cached[3] == 0, "nor is an adapter's KV served to the base model"


def test_bad_folders_are_refused_and_the_engine_is_unchanged(tiny_loras, tmp_path) -> None:  # type: ignore[no-untyped-def]
    root, prompts, oracle = tiny_loras
    core = make_engine(root)
    before = core.call_utility("list_loras", [])
    runner = core.executor.runner  # type: ignore[attr-defined]
    cached_before = list(runner.lora.cache)

    def folder(name: str, edit=None, drop=None) -> str:  # type: ignore[no-untyped-def]
        path = tmp_path / name
        shutil.copytree(root / "qv8", path)
        if edit is not None:
            config = json.loads((path / "adapter_config.json").read_text())
            config.update(edit)
            (path / "adapter_config.json").write_text(json.dumps(config))
        if drop is not None:
            os.unlink(path / drop)
        return str(path)

    from transformers import LlamaConfig, LlamaForCausalLM

    wide = str(tmp_path / "wide-base")  # another model's adapter: 96 wide, not 64
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=512,
            hidden_size=96,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    ).save_pretrained(wide)
    make_adapter(wide, str(tmp_path / "wide"), 8, 16, ["q_proj"])
    cases = {
        str(tmp_path / "missing"): "no LoRA adapter folder",
        folder("no-config", drop="adapter_config.json"): "no adapter_config.json",
        folder("no-weights", drop="adapter_model.safetensors"): "no adapter_model.safetensors",
        folder("rank", edit={"r": 32}): "rank 32 is over --max-lora-rank 16",
        folder(
            "targets", edit={"target_modules": ["q_proj", "embed_tokens"]}
        ): "['embed_tokens'] are not supported",
        folder("save", edit={"modules_to_save": ["lm_head"]}): "modules_to_save",
        folder("shape", edit={"r": 4}): "do not fit the base model",
        str(tmp_path / "wide"): "do not fit the base model (64 x 64)",
    }
    for path, message in cases.items():
        with pytest.raises(InvalidParameterError) as raised:
            core.call_utility("load_lora", ["bad", path, None, False])
        assert message in raised.value.message, raised.value.message
    with pytest.raises(InvalidParameterError, match="already loaded"):
        core.call_utility("load_lora", ["qv8", str(root / "qv8"), None, False])
    assert core.call_utility("list_loras", []) == before
    assert list(runner.lora.cache) == cached_before
    with pytest.raises(InvalidParameterError) as raised:
        run(core, [(prompts[0], "bad")])
    assert raised.value.code == "model_not_found"
    check([(prompts[0], "qv8")], run(core, [(prompts[0], "qv8")]), prompts, oracle)


def test_unloading_while_requests_run(tiny_loras) -> None:  # type: ignore[no-untyped-def]
    """The running request finishes on the adapter; new ones get a 404; the worker frees it after; the
    name may be loaded again (a new id: no KV or weights of the old one serve it)."""
    root, prompts, oracle = tiny_loras
    core = make_engine(root)
    runner = core.executor.runner  # type: ignore[attr-defined]
    submit(core, "a", prompts[0], "qv8")
    tokens: list[int] = []
    for _, output in core.step():
        tokens.extend(output.new_token_ids)
    old_id = core.loras.adapters["qv8"].lora_id
    core.call_utility("unload_lora", ["qv8"])
    assert "qv8" not in [a["name"] for a in core.call_utility("list_loras", [])]
    with pytest.raises(InvalidParameterError) as raised:
        submit(core, "b", prompts[0], "qv8")
    assert raised.value.code == "model_not_found"
    assert old_id in runner.lora.cache, "the running request still uses it"
    while core.has_unfinished_requests():
        for _, output in core.step():
            tokens.extend(output.new_token_ids)
    compare_greedy(tokens, oracle[(0, "qv8")])
    assert old_id not in runner.lora.cache and old_id not in runner.lora.slot_ids
    with pytest.raises(InvalidParameterError) as raised:
        core.call_utility("unload_lora", ["qv8"])
    assert raised.value.code == "model_not_found"
    core.call_utility("load_lora", ["qv8", str(root / "qv8"), None, False])
    assert core.loras.adapters["qv8"].lora_id != old_id
    check([(prompts[1], "qv8")], run(core, [(prompts[1], "qv8")]), prompts, oracle)


def test_lora_off_refuses_adapter_names(tiny_loras) -> None:  # type: ignore[no-untyped-def]
    root, prompts, _ = tiny_loras
    worker = WorkerConfig(
        model=str(root / "base"), dtype="float32", block_size=16, num_kv_blocks=TINY_KV_TOKENS // 16
    )
    core = EngineCore(EngineConfig(worker=worker), InprocExecutor(worker))
    with pytest.raises(InvalidParameterError, match="does not exist"):
        run(core, [(prompts[0], "qv8")])
    with pytest.raises(InvalidParameterError, match="--enable-lora"):
        core.call_utility("load_lora", ["qv8", str(root / "qv8"), None, False])


def test_an_adapter_read_again_from_a_changed_folder_fails_its_requests_only(tiny_loras, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """One slot, one cached adapter: loading B lets A go from the worker's cache; A's folder is then
    removed. A request on A ends with an error naming it; the engine serves on (B, the base model)."""
    root, prompts, oracle = tiny_loras
    lora = LoraConfig(max_loras=1, max_lora_rank=16, max_cpu_loras=1)
    worker = WorkerConfig(model=str(root / "base"), dtype="float32", block_size=16, lora=lora,
                          num_kv_blocks=TINY_KV_TOKENS // 16)  # fmt: skip
    core = EngineCore(EngineConfig(worker=worker), InprocExecutor(worker))
    copy = tmp_path / "qv8-copy"
    shutil.copytree(root / "qv8", copy)
    core.call_utility("load_lora", ["a", str(copy), None, False])
    core.call_utility("load_lora", ["b", str(root / "all16"), None, False])
    shutil.rmtree(copy)
    submit(core, "on-a", prompts[0], "a", max_tokens=4)
    ended = []
    while core.has_unfinished_requests():
        ended += [output for _, output in core.step() if output.finish_reason]
    assert [o.finish_reason for o in ended] == ["error"] and not ended[0].new_token_ids
    assert ended[0].error is not None and "`a` could not be read again" in ended[0].error.message
    assert core.scheduler.kv_cache.pool.num_free_blocks == core.scheduler.config.num_kv_blocks
    check([(prompts[0], "all16")], [run(core, [(prompts[0], "b")])[0]], prompts, oracle)
    check([(prompts[1], None)], run(core, [(prompts[1], None)]), prompts, oracle)
    with pytest.raises(InvalidParameterError, match="served model's name"):
        core.call_utility(
            "load_lora", [core.model_info.served_model_names[0], str(root / "qv8"), None, False]
        )
