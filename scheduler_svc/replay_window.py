"""What a scheduler published on NATS lately, per gateway, numbered, so a gateway that
missed messages gets them again (Scheduler.ReplayOutputs).

Core NATS is at-most-once: a NATS restart loses what was in flight, and a gateway
that falls behind has messages dropped. Each gateway's messages are numbered from 1
without gaps, so the gateway sees a hole, and kept here for REPLAY_WINDOW_S (and at
most REPLAY_WINDOW_BYTES per gateway), so it can fill it. A hole older than that is
reported, and the gateway fails the requests concerned: nothing is lost silently.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

from services.scheduler_messages import StepOutputs
from services.transport.rpc import encode

# Longer than any NATS restart or reconnect worth waiting for: a gateway fails its
# streams after a lease TTL without NATS (10 s by default).
REPLAY_WINDOW_S = 60.0
REPLAY_WINDOW_BYTES = 64 * 2**20


@dataclass
class _Sent:
    seq: int
    payload: bytes
    at: float


@dataclass
class _GatewayLog:
    last_seq: int = 0
    size: int = 0
    messages: deque[_Sent] = field(default_factory=deque)

    def trim(self, now: float, max_age_s: float, max_bytes: int) -> None:
        while self.messages and (now - self.messages[0].at > max_age_s or self.size > max_bytes):
            self.size -= len(self.messages.popleft().payload)


class ReplayWindow:
    """Thread-safe: the NATS thread numbers and records, gRPC threads replay."""

    def __init__(self, instance_id: str, max_age_s: float = REPLAY_WINDOW_S,
                 max_bytes: int = REPLAY_WINDOW_BYTES) -> None:
        self.instance_id = instance_id
        self._max_age_s = max_age_s
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self._logs: dict[str, _GatewayLog] = {}

    def record(self, gateway_id: str, message: StepOutputs) -> bytes:
        """Numbers `message` as the gateway's next, keeps it, and returns it encoded."""
        now = time.monotonic()
        with self._lock:
            log = self._logs.setdefault(gateway_id, _GatewayLog())
            log.last_seq += 1
            message.scheduler_instance_id, message.seq = self.instance_id, log.last_seq
            payload = encode(message)
            log.messages.append(_Sent(log.last_seq, payload, now))
            log.size += len(payload)
            log.trim(now, self._max_age_s, self._max_bytes)
        return payload

    def after(self, gateway_id: str, after_seq: int) -> list[bytes] | None:
        """The gateway's messages numbered after `after_seq`, in order; None when the
        first of them is no longer held."""
        with self._lock:
            log = self._logs.get(gateway_id)
            if log is None or after_seq >= log.last_seq:
                return []
            log.trim(time.monotonic(), self._max_age_s, self._max_bytes)
            if not log.messages or log.messages[0].seq > after_seq + 1:
                return None
            return [sent.payload for sent in log.messages if sent.seq > after_seq]

    def announcements(self) -> dict[str, bytes]:
        """Per gateway sent to within the window, a message announcing its last seq.
        (A gateway's numbering never restarts, so its entry stays: a few ints.)"""
        now = time.monotonic()
        with self._lock:
            return {
                gateway_id: encode(StepOutputs(scheduler_instance_id=self.instance_id, seq=log.last_seq, announce=True))
                for gateway_id, log in self._logs.items()
                if log.messages and now - log.messages[-1].at <= self._max_age_s
            }
