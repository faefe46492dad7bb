"""Unknown request fields: ignored, as vLLM's server ignores them, and logged once per
request at warning level in vLLM's words, so a misspelt field does not pass unnoticed."""
from __future__ import annotations

import ast
import logging
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from gateway.app import build_app
from gateway.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

MESSAGE = "The following fields were present in the request but ignored: "
CHAT = [{"role": "user", "content": "Say hello."}]


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records
            if record.name == "gateway.request_body" and record.levelno == logging.WARNING]


def test_a_request_without_unknown_fields_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        ChatCompletionRequest.model_validate({
            "model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}},
            "structured_outputs": {"json": {"type": "object"}}, "top_k": 3,
        })
        CompletionRequest.model_validate({"prompt": [1, 2, 3], "max_tokens": 2})
        CompletionRequest(prompt="built in code", max_tokens=1)
    assert warnings_of(caplog) == []


def test_each_request_logs_its_ignored_fields_once_nested_ones_by_path(caplog: pytest.LogCaptureFixture) -> None:
    body = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "colour": "red"}], "mood": 1}],
        "temprature": 0.5,  # misspelt: ignored, so the default temperature applies
        "structured_outputs": {"jsn": {}},
        "response_format": {"type": "json_schema", "json_schema": {"json_schema": {}}},
    }
    with caplog.at_level(logging.WARNING):
        request = ChatCompletionRequest.model_validate(body)
    assert request.temperature is None
    [line] = warnings_of(caplog)
    assert line.startswith(MESSAGE) and ast.literal_eval(line.removeprefix(MESSAGE)) == {
        "messages[0].content[0].colour", "messages[0].mood", "temprature", "structured_outputs.jsn",
        "response_format.json_schema.json_schema"}


def test_fields_kept_as_they_come_are_not_ignored(caplog: pytest.LogCaptureFixture) -> None:
    # vLLM's structural-tag response_format: its fields travel as they are.
    with caplog.at_level(logging.WARNING):
        request = ChatCompletionRequest.model_validate(
            {"messages": CHAT, "response_format": {"type": "structural_tag", "structures": [], "triggers": []}})
    assert request.response_format.model_extra == {"structures": [], "triggers": []}
    assert warnings_of(caplog) == []


@pytest.mark.parametrize(("model", "body", "ignored"), [
    (CompletionRequest, {"prompt": "x", "unknown": 1}, "{'unknown'}"),
    (TokenizeRequest, {"prompt": "x", "add_bos": True}, "{'add_bos'}"),
    (DetokenizeRequest, {"tokens": [1], "skip": 1}, "{'skip'}"),
])
def test_every_endpoint_body_logs_them(model, body, ignored, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        model.model_validate(body)
    assert warnings_of(caplog) == [MESSAGE + ignored]


def test_a_flood_of_unknown_fields_makes_one_bounded_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        CompletionRequest.model_validate({"prompt": "x", **{f"k{i}": i for i in range(1000)}})
    [line] = warnings_of(caplog)
    assert line.endswith("'k19'} and 980 more") and len(line) < 400


def test_the_server_logs_them_once_per_request(caplog: pytest.LogCaptureFixture) -> None:
    """Through the app: FastAPI's body validation logs, once per request, before the
    handler runs (here an engine that is not ready answers 503)."""
    engine = SimpleNamespace(is_ready=lambda: False, engine_info=lambda: None)
    app = build_app(engine, SimpleNamespace(is_ready=lambda: False), "m")
    with TestClient(app) as client, caplog.at_level(logging.WARNING):
        for _ in range(2):
            response = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4, "foo": 1})
            assert response.status_code == 503
        assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 503
    assert warnings_of(caplog) == [MESSAGE + "{'foo'}"] * 2
