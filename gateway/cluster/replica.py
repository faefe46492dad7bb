"""One scheduler replica as the gateway sees it: its lease, its channel, and what the
last poll (and the requests sent since) say of its state."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2_grpc

from services.messages import EngineStats
from services.registry import Member
from services.transport.channel import open_channel
from services.transport.role_services import SCHEDULER
from services.transport.rpc import Stub


@dataclass(eq=False)
class Replica:
    member: Member
    channel: grpc.Channel
    stub: Stub  # SCHEDULER's
    health: health_pb2_grpc.HealthStub
    # Its worker holds a lease, it answered the last Stats, and its health said SERVING
    # (a draining scheduler says NOT_SERVING while it finishes what it holds).
    routable: bool = False
    load: int = 0  # running + waiting at the last poll, plus what we sent it since
    waiting: int = 0  # waiting at the last poll, plus what we sent it since
    # Another process answers at its address: this one died, and never serves again
    # (its successor has a lease, so an entry, of its own).
    superseded: bool = False
    # It refused a request as full since the last poll (whatever its queue bound says).
    refused_as_full: bool = False
    # Its newest Stats answer (None: it did not answer its last poll), and when (monotonic)
    # that question was asked: the poller and /metrics scrapes ask concurrently, and an
    # answer to an older question must not replace a newer one.
    stats: EngineStats | None = None
    stats_asked_at: float = -math.inf

    @property
    def instance_id(self) -> str:
        """Named in Stats and SubmitBatch, so only this process answers them."""
        return self.member.metadata.get("instance_id", "")

    @property
    def kv_role(self) -> str:
        """Its side of prefill/decode disaggregation (--kv-transfer-config); "" for a combined replica."""
        return self.member.metadata.get("kv_role", "")

    @property
    def kv_pool(self) -> str:
        """The one pool a kv_both replica serves in, where it was given one (the planner may
        move it: scheduler_svc/pool_move.py); "" for both, or where its kv_role decides."""
        return self.member.metadata.get("kv_pool", "")

    @property
    def block_size(self) -> int:
        return int(self.member.metadata.get("block_size", "16"))

    @property
    def full(self) -> bool:
        """Its queue is at its bound (--max-queued-requests), as far as we know."""
        bound = self.member.metadata.get("max_queued_requests")
        return self.refused_as_full or (bool(bound) and self.waiting >= int(bound))

    def runs_lora(self, name: str) -> bool:
        """Its requests ran or waited with this adapter at the last poll (vllm:lora_requests_info's view)."""
        lora = self.stats.lora if self.stats is not None else None
        return lora is not None and (name in lora.running or name in lora.waiting)

    def record_stats(self, stats: EngineStats, asked_at: float) -> None:
        """Under the replica set's lock."""
        if asked_at >= self.stats_asked_at:
            self.stats, self.stats_asked_at = stats, asked_at

    @classmethod
    def open(cls, member: Member, on_lost: Callable[[Replica, str], None]) -> Replica:
        channel = open_channel(member.address)
        replica = cls(member, channel, SCHEDULER.stub(channel), health_pb2_grpc.HealthStub(channel))

        def changed(state: grpc.ChannelConnectivity) -> None:
            # Its connection failed (a dead process refuses it): evidence about the
            # scheduler itself, seen within milliseconds rather than a lease later.
            if state is grpc.ChannelConnectivity.TRANSIENT_FAILURE:
                on_lost(replica, "is unreachable")

        channel.subscribe(changed, try_to_connect=True)
        return replica
