"""The tokenizer role over real gRPC: RemoteTokenizer gives what the in-process
Tokenizer gives (ids, text, chat template), and bad input names the parameter."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from transformers import AutoTokenizer

from services.model_source import resolve_model
from services.sampling_params import InvalidParameter
from services.transport.tokenizer_client import RemoteTokenizer
from services.transport.tokenizer_server import SERVICE_NAME, start_tokenizer_server
from tokenizer_svc.tokenizer import Tokenizer

TEXTS = ["Hello, my name is", "héllo wörld 👋🏽 你好 — `x = 1`\n", "<repo_name>x<|im_start|>user\nhé<|im_end|>"]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Say hi.", "name": "ann"},
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.load(resolve_model("smollm2"))


@contextmanager
def serving(tokenizer: Tokenizer) -> Iterator[RemoteTokenizer]:
    server = start_tokenizer_server(tokenizer, "127.0.0.1:0")
    client = RemoteTokenizer(server.address)
    try:
        yield client
    finally:
        client.close()
        server.stop(0)


@pytest.fixture(scope="module")
def remote(tokenizer: Tokenizer) -> Iterator[RemoteTokenizer]:
    with serving(tokenizer) as client:
        yield client


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_and_decode_equal_in_process(tokenizer, remote, text: str, add_special_tokens: bool) -> None:
    ids = remote.encode(text, add_special_tokens=add_special_tokens)
    assert ids == tokenizer.encode(text, add_special_tokens=add_special_tokens)
    for skip in (True, False):
        for spaces in (True, False):
            assert remote.decode(ids, skip, spaces) == tokenizer.decode(ids, skip, spaces)
    assert remote.decode(ids, skip_special_tokens=False) == text


def test_chat_template_equals_in_process(tokenizer, remote) -> None:
    for add_generation_prompt in (True, False):
        assert remote.apply_chat_template(MESSAGES, add_generation_prompt) == tokenizer.apply_chat_template(
            MESSAGES, add_generation_prompt
        )
        assert remote.render_chat(MESSAGES, add_generation_prompt) == tokenizer.render_chat(
            MESSAGES, add_generation_prompt
        )
    assert remote.render_chat(MESSAGES).endswith("<|im_start|>assistant\n")


def test_describe(tokenizer, remote) -> None:
    described = remote.describe()
    assert (described.name, described.vocab_size, described.eos_token_id, described.bos_token_id) == (
        tokenizer.name, 49152, 2, 1
    )
    assert described.has_chat_template


def test_health_reports_serving(remote) -> None:
    with grpc.insecure_channel(remote.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", SERVICE_NAME):
            status = health.Check(health_pb2.HealthCheckRequest(service=name)).status
            assert status == health_pb2.HealthCheckResponse.SERVING


def test_empty_chat_names_the_messages(tokenizer, remote) -> None:
    with pytest.raises(InvalidParameter) as caught:
        remote.apply_chat_template([])
    assert caught.value.param == "messages"
    assert remote.encode("still serving") == tokenizer.encode("still serving")


def test_chat_without_a_template_names_the_messages(tokenizer, tmp_path: Path) -> None:
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    bare = Tokenizer(AutoTokenizer.from_pretrained(tmp_path, local_files_only=True), "bare")
    with serving(bare) as client:
        assert not client.describe().has_chat_template
        with pytest.raises(InvalidParameter, match="'bare' has no chat template") as caught:
            client.apply_chat_template(MESSAGES)
        assert caught.value.param == "messages"
