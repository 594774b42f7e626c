"""A bad flag of `engine serve` or `engine run-batch` is one line at the CLI, `engine CMD: error: FLAG: ...`
(argparse's form), exit status 2, no traceback, and nothing started: the checks run before the first
child process, so each case returns in about a second, before any model loads.

Whether a process was left behind is read from the environment: every process the command starts
inherits a marker variable that is unique to the case."""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import uuid
from collections.abc import Iterator

import psutil
import pytest

from tests.serve_helpers import free_port, wait_until

MARKER = "CLI_ERRORS_TEST_MARKER"
TIMEOUT_S = 60  # a case takes about a second; a minute only if the machine is very busy


def marked(marker: str) -> list[psutil.Process]:
    """The live processes whose environment holds `marker`."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get(MARKER) == marker and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


def run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    """`python -m frontend.cli ARGV`; asserts that no process it started outlived it."""
    marker = uuid.uuid4().hex
    env = {**os.environ, MARKER: marker, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "frontend.cli", *argv],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=env,
    )
    left = marked(marker)
    for process in left:
        process.kill()
    assert not left, f"processes outlived `engine {argv[0]}`: {[p.cmdline() for p in left]}"
    return result


def assert_one_line_error(result: subprocess.CompletedProcess[str], command: str, flag: str) -> None:
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    last = [line for line in result.stderr.splitlines() if line.strip()][-1]
    assert last.startswith(f"engine {command}: error: "), last
    assert flag in last, last
    assert "engine.core" not in result.stderr and "engine.worker" not in result.stderr  # no engine ran


@pytest.fixture(scope="module")
def plugins(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    folder = tmp_path_factory.mktemp("plugins")
    (folder / "raises.py").write_text('raise RuntimeError("the plugin is broken")\n')
    (folder / "lacks.py").write_text("PARSERS = {}\n")
    (folder / "syntax.py").write_text("def broken(:\n")
    return folder


SERVE_CASES = [
    (["--tool-call-parser", "nope"], "--tool-call-parser", "unknown tool call parser 'nope'"),
    (["--reasoning-parser", "nope"], "--reasoning-parser", "unknown reasoning parser 'nope'"),
    (["--tool-parser-plugin", "/nonexistent.py"], "--tool-parser-plugin", "no such file"),
    (["--tool-parser-plugin", "{plugins}/raises.py"], "--tool-parser-plugin", "RuntimeError: the plugin is"),
    (["--tool-parser-plugin", "{plugins}/lacks.py"], "--tool-parser-plugin", "must define TOOL_PARSERS"),
    (["--tool-parser-plugin", "{plugins}/syntax.py"], "--tool-parser-plugin", "SyntaxError"),
    (["--block-size", "7"], "--block-size", "invalid choice"),  # argparse's own
    (["--dtype", "nonsense"], "--dtype", "invalid choice"),
    (["--max-num-seqs", "0"], "--max-num-seqs", "must be positive"),
    (["--structured-outputs-config", '{"backend": "nope"}'], "--structured-outputs-config", "unknown"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice", "needs --tool-call-parser"),
    (["--headless"], "--headless", "needs --engine-address"),
    (["--engine-address", "tcp://0.0.0.0:5999"], "--engine-address", "--allow-remote-engine"),
    (["--api-key-file", "/nonexistent/keys"], "--api-key-file", "cannot read"),
    (["--chat-template", "{plugins}"], "--chat-template", "cannot read"),  # a folder
    (["--batch-invariant", "--attention-backend", "torch"], "--batch-invariant", "needs the csrc kernels"),
    (["--tool-server", "localhost"], "--tool-server", "host:port or an http(s) URL"),
    (["--mcp-timeout", "0"], "--mcp-timeout", "must be more than 0"),
    (["--engine-heartbeat-timeout", "1"], "--engine-heartbeat-timeout", "must be 2 or more"),
    (
        ["--weight-transfer-config", '{"backend": "ucx"}'],
        "--weight-transfer-config",
        "backend takes gloo, nccl",
    ),
    (["--grpc", "--uds", "/tmp/engine-grpc.sock"], "--uds", "is for the HTTP server"),
    (["--mcp-allowed-urls", "ftp://files"], "--mcp-allowed-urls", "takes http(s) URLs"),
]


@pytest.mark.parametrize(("argv", "flag", "words"), SERVE_CASES, ids=[" ".join(c[0]) for c in SERVE_CASES])
def test_a_bad_serve_flag_is_one_line_and_starts_nothing(
    smollm2_gguf: str, plugins: pathlib.Path, argv: list[str], flag: str, words: str
) -> None:
    argv = [a.replace("{plugins}", str(plugins)) for a in argv]
    result = run_cli("serve", smollm2_gguf, "--port", str(free_port()), *argv)
    assert_one_line_error(result, "serve", flag)
    assert words in result.stderr.splitlines()[-1]


BATCH_CASES = [
    (["--tool-call-parser", "nope"], "--tool-call-parser"),
    (["--reasoning-parser", "nope"], "--reasoning-parser"),
    (["--tool-parser-plugin", "{plugins}/raises.py"], "--tool-parser-plugin"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--max-concurrency", "0"], "--max-concurrency"),
]


@pytest.mark.parametrize(("argv", "flag"), BATCH_CASES, ids=[" ".join(c[0]) for c in BATCH_CASES])
def test_a_bad_run_batch_flag_is_one_line_and_starts_nothing(
    smollm2_gguf: str, plugins: pathlib.Path, tmp_path: pathlib.Path, argv: list[str], flag: str
) -> None:
    requests = tmp_path / "in.jsonl"
    requests.write_text("{}\n")
    argv = [a.replace("{plugins}", str(plugins)) for a in argv]
    result = run_cli("run-batch", smollm2_gguf, "-i", str(requests), "-o", str(tmp_path / "out.jsonl"), *argv)
    assert_one_line_error(result, "run-batch", flag)
    assert not (tmp_path / "out.jsonl").exists()


def test_the_marker_finds_a_process_left_behind() -> None:
    """The check above can fail: a process started with the marker is found until it is gone."""
    marker = uuid.uuid4().hex
    child = psutil.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], env={**os.environ, MARKER: marker}
    )
    try:  # its environment is readable once the exec is done
        found = wait_until(lambda: [p.pid for p in marked(marker)], 10, "the marked process")
        assert found == [child.pid]
    finally:
        child.kill()
        child.wait(10)
    assert not marked(marker)


def test_a_missing_model_is_one_line_for_generate_and_bench(tmp_path: pathlib.Path) -> None:
    missing = str(tmp_path / "no-such-model")
    result = run_cli("generate", missing, "--prompt", "hi")
    assert_one_line_error(result, "generate", missing)
    result = run_cli("bench", "latency", missing)
    assert_one_line_error(result, "bench", missing)


def test_a_flag_value_s_error_says_what_is_wrong_with_it() -> None:
    result = run_cli("serve", "--allowed-origins", '["https://a.example"', "--port", str(free_port()))
    assert_one_line_error(result, "serve", "--allowed-origins")
    assert "not a JSON list" in result.stderr and "char" in result.stderr.splitlines()[-1], result.stderr


def test_a_prefix_of_a_flag_is_not_that_flag() -> None:
    """`engine serve --headles` used to start a headless engine (argparse completes abbreviations)."""
    result = run_cli("serve", "--headles", "--port", str(free_port()))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.splitlines()[-1] == "engine: error: unrecognized arguments: --headles", result.stderr


def subcommands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every (sub)command's parser, with the words that reach it (`bench serve`, ...)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name), sub
                yield from subcommands(sub, (*path, name))


def test_no_subcommand_completes_an_abbreviated_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from frontend.cli.main import build_parser

    parser = build_parser()
    checked = 0
    for words, sub in subcommands(parser):
        if any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):
            continue  # a group (`bench`): its commands are checked
        flags = {o for a in sub._actions for o in a.option_strings}
        required = [a for a in sub._actions if a.required and a.option_strings]
        given = [w for a in required for w in (a.option_strings[0], "1")]
        for flag in sorted(f for f in flags if f.startswith("--") and len(f) > 4):
            prefix = flag[:-1]
            if prefix in flags:
                continue
            with pytest.raises(SystemExit) as exit_:
                parser.parse_args([*words, *given, prefix])
            assert exit_.value.code == 2
            assert f"unrecognized arguments: {prefix}" in capsys.readouterr().err, (words, prefix)
            checked += 1
    assert checked > 300  # serve's flags alone are more than that


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"architectures": ["MambaForCausalLM"]}, "unsupported architecture ['MambaForCausalLM']"),
        (
            {"architectures": ["Gemma3ForCausalLM"], "use_bidirectional_attention": True},
            "use_bidirectional_attention",
        ),
    ],
)
def test_a_model_we_do_not_run_is_one_line_and_exit_status_2(
    tmp_path: pathlib.Path, config: dict, named: str
) -> None:
    """The worker refuses it at load; the launcher says why as its last line and stops everything."""
    import json

    shape = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps({**shape, **config}))
    result = run_cli("serve", str(tmp_path), "--port", str(free_port()))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    last = [line for line in result.stderr.splitlines() if line.strip()][-1]
    assert last.startswith("engine serve: error: ") and named in last, last
    if "supported: " in last:  # each architecture once
        names = last.split("supported: ", 1)[1].split(", ")
        assert len(names) == len(set(names)) > 30, names
    result = run_cli("generate", str(tmp_path), "--prompt", "hi")
    last = [line for line in result.stderr.splitlines() if line.strip()][-1]
    assert result.returncode == 2 and last.startswith("engine generate: error: ") and named in last, last
