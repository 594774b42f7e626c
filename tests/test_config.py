"""One source of truth for configuration: every EngineArgs and ServerArgs field is a flag of the
commands that take it, with the field's default; the EngineConfig the engine reads starts from the same
defaults; vLLM's spellings (VLLM_API_KEY, a JSON list of origins, --disable-*) are understood."""

from __future__ import annotations

import dataclasses

import pytest

from frontend.cli.main import build_parser
from frontend.config.engine_args import EngineArgs
from frontend.config.engine_values import lora_module
from frontend.config.flags import ConfigError, default_of, flag_name, from_namespace, human_bytes
from frontend.config.server_args import (
    SERVE_DECODE_PREFILL_TOKEN_BUDGET,
    SERVE_MAX_NUM_BATCHED_TOKENS,
    ZEN4_DECODE_PREFILL_SHARE,
    ServerArgs,
    origins,
    serve_prefill_share,
)
from protocol.config import EngineConfig, WorkerConfig
from protocol.lora import LoraAdapter

# Per-command defaults that differ from the field's, on purpose (each is documented where it is set).
COMMAND_DEFAULTS = {
    "serve": {
        "max_num_batched_tokens": SERVE_MAX_NUM_BATCHED_TOKENS,
        "decode_prefill_token_budget": serve_prefill_share()[0],
        "decode_prefill_tokens_per_request": serve_prefill_share()[1],
    }
}
COMMANDS = {
    "serve": (EngineArgs, ServerArgs),
    "generate": (EngineArgs,),
    "bench throughput": (EngineArgs,),
    "bench latency": (EngineArgs,),
}


def parse(command: str, *argv: str):  # type: ignore[no-untyped-def]
    extra = ["--prompt", "x"] if command == "generate" else []
    return build_parser().parse_args([*command.split(), *extra, *argv])


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_field_is_a_flag_with_the_fields_default(command: str) -> None:
    namespace = parse(command)
    help_text = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    parser = help_text[command.split()[0]]
    if " " in command:
        parser = parser._subparsers._group_actions[0].choices[command.split()[1]]  # type: ignore[union-attr]
    flags = {option for action in parser._actions for option in action.option_strings}
    for cls in COMMANDS[command]:
        for field in dataclasses.fields(cls):
            expected = COMMAND_DEFAULTS.get(command, {}).get(field.name, default_of(field))
            assert getattr(namespace, field.name) == expected, (command, field.name)
            if not field.metadata.get("positional"):
                assert flag_name(field) in flags, (command, field.name)
            assert field.metadata.get("help"), f"{cls.__name__}.{field.name} has no help text"


def test_engine_args_defaults_agree_with_the_engine_config() -> None:
    engine, worker = EngineConfig(worker=WorkerConfig(model="m")), WorkerConfig(model="m")
    args = EngineArgs()
    shared = 0
    for field in dataclasses.fields(EngineArgs):
        if field.name in ("model", "cache_dir", "pooler_config"):  # required there, or a path only
            continue  # EngineArgs resolves (the bundled model, the home folder), or JSON it parses
        for config in (engine, worker):
            if field.name in config.__struct_fields__:
                # the KV cache's size: None until resolved (the flag, else the environment, else 1 GiB)
                ours = (
                    args.kv_cache_bytes({})
                    if field.name == "kv_cache_memory_bytes"
                    else getattr(args, field.name)
                )
                assert ours == getattr(config, field.name), field.name
                shared += 1
    assert shared >= 15
    assert args.engine_config().async_scheduling is EngineConfig(worker=worker).async_scheduling is True


def test_flags_reach_the_configs() -> None:
    namespace = parse(
        "serve", "m", "--served-model-name", "a", "b", "--kv-cache-memory-gb", "2", "--no-async-scheduling",
        "--allowed-origins", '["https://a.example", "https://b.example"]', "--allowed-origins", "https://c.example",
        "--disable-fastapi-docs", "--disable-log-requests", "--metrics-prefix", "vllm", "--shutdown-timeout", "5",
    )  # fmt: skip
    engine, server = from_namespace(EngineArgs, namespace), from_namespace(ServerArgs, namespace)
    assert engine.model == "m" and engine.served_model_name == ["a", "b"]
    assert engine.kv_cache_memory_bytes == 2 << 30 and engine.async_scheduling is False
    assert server.allowed_origins == ["https://a.example", "https://b.example", "https://c.example"]
    assert not server.enable_fastapi_docs and not server.enable_log_requests
    assert server.metrics_prefix == "vllm" and server.shutdown_timeout_s == 5.0
    assert (
        from_namespace(EngineArgs, parse("serve", "--kv-cache-memory-bytes", "512M")).kv_cache_memory_bytes
        == 512 << 20
    )


def test_the_kv_cache_size_comes_from_vllm_s_cpu_variable_unless_a_flag_gives_it() -> None:
    default = EngineArgs()
    assert default.kv_cache_bytes({}) == 1 << 30
    assert default.kv_cache_bytes({"VLLM_CPU_KVCACHE_SPACE": "2"}) == 2 << 30
    assert default.kv_cache_bytes({"VLLM_CPU_KVCACHE_SPACE": "0"}) == 1 << 30  # vLLM's 0: the default
    both = {"ENGINE_CPU_KVCACHE_SPACE": "0.25", "VLLM_CPU_KVCACHE_SPACE": "4"}
    assert default.kv_cache_bytes(both) == 1 << 28  # ours first
    given = from_namespace(EngineArgs, parse("serve", "--kv-cache-memory-bytes", "512M"))
    assert given.kv_cache_bytes(both) == 512 << 20  # the flag wins
    for raw in ("lots", "-1", "nan"):
        with pytest.raises(ConfigError, match=f"VLLM_CPU_KVCACHE_SPACE.*{raw}"):
            default.kv_cache_bytes({"VLLM_CPU_KVCACHE_SPACE": raw})


def test_sizes_and_origins_parse_as_vllm_writes_them() -> None:
    assert [human_bytes(v) for v in ("1024", "1K", "2G", "1.5GiB")] == [1024, 1024, 2 << 30, 3 << 29]
    assert origins('["https://a.example"]') == ["https://a.example"] and origins("https://a") == ["https://a"]
    with pytest.raises(ValueError):
        origins('["unclosed"')


def test_api_keys_come_from_vllm_s_variable_too() -> None:
    assert ServerArgs().api_keys({"VLLM_API_KEY": "a,b", "ENGINE_API_KEY": "c"}) == ["c", "a", "b"]


def test_bad_values_are_refused_once_at_construction() -> None:
    with pytest.raises(ValueError, match="--block-size"):
        EngineArgs(block_size=7)
    with pytest.raises(ValueError, match="--max-num-seqs"):
        EngineArgs(max_num_seqs=0)
    # a flag's choices hold for the Python API's keyword arguments as for the command line
    for field, value in (("dtype", "half"), ("attention_backend", "gpu"), ("scheduling_policy", "lifo")):
        with pytest.raises(
            ConfigError, match=f"--{field.replace('_', '-')}: must be one of .*, got '{value}'"
        ):
            EngineArgs(**{field: value})  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        EngineArgs().dtype = "float32"  # type: ignore[misc]


def test_lora_flags_as_vllm_spells_them(tmp_path) -> None:  # type: ignore[no-untyped-def]
    json_module = '{"name": "chat", "path": "/adapters/chat", "base_model_name": "base"}'
    argv = ["serve", "m", "--served-model-name", "smol", "--enable-lora", "--max-loras", "3", "--max-cpu-loras", "5",
            "--lora-modules", "sql=/adapters/sql", json_module, "--profiler-config",
            '{"profiler": "torch", "torch_profiler_dir": "/tmp/traces"}']  # fmt: skip
    args = from_namespace(EngineArgs, build_parser().parse_args(argv))
    config = dataclasses.replace(args, model=str(tmp_path)).engine_config()
    assert config.worker.lora is not None and config.worker.lora.max_loras == 3
    assert config.worker.lora.num_cpu_loras == 5 and config.worker.lora.max_lora_rank == 16
    assert [(m.name, m.path, m.base_model_name) for m in config.lora_modules] == [
        ("sql", "/adapters/sql", "smol"),  # the served model's name by default
        ("chat", "/adapters/chat", "base"),
    ]
    assert config.profiler_dir == "/tmp/traces"
    assert (
        dataclasses.replace(args, model=str(tmp_path), enable_lora=False, lora_modules=[])
        .engine_config()
        .worker.lora
        is None
    )
    for bad, flag in (
        (dict(lora_modules=[LoraAdapter(name="x", path="/x")]), "--lora-modules"),  # needs --enable-lora
        (dict(enable_lora=True, max_loras=0), "--max-loras"),
        (dict(enable_lora=True, max_loras=4, max_cpu_loras=2), "--max-cpu-loras"),
        (
            dict(
                enable_lora=True,
                lora_modules=[LoraAdapter(name="x", path="/a"), LoraAdapter(name="x", path="/b")],
            ),
            "twice",
        ),
        (dict(profiler_config={"profiler": "nsys"}), "--profiler-config"),
    ):
        with pytest.raises(ValueError, match=flag):
            EngineArgs(**bad)  # type: ignore[arg-type]
    for text in ("sql", "=/p", '{"name": "x"}'):
        with pytest.raises(ValueError):
            lora_module(text)


def test_parallel_flags_as_vllm_spells_them(tmp_path) -> None:  # type: ignore[no-untyped-def]
    argv = ["serve", "m", "-tp", "2", "-dp", "3", "--nnodes", "1", "--distributed-executor-backend", "ray",
            "--distributed-timeout", "30"]  # fmt: skip
    args = from_namespace(EngineArgs, build_parser().parse_args(argv))
    assert (args.tensor_parallel_size, args.data_parallel_size) == (2, 3)
    parallel = dataclasses.replace(args, model=str(tmp_path)).engine_config().worker.parallel
    assert (parallel.tensor_parallel_size, parallel.executor_backend, parallel.timeout_s) == (2, "ray", 30.0)
    assert list(
        EngineArgs(
            data_parallel_size=4, data_parallel_start_rank=2, data_parallel_address="10.0.0.1"
        ).data_parallel_local_ranks
    ) == [
        2,
        3,
    ]
    for bad, flag in (
        (dict(pipeline_parallel_size=2), "--pipeline-parallel-size"),
        (dict(enable_expert_parallel=True), "--enable-expert-parallel"),
        (dict(tensor_parallel_size=2, nnodes=3, master_port=29501), "--nnodes"),
        (dict(tensor_parallel_size=2, nnodes=2), "--master-port"),
        (dict(tensor_parallel_size=2, nnodes=2, node_rank=2, master_port=29501), "--node-rank"),
        (dict(tensor_parallel_size=2, enable_lora=True), "--enable-lora"),
        (dict(tensor_parallel_size=2, convert="embed"), "--tensor-parallel-size"),
        (dict(data_parallel_size=2, data_parallel_size_local=1), "--data-parallel-size-local"),
        (dict(data_parallel_size=2, data_parallel_start_rank=2), "--data-parallel-start-rank"),
    ):
        with pytest.raises(ValueError, match=flag):
            EngineArgs(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_commands_own_parser_reads_its_command_line_as_the_whole_parser_does(command: str) -> None:
    """`engine serve` builds only serve's parser (PARSERS): the same flags, defaults and values."""
    extra = ["--prompt", "x"] if command == "generate" else []
    argv = [*command.split(), *extra, "--max-model-len", "512", "--seed", "7"]
    assert vars(build_parser(argv).parse_args(argv)) == vars(build_parser().parse_args(argv))


def test_serve_does_not_import_the_benchmarks_or_the_clients() -> None:
    """A start pays for what serving needs: the benchmarks' modules (0.1 s) stay out of the launcher."""
    import subprocess
    import sys

    code = (
        "import sys; from frontend.cli.main import build_parser; "
        "build_parser(['serve', 'm']).parse_args(['serve', 'm']); "
        "print(sorted(m for m in sys.modules if m.startswith(('frontend.bench', 'frontend.cli.clients'))))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert run.stdout.strip() == "[]", run.stdout


@pytest.mark.parametrize(
    ("flags", "share"),
    [
        ("fpu avx2 avx512f avx512_bf16 avx512_vnni", ZEN4_DECODE_PREFILL_SHARE),  # Zen 4
        ("fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile", (SERVE_DECODE_PREFILL_TOKEN_BUDGET, 0)),  # Xeon
        ("fpu avx2 fma", (SERVE_DECODE_PREFILL_TOKEN_BUDGET, 0)),  # Zen 3
        (None, (SERVE_DECODE_PREFILL_TOKEN_BUDGET, 0)),  # no /proc/cpuinfo
    ],
)
def test_serve_prefill_share_by_cpu_kind(tmp_path, flags, share) -> None:  # type: ignore[no-untyped-def]
    """`engine serve`'s prefill share comes from the measured table by CPU kind (server_args.py)."""
    path = tmp_path / "cpuinfo"
    if flags is not None:
        path.write_text(f"processor\t: 0\nmodel name\t: a CPU\nflags\t\t: {flags}\n\nprocessor\t: 1\n")
    assert serve_prefill_share(str(path)) == share
