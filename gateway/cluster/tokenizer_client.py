"""The gateway's PromptEncoder in a cluster: the tokenizer role over gRPC.

Requests that arrive together (in one pass of the event loop) go out as one
TokenizeBatch call, on an asyncio channel of the caller's loop: tokenization is on
every request's path to its first token. At start-up a thread fetches the tokenizer's files from the role
(GetTokenizer) for local detokenization, so the gateway needs no model files; until
then the encoder takes no request (503), and while no tokenizer replica can be reached
it is not ready (/health). A replica that fails a call is passed over for the next one.
When every one is unreachable (a lone tokenizer restarting), the call waits for one to
come back, for a lease TTL at most: tokenizing holds no state, so a request need not fail
for a restart it can outlast. After that it gets EngineUnavailable, which clients see as
a 503.

As with schedulers, a replica is dropped on evidence only: its connection failing (a
dead process, within milliseconds: /health follows at once), or its lease missing for
longer than a lease TTL. A registry that comes back empty after a restart, before the
replicas have re-registered, takes nothing away.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.cluster.pass_batcher import PassBatcher
from services.engine_client import EngineUnavailable
from services.messages import Empty
from services.packed_token_ids import unpack_token_ids
from services.registry import DEFAULT_TTL_S
from services.tokenizer_api import ChatPrompt, EncodedPrompt
from services.tokenizer_archive import unpack
from services.tokenizer_messages import TokenizeBatchRequest, TokenizeBatchResponse, TokenizeRequest, TokenizeResponse
from services.transport.channel import open_async_channel, open_channel
from services.transport.futures import invalid_argument
from services.transport.role_services import TOKENIZER
from services.transport.rpc import Stub
from tokenizer_svc.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_CALL_TIMEOUT_S = 30.0
# About 0.3 ms of converting each: a request served meanwhile takes a few dozen
# passes of the event loop, each of which may wait for one slice.
_IDS_PER_SLICE = 8192
# Health answers from memory, on threads of its own (services/transport/server.py).
_PROBE_TIMEOUT_S = 1.0
# How often a call that found every replica unreachable tries them again: channels
# reconnect within a second (services/transport/channel.py).
_RETRY_INTERVAL_S = 0.1


class RemoteTokenizer:
    def __init__(
        self, discover: Callable[[], list[str]], refresh_interval_s: float = 1.0, lease_ttl_s: float = DEFAULT_TTL_S
    ) -> None:
        """`discover` lists the tokenizer replicas' addresses (the registry's leases)."""
        self._discover = discover
        self._refresh_interval_s = refresh_interval_s
        self._lease_ttl_s = lease_ttl_s
        self._last_listed: dict[str, float] = {}  # the watcher thread's
        self._unreachable: set[str] = set()  # connections failing now; updated by gRPC's threads
        self._addresses: list[str] = []  # replaced, never mutated: any thread may read it
        self._lock = threading.Lock()  # guards the channels
        # The watcher thread's channels (they also watch each replica's connection), and
        # the callers', by event loop (an asyncio channel serves only its own loop).
        self._channels: dict[str, tuple[grpc.Channel, Stub, health_pb2_grpc.HealthStub]] = {}
        self._async_channels: dict[tuple[asyncio.AbstractEventLoop, str], tuple[grpc.aio.Channel, Stub]] = {}
        self._turn = itertools.count()
        self._decoder: Tokenizer | None = None
        self._files: tempfile.TemporaryDirectory | None = None
        self._batcher: PassBatcher[None, TokenizeRequest, TokenizeResponse] = PassBatcher(self._send)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="kvfleet-tokenizer-client", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        with self._lock:
            addresses = list(self._channels)
        for address in addresses:
            self._forget(address)
        if self._files is not None:
            self._files.cleanup()

    def is_ready(self) -> bool:
        return self._decoder is not None and any(a not in self._unreachable for a in self._addresses)

    def is_started(self) -> bool:
        return self._decoder is not None

    @property
    def decoder(self) -> Tokenizer:
        if self._decoder is None:
            raise EngineUnavailable("the tokenizer's files have not been fetched yet")
        return self._decoder

    async def encode(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        requests = [TokenizeRequest(t, add_special_tokens=add_special_tokens, packed_token_ids=True) for t in texts]
        responses = await asyncio.gather(*(self._tokenize(r) for r in requests))
        return [await _ids(response) for response in responses]

    async def encode_chat(self, chat: ChatPrompt) -> EncodedPrompt:
        response = await self._tokenize(TokenizeRequest(chat=chat, packed_token_ids=True))
        return EncodedPrompt(response.prompt, await _ids(response))

    # -- batching, on the caller's event loop ------------------------------------------

    async def _tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        return await self._batcher.submit(None, request)

    async def _send(self, _: None, requests: list[TokenizeRequest]) -> list[TokenizeResponse | BaseException]:
        reply = await self._call_any(TokenizeBatchRequest(requests))
        return [result.response if result.response is not None else invalid_argument(result.invalid_argument)
                for result in reply.results]

    async def _call_any(self, request: TokenizeBatchRequest) -> TokenizeBatchResponse:
        """The call on one replica, taken in turns; while none can be reached, tried again
        until one comes back or a lease TTL has passed."""
        give_up_at = time.monotonic() + self._lease_ttl_s
        while True:
            failures = await self._call_each(request)
            if not isinstance(failures, list):
                return failures
            if time.monotonic() >= give_up_at:
                raise EngineUnavailable(f"the tokenizer service is unavailable ({'; '.join(failures)})")
            await asyncio.sleep(_RETRY_INTERVAL_S)

    async def _call_each(self, request: TokenizeBatchRequest) -> TokenizeBatchResponse | list[str]:
        """The first replica's answer, or why each failed: a bad request is the request's error."""
        addresses = self._addresses
        if not addresses:
            return ["no tokenizer service is listed in the registry"]
        first = next(self._turn)
        turn = [addresses[(first + i) % len(addresses)] for i in range(len(addresses))]
        failures = []
        # Those whose connection fails now are tried last: one may be back meanwhile.
        for address in sorted(turn, key=lambda a: a in self._unreachable):
            try:
                return await self._async_stub(address).TokenizeBatch(request, timeout=_CALL_TIMEOUT_S)
            except grpc.RpcError as exc:
                if exc.code() is grpc.StatusCode.INVALID_ARGUMENT:
                    raise invalid_argument(exc.details() or "") from exc
                failures.append(f"{address}: {exc.code().name}: {exc.details()}")
        return failures

    def _async_stub(self, address: str) -> Stub:
        key = (asyncio.get_running_loop(), address)
        with self._lock:
            if key not in self._async_channels:
                for closed in [k for k in self._async_channels if k[0].is_closed()]:  # their channels died with them
                    del self._async_channels[closed]
                channel = open_async_channel(address)
                self._async_channels[key] = (channel, TOKENIZER.stub(channel))
            return self._async_channels[key][1]

    def _stub(self, address: str) -> Stub:
        return self._watched(address)[1]

    def _stub_health(self, address: str) -> health_pb2_grpc.HealthStub:
        return self._watched(address)[2]

    def _watched(
        self, address: str
    ) -> tuple[grpc.Channel, Stub, health_pb2_grpc.HealthStub]:
        with self._lock:
            if address not in self._channels:
                channel = open_channel(address)
                channel.subscribe(lambda state: self._connectivity(address, state))
                self._channels[address] = (
                    channel, TOKENIZER.stub(channel), health_pb2_grpc.HealthStub(channel))
            return self._channels[address]

    def _forget(self, address: str) -> None:
        """Closes the channels to a replica gone for good (they would retry forever)."""
        with self._lock:
            watched = self._channels.pop(address, None)
            keys = [key for key in self._async_channels if key[1] == address]
            callers = [(key[0], self._async_channels.pop(key)[0]) for key in keys]
        if watched is not None:
            watched[0].close()
        for loop, channel in callers:
            if not loop.is_closed():  # else the channel went with its loop
                asyncio.run_coroutine_threadsafe(channel.close(), loop)
        self._unreachable.discard(address)

    def _connectivity(self, address: str, state: grpc.ChannelConnectivity) -> None:
        if state is grpc.ChannelConnectivity.TRANSIENT_FAILURE:
            self._unreachable.add(address)

    def _probe(self, address: str) -> None:
        """A health check: it also makes an idle channel reconnect, so a dead replica's
        failing connection is seen within a refresh interval even with no traffic."""
        try:
            reply = self._stub_health(address).Check(health_pb2.HealthCheckRequest(), timeout=_PROBE_TIMEOUT_S)
        except grpc.RpcError as exc:
            if exc.code() is grpc.StatusCode.UNAVAILABLE:
                self._unreachable.add(address)
            return  # a slow answer is no evidence either way
        if reply.status == health_pb2.HealthCheckResponse.SERVING:
            self._unreachable.discard(address)
        else:  # draining
            self._unreachable.add(address)

    # -- the watcher thread --------------------------------------------------------------

    def _watch(self) -> None:
        """Keeps the replica list fresh; fetches the tokenizer's files once one answers."""
        registry_was_away = False
        while True:
            try:
                leased = self._discover()
            except Exception as exc:  # the registry may be away for a while
                logger.warning("tokenizer service: %s", exc)
                registry_was_away = True
            else:
                try:
                    self._addresses = self._listed(leased, registry_was_away)
                    registry_was_away = False
                    if self._decoder is None and self._addresses:
                        self._fetch_decoder()
                except Exception as exc:  # a replica may be away for a while
                    logger.warning("tokenizer service: %s", exc)
            if self._stop.wait(self._refresh_interval_s):
                return

    def _listed(self, leased: list[str], registry_was_away: bool) -> list[str]:
        """The leased replicas, and those leased within a TTL whose connection still
        works (a registry restarted empty lists nobody until the leases are renewed).
        While the registry could not be read, no lease could be renewed in it: back, each
        replica's TTL counts from now, or an outage of a TTL would drop every replica."""
        now = time.monotonic()
        if registry_was_away:
            self._last_listed = dict.fromkeys(self._last_listed, now)
        self._last_listed.update(dict.fromkeys(leased, now))
        for address in [a for a, seen in self._last_listed.items() if now - seen > self._lease_ttl_s]:
            del self._last_listed[address]
            self._forget(address)
        listed = sorted(a for a in self._last_listed if a in leased or a not in self._unreachable)
        for address in listed:
            self._probe(address)
        return listed

    def _fetch_decoder(self) -> None:
        for address in self._addresses:
            stub = self._stub(address)
            try:
                description = stub.Describe(Empty(), timeout=_CALL_TIMEOUT_S)
                chunks = stub.GetTokenizer(Empty(), timeout=_CALL_TIMEOUT_S)
                files = tempfile.TemporaryDirectory(prefix="kvfleet-tokenizer-")
                unpack(((chunk.data, chunk.sha256) for chunk in chunks), Path(files.name))
            except grpc.RpcError as exc:
                logger.warning("could not fetch the tokenizer from %s: %s", address, exc.code().name)
                continue
            self._files = files
            self._decoder = Tokenizer.from_files(Path(files.name), description.name)
            logger.info("fetched the tokenizer of %s from %s", description.name, address)
            return


async def _ids(response: TokenizeResponse) -> list[int]:
    """A reply's ids as a list; a multi-megabyte prompt's in slices, with the event
    loop free between them (millions of ids take tens of milliseconds)."""
    token_ids = unpack_token_ids(response.token_ids_packed)
    if len(token_ids) <= _IDS_PER_SLICE:
        return token_ids.tolist()
    ids: list[int] = []
    for start in range(0, len(token_ids), _IDS_PER_SLICE):
        ids += token_ids[start:start + _IDS_PER_SLICE].tolist()
        await asyncio.sleep(0)
    return ids
