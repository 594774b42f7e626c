"""No request field is accepted and ignored, checked at the HTTP edge without an engine: every OpenAI or
vLLM field we do not implement is a 400 naming it; bad roles, bodies that are not JSON or not UTF-8,
and stream_options without stream get OpenAI error bodies; x-api-key opens the API like a Bearer key."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from frontend.engine.async_llm import AsyncLLM
from frontend.engine.client import AsyncEngineClient
from frontend.openai.schemas import UNSUPPORTED_FIELDS
from frontend.openai.serving import OpenAIServing
from frontend.server.app import build_app
from frontend.server.deps import AppDeps, ServerConfig
from protocol.messages import ModelInfo

INFO = ModelInfo("m", ["m"], 128, 16, 100, [2], "float32", 8, "0")
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"prompt": [1, 2], "max_tokens": 4}


@pytest.fixture(scope="module")
def http():  # type: ignore[no-untyped-def]
    engine_client = AsyncEngineClient("ipc:///tmp/engine-fields-test-in", "ipc:///tmp/engine-fields-test-out")
    config = ServerConfig(model="m", input_address="", output_address="", api_keys=["k"])
    app = build_app(AppDeps(config, OpenAIServing(AsyncLLM(engine_client, None), INFO)))
    with TestClient(app) as client:
        client.headers["Authorization"] = "Bearer k"
        yield client
    engine_client.close()


def error_of(response) -> dict:  # type: ignore[no-untyped-def]
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    return error  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", sorted(UNSUPPORTED_FIELDS))
@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
def test_every_unimplemented_field_is_a_400_naming_it(http, path: str, body: dict, name: str) -> None:  # type: ignore[no-untyped-def]
    error = error_of(http.post(path, json={**body, name: {"x": 1}}))
    assert error["param"] == name and "not supported" in error["message"]


@pytest.mark.parametrize(
    "path, extra, param",
    [
        # tools without tool_choice mean "auto", which needs --enable-auto-tool-choice (vLLM's rule)
        ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
        (
            "/v1/chat/completions",
            {"tools": [{"type": "function", "function": {"name": "a b"}}]},
            "tools[0].function.name",
        ),
        (
            "/v1/chat/completions",
            {"tools": [{"type": "function", "function": {"name": "f"}}] * 2, "tool_choice": "none"},
            "tools[1].function.name",
        ),
        ("/v1/chat/completions", {"tools": [{"type": "retrieval"}], "tool_choice": "none"}, "tools[0]"),
        ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
        (
            "/v1/chat/completions",
            {"tool_choice": {"type": "function", "function": {"name": "f"}}},
            "tool_choice",
        ),
        ("/v1/chat/completions", {"function_call": "auto"}, "tool_choice"),
        ("/v1/chat/completions", {"functions": [{"name": "f"}], "tools": []}, "functions"),
        ("/v1/completions", {"response_format": {"type": "json_schema"}}, "response_format"),
        ("/v1/completions", {"response_format": {"type": "xml"}}, "response_format"),
        (
            "/v1/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"not": {}}}}},
            "response_format",
        ),
        ("/v1/completions", {"guided_regex": "a("}, "guided_regex"),
        ("/v1/completions", {"guided_json": "{not json"}, "guided_json"),
        ("/v1/completions", {"guided_grammar": "start: nothing_defined"}, "guided_grammar"),
        ("/v1/completions", {"structured_outputs": {"json": {"type": "strin"}}}, "structured_outputs"),
        ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ("/v1/completions", {"structured_outputs": {"choice": []}}, "structured_outputs"),
        (
            "/v1/completions",
            {"structured_outputs": {"regex": "a", "backend": "xgrammar"}},
            "structured_outputs",
        ),
        ("/v1/completions", {"structured_outputs": {"pattern": "a"}}, "structured_outputs"),
        (
            "/v1/completions",
            {"guided_regex": "a", "response_format": {"type": "json_object"}},
            "guided_regex",
        ),
        (
            "/v1/completions",
            {"guided_regex": "a", "guided_decoding_backend": "outlines"},
            "guided_decoding_backend",
        ),
        ("/v1/completions", {"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
        ("/v1/chat/completions", {"use_beam_search": True}, "use_beam_search"),
        ("/v1/completions", {"best_of": 3}, "best_of"),
        ("/v1/completions", {"suffix": "x"}, "suffix"),
        ("/v1/chat/completions", {"echo": True}, "echo"),
        ("/v1/chat/completions", {"store": True}, "store"),
        ("/v1/chat/completions", {"service_tier": "flex"}, "service_tier"),
        ("/v1/chat/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/completions", {"stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/completions", {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ("/v1/completions", {"cache_salt": ""}, "cache_salt"),
        ("/v1/completions", {"prompt_logprobs": 50}, "prompt_logprobs"),
        ("/v1/completions", {"allowed_token_ids": [1, 500]}, "allowed_token_ids"),
        ("/v1/completions", {"allowed_token_ids": []}, "allowed_token_ids"),
        ("/v1/completions", {"bad_words": ["x"]}, "bad_words"),  # this model has no tokenizer
        ("/v1/chat/completions", {"priority": 1}, "priority"),  # the engine runs fcfs: it would be ignored
    ],
)
def test_fields_implemented_in_part_are_400_outside_that_part(
    http, path: str, extra: dict, param: str
) -> None:  # type: ignore[no-untyped-def]
    body = CHAT if path.endswith("chat/completions") else COMPLETION
    assert error_of(http.post(path, json={**body, **extra}))["param"] == param


def test_tool_choice_none_and_text_response_format_are_fine(http) -> None:  # type: ignore[no-untyped-def]
    # Accepted, so they get as far as the context check (the prompt is made too long to reach the engine).
    long = {**COMPLETION, "max_tokens": 1000}
    tools = [{"type": "function", "function": {"name": "f"}}]
    chat = {**CHAT, "tools": tools, "tool_choice": "none", "parallel_tool_calls": False}
    # this model has no tokenizer: the chat request is refused at rendering, after the field checks
    error = error_of(http.post("/v1/chat/completions", json=chat))
    assert error["param"] == "messages" and "tokenizer" in error["message"]
    text = {**long, "response_format": {"type": "text"}}
    assert error_of(http.post("/v1/completions", json=text))["param"] == "prompt"
    unknown = {**long, "best_of": 1, "unknown_to_all": 1}
    assert error_of(http.post("/v1/completions", json=unknown))["param"] == "prompt"


@pytest.mark.parametrize("role", ["wizard", None, "ASSISTANT"])
def test_an_unknown_role_is_a_400_naming_messages(http, role) -> None:  # type: ignore[no-untyped-def]
    error = error_of(http.post("/v1/chat/completions", json={"messages": [{"role": role, "content": "hi"}]}))
    assert error["param"] == "messages" and "role" in error["message"]


@pytest.mark.parametrize("body", [b"\xff\xfe{not utf-8", b"{not json", b'{"prompt": [1, 2]'])
def test_a_body_that_is_not_json_or_not_utf8_gets_an_openai_error(http, body: bytes) -> None:  # type: ignore[no-untyped-def]
    response = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    assert "detail" not in response.json() and response.json()["error"]["message"]


def test_unknown_paths_and_methods_get_openai_errors(http) -> None:  # type: ignore[no-untyped-def]
    response = http.get("/v1/nowhere")
    assert response.status_code == 404 and response.json()["error"]["message"]
    response = http.get("/v1/completions")
    assert response.status_code == 405 and response.json()["error"]["message"]


def test_x_api_key_opens_the_api_like_a_bearer_key(http) -> None:  # type: ignore[no-untyped-def]
    bare = {"Authorization": ""}
    assert http.get("/v1/models", headers=bare).status_code == 401
    assert http.get("/v1/models", headers={**bare, "x-api-key": "k"}).status_code == 200
    assert http.get("/v1/models", headers={**bare, "x-api-key": "nope"}).status_code == 401
    assert http.get("/v1/models", headers={"Authorization": "bearer k"}).status_code == 200


class RecordingTokenizer:
    """A tokenizer's interface for the render step: records what the chat template was given; any
    text prompt fails, as a broken tokenizer would."""

    def __init__(self) -> None:
        self.template_kwargs: dict = {}

    def apply_chat_template(self, messages, **kwargs):  # type: ignore[no-untyped-def]
        self.template_kwargs = kwargs
        return "rendered"

    def __call__(self, text: str, add_special_tokens: bool = True):  # type: ignore[no-untyped-def]
        if text != "rendered":
            raise RuntimeError("tokenizer exploded")
        return {"input_ids": [1] * (200 if add_special_tokens else 100)}

    def decode(self, ids):  # type: ignore[no-untyped-def]
        return "x"


@pytest.fixture(scope="module")
def recorded():  # type: ignore[no-untyped-def]
    engine_client = AsyncEngineClient("ipc:///tmp/engine-fields-rec-in", "ipc:///tmp/engine-fields-rec-out")
    tokenizer = RecordingTokenizer()
    config = ServerConfig(model="m", input_address="", output_address="")
    app = build_app(AppDeps(config, OpenAIServing(AsyncLLM(engine_client, tokenizer), INFO)))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, tokenizer
    engine_client.close()


def test_tools_reach_the_template_with_tool_choice_none_and_add_special_tokens_counts(recorded) -> None:  # type: ignore[no-untyped-def]
    http, tokenizer = recorded
    tools = [{"type": "function", "function": {"name": "f"}}]
    # 100 prompt tokens without special tokens (the chat default), 200 with: over the 128-token context
    body = {**CHAT, "tools": tools, "tool_choice": "none", "max_tokens": 40}
    message = error_of(http.post("/v1/chat/completions", json=body))["message"]
    assert tokenizer.template_kwargs["tools"] == tools and "(100 in the messages" in message
    message = error_of(http.post("/v1/chat/completions", json={**body, "add_special_tokens": True}))[
        "message"
    ]
    assert "(200 in the messages" in message


def test_an_unexpected_failure_is_a_500_in_the_openai_shape(recorded) -> None:  # type: ignore[no-untyped-def]
    http, _ = recorded
    response = http.post("/v1/completions", json={"prompt": "boom", "max_tokens": 2})
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "internal_error" and "tokenizer exploded" in error["message"]


def test_tokenize_checks_messages_like_chat(http) -> None:  # type: ignore[no-untyped-def]
    for messages in ([{}], [{"role": "wizard", "content": "x"}]):
        error = error_of(http.post("/tokenize", json={"messages": messages}))
        assert error["param"] == "messages" and "role" in error["message"]
    assert error_of(http.post("/tokenize", json={"prompt": "x", "tools": []}))["param"] == "tools"


NO_CONTENT = [
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "system", "content": None}, {"role": "user", "content": "hi"}], "messages[0].content"),
    ([{"role": "user", "content": "hi"}, {"role": "developer"}], "messages[1].content"),
    ([{"role": "assistant", "content": None}, {"role": "user", "content": "x"}], "messages[0].content"),
    ([{"role": "tool", "tool_call_id": "c"}], "messages[0].content"),
]


@pytest.mark.parametrize(("messages", "param"), NO_CONTENT)
def test_a_turn_without_content_is_a_400_naming_it_on_chat_and_tokenize(recorded, messages, param) -> None:  # type: ignore[no-untyped-def]
    http, _ = recorded
    for path, extra in (("/v1/chat/completions", {"max_tokens": 4}), ("/tokenize", {})):
        error = error_of(http.post(path, json={"messages": messages, **extra}))
        assert error["param"] == param and error["code"] == "missing_required_parameter", (path, error)
    batch = {"messages": [[{"role": "user", "content": "ok"}], messages], "max_tokens": 4}
    error = error_of(http.post("/v1/chat/completions/batch", json=batch))
    assert error["param"] == param.replace("messages", "messages[1]", 1), error


def test_only_an_assistant_turn_with_tool_calls_or_being_continued_may_omit_content(recorded) -> None:  # type: ignore[no-untyped-def]
    http, tokenizer = recorded
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c", "content": "42"},
        {"role": "assistant"},
    ]
    # past the renderer: the 100-token prompt over this model's context is the render's next check
    body = {"messages": messages, "continue_final_message": True, "add_generation_prompt": False}
    assert (
        "(100 in the messages"
        in error_of(http.post("/v1/chat/completions", json={**body, "max_tokens": 40}))["message"]
    )
    error = error_of(http.post("/v1/chat/completions", json={**body, "continue_final_message": False}))
    assert error["param"] == "messages[3].content"


def test_the_other_doors_name_a_missing_content_in_their_own_terms(recorded) -> None:  # type: ignore[no-untyped-def]
    http, _ = recorded
    anthropic = {"model": "m", "messages": [{"role": "user"}]}
    response = http.post("/v1/messages", json={**anthropic, "max_tokens": 4})
    assert response.status_code == 400 and "messages[0].content" in response.json()["error"]["message"]
    response = http.post("/v1/messages/count_tokens", json=anthropic)
    assert response.status_code == 400 and "messages[0].content" in response.json()["error"]["message"]
    for item in ({"type": "message", "role": "user"}, {"type": "function_call_output", "call_id": "c"}):
        error = error_of(http.post("/v1/responses", json={"input": [item]}))
        assert "input[0]" in error["message"], error
