"""The small pieces of issue 26 without a server: system_fingerprint, the ORCA load header, hub ids
resolved from a hand-made cache, TLS certificate reloads, --middleware imports, the new flags' checks,
collect-env. The served behaviour of each: tests/test_serve_small_endpoints.py."""

from __future__ import annotations

import json
import os
import pathlib
import ssl
import subprocess
import sys

import msgspec
import pytest

from frontend.collect_env import cpu_info, render, shown_variable
from frontend.config.server_args import ServerArgs
from frontend.model_files import ModelNotFoundError, looks_like_hub_id, resolve_model
from frontend.openai.fingerprint import system_fingerprint
from frontend.server.middleware import route_path
from frontend.server.orca import named_metrics, orca_header
from frontend.server.tls import CertRefresher, check_tls_files, server_context
from frontend.server.user_middleware import import_middleware
from protocol.messages import ModelInfo, SchedulerStats
from tests.small_helpers import common_name_of, hub_cache, make_certificate

INFO = ModelInfo("/models/tiny", ["tiny"], 256, 16, 512, [2], "float32", 16, "0.1.0")
SETTINGS = {"chat_template": None, "reasoning_parser": None}


def test_fingerprint_modes_and_what_changes_the_hash() -> None:
    full = system_fingerprint("full", INFO, SETTINGS)
    hashed = system_fingerprint("hash", INFO, SETTINGS)
    assert full is not None and hashed is not None
    assert full.startswith("engine-0.1.0-float32-") and len(full.rsplit("-", 1)[1]) == 8
    assert hashed == "engine-0.1.0-" + full.rsplit("-", 1)[1]  # the same hash, without the readable part
    # stable: the same inputs in another order, or decoded from the wire, give the same value
    again = msgspec.msgpack.decode(msgspec.msgpack.encode(INFO), type=ModelInfo)
    assert system_fingerprint("full", again, dict(reversed(SETTINGS.items()))) == full
    other_model = msgspec.structs.replace(INFO, max_model_len=512)
    assert system_fingerprint("full", other_model, SETTINGS) != full
    assert system_fingerprint("full", INFO, {**SETTINGS, "reasoning_parser": "qwen3"}) != full
    assert system_fingerprint("none", INFO, SETTINGS) is None
    assert system_fingerprint("custom", INFO, SETTINGS, "fp_ours") == "fp_ours"
    with pytest.raises(ValueError, match="fingerprint mode"):
        system_fingerprint("partial", INFO, SETTINGS)


def test_orca_header_in_vllms_text_and_json_forms() -> None:
    metrics = named_metrics(SchedulerStats(num_waiting=3, kv_cache_usage=0.25))
    assert orca_header("text", metrics) == (
        "TEXT named_metrics.kv_cache_usage_perc=0.25, named_metrics.num_requests_waiting=3.0"
    )
    value = orca_header("JSON", metrics)
    assert value is not None and value.startswith("JSON ")
    assert json.loads(value.removeprefix("JSON ")) == {
        "named_metrics": {"kv_cache_usage_perc": 0.25, "num_requests_waiting": 3.0}
    }
    assert orca_header("bin", metrics) is None  # ORCA's binary form: no header, as in vLLM
    assert named_metrics(None) == [("kv_cache_usage_perc", 0.0), ("num_requests_waiting", 0.0)]


def test_route_path_with_and_without_the_proxy_prefix() -> None:
    assert route_path({"path": "/api/v1/models", "root_path": "/api"}) == "/v1/models"
    assert route_path({"path": "/v1/models", "root_path": "/api"}) == "/v1/models"  # the proxy stripped it
    assert route_path({"path": "/apiv1", "root_path": "/api"}) == "/apiv1"
    assert route_path({"path": "/health"}) == "/health"


def test_hub_ids_resolve_from_the_cache_offline(tmp_path: pathlib.Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import huggingface_hub.constants

    source = tmp_path / "source"
    source.mkdir()
    (source / "config.json").write_text("{}")
    snapshot = hub_cache(tmp_path / "hub", "org/tiny-model", str(source))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert resolve_model("org/tiny-model", download_dir=str(tmp_path / "hub")) == str(snapshot)
    assert resolve_model("org/tiny-model", "a" * 40, str(tmp_path / "hub")) == str(snapshot)
    with pytest.raises(ModelNotFoundError, match="not in the Hugging Face cache.*HF_HUB_OFFLINE"):
        resolve_model("org/absent", download_dir=str(tmp_path / "hub"))
    with pytest.raises(ModelNotFoundError, match="not found"):
        resolve_model(str(tmp_path / "no" / "such" / "folder"))
    assert looks_like_hub_id("Qwen/Qwen3-0.6B") and not looks_like_hub_id("a/b/c")
    assert not looks_like_hub_id("../etc") and not looks_like_hub_id("org/..")


def test_an_uncached_hub_id_offline_is_one_line_at_the_cli(tmp_path: pathlib.Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "frontend.cli", "serve", "org/absent", "--download-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("engine serve: error: org/absent is not in the")


def test_certificates_reload_in_place_and_a_broken_pair_keeps_the_old(tmp_path: pathlib.Path) -> None:
    key, cert = str(tmp_path / "key.pem"), str(tmp_path / "cert.pem")
    make_certificate(key, cert, "first")
    context = server_context(key, cert, None, ssl.CERT_NONE)
    refresher = CertRefresher(context, key, cert)
    assert not refresher.check()  # nothing changed
    make_certificate(key, cert, "second")
    assert refresher.check() and refresher.num_reloads == 1
    other_key = str(tmp_path / "other-key.pem")
    make_certificate(other_key, str(tmp_path / "other-cert.pem"), "third")
    os.replace(other_key, key)  # a key that does not match the certificate: not loaded
    assert not refresher.check()
    with pytest.raises(SystemExit, match="cannot serve HTTPS"):
        check_tls_files(key, cert, None, ssl.CERT_NONE)
    with pytest.raises(SystemExit, match="cannot serve HTTPS"):
        check_tls_files(str(tmp_path / "missing.pem"), cert, None, ssl.CERT_NONE)
    assert common_name_of(open(cert).read()) == "second"


def test_middleware_import_paths() -> None:
    assert import_middleware("tests.small_helpers.TaggingMiddleware").__name__ == "TaggingMiddleware"
    assert import_middleware("tests.small_helpers:function_middleware").__name__ == "function_middleware"
    for path, message in (
        ("tests.small_helpers.Nothing", "cannot import"),
        ("no_such_module.Thing", "cannot import"),
        ("tests.small_helpers.MIDDLEWARE_HEADER", "expected an ASGI middleware class"),
        ("TaggingMiddleware", "give module.name"),
    ):
        with pytest.raises(SystemExit, match=message):
            import_middleware(path)


def test_server_option_checks() -> None:
    for kwargs, message in (
        ({"fingerprint_mode": "partial"}, "--fingerprint-mode: takes"),
        ({"fingerprint_mode": "custom"}, "needs --fingerprint-value"),
        ({"ssl_certfile": "cert.pem"}, "both --ssl-keyfile and --ssl-certfile"),
        ({"ssl_keyfile": "k", "ssl_certfile": "c", "ssl_cert_reqs": 3}, "--ssl-cert-reqs"),
        ({"root_path": "api"}, "must start with '/'"),
        ({"max_log_len": -1}, "--max-log-len"),
    ):
        with pytest.raises(ValueError, match=message):
            ServerArgs(**kwargs)  # type: ignore[arg-type]
    assert ServerArgs.dev_mode({"VLLM_SERVER_DEV_MODE": "1"}) and ServerArgs.dev_mode(
        {"ENGINE_SERVER_DEV_MODE": "1"}
    )
    assert not ServerArgs.dev_mode({"ENGINE_SERVER_DEV_MODE": "0"})


def test_collect_env_reads_the_cpu_and_hides_secrets(tmp_path: pathlib.Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("model name\t: Test CPU\nflags\t\t: fpu sse4_2 avx2 avx512f amx_tile ht\n")
    info = cpu_info(str(cpuinfo))
    assert info["model"] == "Test CPU" and info["isa"] == ["amx_tile", "avx2", "avx512f", "sse4_2"]
    assert shown_variable("HF_HUB_OFFLINE") and not shown_variable("HF_TOKEN")
    assert not shown_variable("VLLM_API_KEY") and not shown_variable("HOME")
    report = {
        "engine": "0.1.0",
        "python": "3.11.7",
        "python_executable": "python",
        "os": "Linux",
        "cpu": info,
        "torch": {"error": "No module named 'torch'"},
        "packages": {"torch": None, "fastapi": "0.1"},
        "environment": {},
    }
    text = render(report)
    assert "cpu isa: amx_tile avx2 avx512f sse4_2" in text and "torch: not importable" in text
    assert "  torch: -" in text and "  fastapi: 0.1" in text
