"""The gateway's PromptEncoder in a cluster: the tokenizer role over gRPC.

Requests that arrive together (in one pass of the event loop) go out as one
TokenizeBatch call, on an asyncio channel of the caller's loop: tokenization is on
every request's path to its first token. At start-up a thread fetches the tokenizer's files from the role
(GetTokenizer) for local detokenization, so the gateway needs no model files; until
then, and while no tokenizer replica is listed, the encoder is not ready (503).
A replica that fails a call is passed over for the next listed one; with none
left the request gets EngineUnavailable, which clients see as a 503.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc

from gateway.pass_batcher import PassBatcher
from services.engine_client import EngineUnavailable
from services.pb.kvfleet.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.tokenizer_api import ChatPrompt, EncodedPrompt
from services.tokenizer_archive import unpack
from services.transport.channel import open_async_channel, open_channel
from services.transport.futures import invalid_argument
from tokenizer_svc.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_CALL_TIMEOUT_S = 30.0


class RemoteTokenizer:
    def __init__(self, discover: Callable[[], list[str]], refresh_interval_s: float = 1.0) -> None:
        """`discover` lists the tokenizer replicas' addresses (the registry's leases)."""
        self._discover = discover
        self._refresh_interval_s = refresh_interval_s
        self._addresses: list[str] = []  # replaced, never mutated: any thread may read it
        self._stubs: dict[str, tokenizer_pb2_grpc.TokenizerStub] = {}  # the watcher thread's
        self._channels: list[grpc.Channel] = []
        self._lock = threading.Lock()  # guards _stubs and _channels
        # The callers' stubs, by event loop (an asyncio channel serves only its own loop).
        self._async_stubs: dict[tuple[asyncio.AbstractEventLoop, str], tokenizer_pb2_grpc.TokenizerStub] = {}
        self._turn = itertools.count()
        self._decoder: Tokenizer | None = None
        self._files: tempfile.TemporaryDirectory | None = None
        self._batcher: PassBatcher[None, tokenizer_pb2.TokenizeRequest, tokenizer_pb2.TokenizeResponse] = (
            PassBatcher(self._send))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="kvfleet-tokenizer-client", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        with self._lock:
            for channel in self._channels:
                channel.close()
        if self._files is not None:
            self._files.cleanup()

    def is_ready(self) -> bool:
        return self._decoder is not None and bool(self._addresses)

    @property
    def decoder(self) -> Tokenizer:
        if self._decoder is None:
            raise EngineUnavailable("the tokenizer's files have not been fetched yet")
        return self._decoder

    async def encode(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        requests = [tokenizer_pb2.TokenizeRequest(text=t, add_special_tokens=add_special_tokens) for t in texts]
        responses = await asyncio.gather(*(self._tokenize(r) for r in requests))
        return [list(response.token_ids) for response in responses]

    async def encode_chat(self, chat: ChatPrompt) -> EncodedPrompt:
        messages = [tokenizer_pb2.ChatMessage(**m) for m in chat.messages]
        request = tokenizer_pb2.TokenizeRequest(
            chat=tokenizer_pb2.Chat(messages=messages, add_generation_prompt=chat.add_generation_prompt),
            add_special_tokens=chat.add_special_tokens,
        )
        response = await self._tokenize(request)
        return EncodedPrompt(response.prompt, list(response.token_ids))

    # -- batching, on the caller's event loop ------------------------------------------

    async def _tokenize(self, request: tokenizer_pb2.TokenizeRequest) -> tokenizer_pb2.TokenizeResponse:
        return await self._batcher.submit(None, request)

    async def _send(
        self, _: None, requests: list[tokenizer_pb2.TokenizeRequest]
    ) -> list[tokenizer_pb2.TokenizeResponse | BaseException]:
        reply = await self._call_any(tokenizer_pb2.TokenizeBatchRequest(requests=requests))
        return [invalid_argument(result.invalid_argument) if result.WhichOneof("result") == "invalid_argument"
                else result.response for result in reply.results]

    async def _call_any(self, request: tokenizer_pb2.TokenizeBatchRequest) -> tokenizer_pb2.TokenizeBatchResponse:
        addresses = self._addresses
        if not addresses:
            raise EngineUnavailable("no tokenizer service is listed in the registry")
        first = next(self._turn)
        failures = []
        for address in (addresses[(first + i) % len(addresses)] for i in range(len(addresses))):
            try:
                return await self._async_stub(address).TokenizeBatch(request, timeout=_CALL_TIMEOUT_S)
            except grpc.RpcError as exc:
                if exc.code() is grpc.StatusCode.INVALID_ARGUMENT:
                    raise invalid_argument(exc.details() or "") from exc
                failures.append(f"{address}: {exc.code().name}: {exc.details()}")
        raise EngineUnavailable(f"the tokenizer service is unavailable ({'; '.join(failures)})")

    def _async_stub(self, address: str) -> tokenizer_pb2_grpc.TokenizerStub:
        key = (asyncio.get_running_loop(), address)
        stub = self._async_stubs.get(key)
        if stub is None:
            stub = self._async_stubs[key] = tokenizer_pb2_grpc.TokenizerStub(open_async_channel(address))
        return stub

    def _stub(self, address: str) -> tokenizer_pb2_grpc.TokenizerStub:
        with self._lock:
            stub = self._stubs.get(address)
            if stub is None:
                channel = open_channel(address)
                self._channels.append(channel)
                stub = self._stubs[address] = tokenizer_pb2_grpc.TokenizerStub(channel)
            return stub

    # -- the watcher thread --------------------------------------------------------------

    def _watch(self) -> None:
        """Keeps the replica list fresh; fetches the tokenizer's files once one answers."""
        while True:
            try:
                self._addresses = sorted(self._discover())
                if self._decoder is None and self._addresses:
                    self._fetch_decoder()
            except Exception as exc:  # the registry or a replica may be away for a while
                logger.warning("tokenizer service: %s", exc)
            if self._stop.wait(self._refresh_interval_s):
                return

    def _fetch_decoder(self) -> None:
        for address in self._addresses:
            stub = self._stub(address)
            try:
                description = stub.Describe(tokenizer_pb2.DescribeTokenizerRequest(), timeout=_CALL_TIMEOUT_S)
                chunks = stub.GetTokenizer(tokenizer_pb2.GetTokenizerRequest(), timeout=_CALL_TIMEOUT_S)
                files = tempfile.TemporaryDirectory(prefix="kvfleet-tokenizer-")
                unpack(((chunk.data, chunk.sha256) for chunk in chunks), Path(files.name))
            except grpc.RpcError as exc:
                logger.warning("could not fetch the tokenizer from %s: %s", address, exc.code().name)
                continue
            self._files = files
            self._decoder = Tokenizer.from_files(Path(files.name), description.name)
            logger.info("fetched the tokenizer of %s from %s", description.name, address)
            return
