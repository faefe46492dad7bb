"""The tokenizer role over real gRPC, driven by the gateway's client (RemoteTokenizer):
it gives what the in-process Tokenizer gives (ids, rendered chats, and the files the
gateway detokenizes with), requests that arrive together travel as one batch, and
bad input names the parameter without failing the rest of its batch."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from transformers import PreTrainedTokenizerFast

from gateway.cluster.tokenizer_client import RemoteTokenizer
from kvfleet.processes import free_port
from services.engine_client import EngineUnavailable
from services.invalid_parameter import InvalidParameter
from services.messages import Empty
from services.model_source import resolve_model
from services.packed_token_ids import unpack_token_ids
from services.tokenizer_api import ChatPrompt
from services.tokenizer_messages import DetokenizeRequest, TokenizeRequest
from services.transport.role_services import TOKENIZER
from tokenizer_svc.encode_process import HUGE_TEXT_CHARS
from tokenizer_svc.server import SERVICE_NAME, TokenizerServicer, start_tokenizer_server
from tokenizer_svc.tokenizer import Tokenizer

TEXTS = ["Hello, my name is", "héllo wörld 👋🏽 你好 — `x = 1`\n", "<repo_name>x<|im_start|>user\nhé<|im_end|>"]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Say hi.", "name": "ann"},
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.load(resolve_model("smollm2"))


def wait_ready(client: RemoteTokenizer, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not client.is_ready():
        assert time.monotonic() < deadline, "the client never fetched the tokenizer"
        time.sleep(0.05)


@contextmanager
def serving(tokenizer: Tokenizer, *more_addresses: str) -> Iterator[tuple[RemoteTokenizer, str]]:
    server = start_tokenizer_server(tokenizer, "127.0.0.1:0")
    client = RemoteTokenizer(lambda: [*more_addresses, server.address], refresh_interval_s=0.1)
    client.start()
    try:
        wait_ready(client)
        yield client, server.address
    finally:
        client.close()
        server.stop(0)


@pytest.fixture(scope="module")
def remote(tokenizer: Tokenizer) -> Iterator[tuple[RemoteTokenizer, str]]:
    with serving(tokenizer) as served:
        yield served


def test_encode_equals_in_process_and_the_fetched_files_decode_alike(tokenizer, remote) -> None:
    client, _ = remote
    for add_special_tokens in (True, False):
        ids = asyncio.run(client.encode(TEXTS, add_special_tokens))
        assert ids == [tokenizer.encode(text, add_special_tokens=add_special_tokens) for text in TEXTS]
    decoder = client.decoder  # built from GetTokenizer's archive, not from the model's files
    assert (decoder.vocab_size, decoder.eos_token_id, decoder.bos_token_id) == (49152, 2, 1)
    for text, token_ids in zip(TEXTS, ids):
        for skip in (True, False):
            for spaces in (True, False):
                assert decoder.decode(token_ids, skip, spaces) == tokenizer.decode(token_ids, skip, spaces)
        assert decoder.decode(token_ids, skip_special_tokens=False) == text


def test_a_huge_text_crosses_whole(tokenizer, remote) -> None:
    """Past HUGE_TEXT_CHARS the role encodes in its child process, and the gateway turns
    the packed reply into a list in slices: the ids still equal the in-process ones."""
    client, _ = remote
    text = "".join(TEXTS) * (HUGE_TEXT_CHARS // len("".join(TEXTS)) + 1)
    [ids] = asyncio.run(client.encode([text]))
    assert len(ids) > 20_000 and ids == tokenizer.encode(text)


def test_chat_equals_in_process(tokenizer, remote) -> None:
    client, _ = remote
    for add_generation_prompt in (True, False):
        encoded = asyncio.run(client.encode_chat(ChatPrompt(MESSAGES, add_generation_prompt)))
        assert encoded.text == tokenizer.render_chat(MESSAGES, add_generation_prompt)
        assert encoded.token_ids == tokenizer.apply_chat_template(MESSAGES, add_generation_prompt)


def test_requests_that_arrive_together_travel_as_one_batch(tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    sizes: list[int] = []
    original = TokenizerServicer.TokenizeBatch

    def counting(self, request, context):
        sizes.append(len(request.requests))
        return original(self, request, context)

    monkeypatch.setattr(TokenizerServicer, "TokenizeBatch", counting)  # before the server registers it

    async def together(client: RemoteTokenizer) -> list:
        return await asyncio.gather(
            *(client.encode([text]) for text in TEXTS), client.encode_chat(ChatPrompt(MESSAGES))
        )

    with serving(tokenizer) as (client, _):
        *texts, chat = asyncio.run(together(client))
    assert sizes == [len(TEXTS) + 1]
    assert texts == [[tokenizer.encode(text)] for text in TEXTS]
    assert chat.token_ids == tokenizer.apply_chat_template(MESSAGES)


def test_bad_input_names_the_messages_and_spares_its_batch(tokenizer, remote) -> None:
    client, _ = remote

    async def mixed() -> list:
        return await asyncio.gather(
            client.encode_chat(ChatPrompt([])), client.encode(["still served"]), return_exceptions=True
        )

    error, served = asyncio.run(mixed())
    assert isinstance(error, InvalidParameter) and error.param == "messages"
    assert served == [tokenizer.encode("still served")]


def test_chat_without_a_template_names_the_messages(tokenizer, tmp_path: Path) -> None:
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    bare = Tokenizer(PreTrainedTokenizerFast.from_pretrained(tmp_path, local_files_only=True), "bare")
    with serving(bare) as (client, address):
        with grpc.insecure_channel(address) as channel:
            described = TOKENIZER.stub(channel).Describe(Empty())
        assert not described.has_chat_template
        with pytest.raises(InvalidParameter, match="'bare' has no chat template") as caught:
            asyncio.run(client.encode_chat(ChatPrompt(MESSAGES)))
        assert caught.value.param == "messages"


def test_describe_detokenize_and_health_over_the_stubs(tokenizer, remote) -> None:
    _, address = remote
    ids = tokenizer.encode(TEXTS[1])
    with grpc.insecure_channel(address) as channel:
        stub = TOKENIZER.stub(channel)
        described = stub.Describe(Empty())
        assert (described.name, described.vocab_size, described.eos_token_id, described.bos_token_id) == (
            tokenizer.name, 49152, 2, 1
        )
        assert stub.Detokenize(DetokenizeRequest(ids)).text == tokenizer.decode(ids)
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", SERVICE_NAME):
            status = health.Check(health_pb2.HealthCheckRequest(service=name)).status
            assert status == health_pb2.HealthCheckResponse.SERVING


def test_packed_ids_equal_the_repeated_ones_and_only_chats_are_echoed(tokenizer, remote) -> None:
    _, address = remote
    with grpc.insecure_channel(address) as channel:
        stub = TOKENIZER.stub(channel)
        for text in TEXTS:
            plain = stub.Tokenize(TokenizeRequest(text))
            packed = stub.Tokenize(TokenizeRequest(text, packed_token_ids=True))
            assert list(plain.token_ids) == unpack_token_ids(packed.token_ids_packed).tolist() == tokenizer.encode(text)
            assert (plain.token_ids_packed, list(packed.token_ids), plain.prompt, packed.prompt) == (b"", [], "", "")
        chat = ChatPrompt(MESSAGES)
        reply = stub.Tokenize(TokenizeRequest(chat=chat, packed_token_ids=True))
        assert reply.prompt == tokenizer.render_chat(MESSAGES, add_generation_prompt=True)
        assert unpack_token_ids(reply.token_ids_packed).tolist() == tokenizer.encode(reply.prompt, False)


def test_a_dead_replica_is_passed_over_and_none_left_is_unavailable(tokenizer) -> None:
    dead = f"127.0.0.1:{free_port()}"
    with serving(tokenizer, dead) as (client, _):
        for _ in range(3):  # whichever replica a batch tries first, it is served
            assert asyncio.run(client.encode(["hi"])) == [tokenizer.encode("hi")]
    nobody = RemoteTokenizer(lambda: [dead], lease_ttl_s=0.5)
    nobody.start()
    try:
        assert not nobody.is_ready()
        began = time.monotonic()
        with pytest.raises(EngineUnavailable, match="no tokenizer service is listed|the tokenizer service is unavailable"):
            asyncio.run(nobody.encode(["hi"]))
        assert time.monotonic() - began >= 0.5, "a call gave up before a lease TTL had passed"
    finally:
        nobody.close()


def test_a_call_outlasts_the_restart_of_the_only_replica(tokenizer) -> None:
    """Tokenizing holds no state: a request that comes while the one tokenizer restarts
    waits for it (a lease TTL at most) instead of failing."""
    address = f"127.0.0.1:{free_port()}"
    server = start_tokenizer_server(tokenizer, address)
    client = RemoteTokenizer(lambda: [address], refresh_interval_s=0.1, lease_ttl_s=5.0)
    client.start()
    try:
        wait_ready(client)
        server.stop(0)
        while client.is_ready():
            time.sleep(0.02)

        async def encode_meanwhile() -> list[list[int]]:
            call = asyncio.ensure_future(client.encode(["hi"]))
            await asyncio.sleep(0.5)  # the call is trying the dead replica again and again
            assert not call.done(), call
            nonlocal server
            server = start_tokenizer_server(tokenizer, address)
            return await call

        assert asyncio.run(encode_meanwhile()) == [tokenizer.encode("hi")]
    finally:
        client.close()
        server.stop(0)


def test_a_registry_away_for_longer_than_a_lease_takes_no_replica_away(tokenizer) -> None:
    """Back empty after an outage of more than a TTL, the registry lists nobody until the
    replicas renew their leases (a third of a TTL): meanwhile the gateway stays ready."""
    server = start_tokenizer_server(tokenizer, "127.0.0.1:0")
    registry: dict[str, list[str] | None] = {"leased": [server.address]}

    def discover() -> list[str]:
        if registry["leased"] is None:
            raise ConnectionError("Redis is down")
        return list(registry["leased"])

    client = RemoteTokenizer(discover, refresh_interval_s=0.1, lease_ttl_s=1.0)
    client.start()
    try:
        wait_ready(client)
        registry["leased"] = None  # down for 1.5 TTLs
        time.sleep(1.5)
        registry["leased"] = []  # back, empty: for most of a TTL the replica has not renewed yet
        back = time.monotonic()
        while time.monotonic() - back < 0.8:
            assert client.is_ready(), "a registry outage took the tokenizer away"
            time.sleep(0.02)
        registry["leased"] = [server.address]
        assert asyncio.run(client.encode(["hi"])) == [tokenizer.encode("hi")]
    finally:
        client.close()
        server.stop(0)


def test_a_replica_is_dropped_on_evidence_not_for_a_missing_lease(tokenizer) -> None:
    server = start_tokenizer_server(tokenizer, "127.0.0.1:0")
    leased = [server.address]
    client = RemoteTokenizer(lambda: list(leased), refresh_interval_s=0.1, lease_ttl_s=3.0)
    client.start()
    try:
        wait_ready(client)
        leased.clear()  # a registry restarted empty: the replica still answers, so it is still used
        time.sleep(1.0)
        assert client.is_ready() and asyncio.run(client.encode(["hi"])) == [tokenizer.encode("hi")]
        server.stop(0)  # its connection fails: not ready within a second, lease or not
        stopped = time.monotonic()
        while client.is_ready():
            assert time.monotonic() - stopped < 1.0, "a dead tokenizer still counts as ready"
            time.sleep(0.02)
        with pytest.raises(EngineUnavailable, match="tokenizer service"):
            asyncio.run(client.encode(["hi"]))
    finally:
        client.close()
        server.stop(0)
