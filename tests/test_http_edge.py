"""The HTTP edge of an API server, without an engine: API key, CORS, request ids, health after
the engine is marked dead, validation errors in the OpenAI envelope."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from frontend.api_server import AppDeps, ServerConfig, build_app
from frontend.async_client import AsyncEngineClient
from frontend.serving import OpenAIServing
from protocol.messages import ModelInfo

INFO = ModelInfo("m", ["m"], 128, 16, 100, [2], "float32", 8, "0")


@pytest.fixture
def app_and_client():  # type: ignore[no-untyped-def]
    engine_client = AsyncEngineClient("ipc:///tmp/engine-edge-test-in", "ipc:///tmp/engine-edge-test-out")
    config = ServerConfig(
        model="m", input_address="", output_address="", api_key="k", allowed_origins=["https://ok.example"]
    )
    serving = OpenAIServing(engine_client, None, INFO, None)
    app = build_app(AppDeps(config, engine_client, serving))
    with TestClient(app) as http:
        yield http, engine_client
    engine_client.close()


def test_api_key_guards_v1_but_not_health(app_and_client) -> None:  # type: ignore[no-untyped-def]
    http, _ = app_and_client
    assert http.get("/v1/models").status_code == 401
    assert http.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert http.post("/tokenize", json={"prompt": "x"}).status_code == 401
    assert http.get("/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200
    assert http.get("/health").status_code == 200 and http.get("/version").json()["version"]


def test_cors_follows_allowed_origins(app_and_client) -> None:  # type: ignore[no-untyped-def]
    http, _ = app_and_client
    preflight = {"Origin": "https://ok.example", "Access-Control-Request-Method": "POST"}
    ok = http.options("/v1/chat/completions", headers=preflight)
    assert ok.headers.get("access-control-allow-origin") == "https://ok.example"
    other = http.options("/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"})
    assert other.headers.get("access-control-allow-origin") is None


def test_validation_errors_are_400_with_param(app_and_client) -> None:  # type: ignore[no-untyped-def]
    http, _ = app_and_client
    response = http.post(
        "/v1/completions",
        json={"prompt": [1, 2], "max_tokens": "many"},
        headers={"Authorization": "Bearer k"},
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_tokens"
    assert response.headers["x-request-id"]


def test_health_is_503_once_the_engine_is_dead(app_and_client) -> None:  # type: ignore[no-untyped-def]
    http, engine_client = app_and_client
    engine_client.mark_dead("test")
    response = http.get("/health")
    assert response.status_code == 503 and response.json()["error"]["code"] == "engine_dead"
