"""kvfleet's NATS connection, shared by the scheduler's publisher and the gateway's subscriber.

Subject `kvfleet.out.<gateway_id>` carries StepOutputs (services/scheduler_messages.py,
msgpack): one message per engine step per gateway with every new delta of that
gateway's requests, never one per token; `kvfleet.kv.<scheduler_instance_id>` carries
each scheduler's NumberedKvEvents.
Each end keeps its NATS client on an asyncio loop in a daemon thread:
the publisher is called from the scheduler's step-loop thread, which must never wait
on the network, and the subscriber serves consumers on any event loop.
"""
from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats
from nats.aio.client import Client

logger = logging.getLogger(__name__)

T = TypeVar("T")
NATS_USER_ENV, NATS_PASSWORD_ENV = "KVFLEET_NATS_USER", "KVFLEET_NATS_PASSWORD"
Callback = Callable[[], Awaitable[None]]


def subject(gateway_id: str) -> str:
    return f"kvfleet.out.{gateway_id}"


def kv_subject(scheduler_instance_id: str) -> str:
    """A scheduler's KV events (NumberedKvEvents); `kv_subject("*")` is all of them."""
    return f"kvfleet.kv.{scheduler_instance_id}"


class NatsThread:
    """One NATS connection, owned by an event loop running on its own daemon thread.

    It reconnects forever, and knows how long it has been away: `disconnected_cb` runs
    once when the connection is lost (not again for each failed attempt), and
    `reconnected_cb` once it is back."""

    def __init__(self, url: str, name: str, connect_timeout_s: float,
                 disconnected_cb: Callback | None = None, reconnected_cb: Callback | None = None,
                 **callbacks: Callback) -> None:
        self._away_since: float | None = None  # monotonic; None while connected
        self._on_disconnect = disconnected_cb
        self._on_reconnect = reconnected_cb
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()
        # Reconnect forever: a NATS restart must not end a long-lived role.
        # Credentials come from the environment: in a --nats-url they would show on the command line.
        connect = nats.connect(url, name=name, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
                               user=os.environ.get(NATS_USER_ENV), password=os.environ.get(NATS_PASSWORD_ENV),
                               disconnected_cb=self._disconnected, reconnected_cb=self._reconnected, **callbacks)
        try:
            self.nc: Client = self.run(connect, connect_timeout_s)
        except BaseException:
            self._stop_loop()
            raise

    def run(self, coro: Awaitable[T], timeout_s: float) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            raise

    @property
    def connected(self) -> bool:
        return self.nc.is_connected

    def away_s(self) -> float:
        """How long NATS has been unreachable: 0 while connected, infinite once closed."""
        away_since = self._away_since
        if self.nc.is_connected:
            return 0.0
        if self.nc.is_closed:
            return math.inf
        # Just lost: the client says so before its disconnected callback stamps the time.
        return 0.0 if away_since is None else time.monotonic() - away_since

    async def _disconnected(self) -> None:
        if self._away_since is not None:  # a failed reconnect attempt: still away
            return
        self._away_since = time.monotonic()
        if self._on_disconnect is not None:
            await self._on_disconnect()

    async def _reconnected(self) -> None:
        self._away_since = None
        if self._on_reconnect is not None:
            await self._on_reconnect()

    def close(self, timeout_s: float = 5.0) -> None:
        try:
            self.run(self.nc.close(), timeout_s)
        except Exception:
            logger.exception("could not close the NATS connection cleanly")
        self._stop_loop()

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()
