"""How kvfleet's roles open gRPC channels, with limits their servers share.

A step plan carrying several long prompts in full (new requests) can exceed gRPC's
default 4 MiB message limit, so both ends raise it. gRPC backs off up to 2 minutes
between reconnects by default; a role that comes back (or a server still starting)
should be seen within a second or two instead.
"""
from __future__ import annotations

import grpc

from services.transport.cluster_token import TokenMetadata, async_token_interceptors, cluster_token
from services.transport.tls import channel_credentials

MAX_MESSAGE_BYTES = 256 * 2**20
MESSAGE_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 1000)]


def open_channel(address: str) -> grpc.Channel:
    """A channel whose calls carry the cluster token, when there is one."""
    credentials, options = channel_credentials(), MESSAGE_OPTIONS + RECONNECT_OPTIONS
    channel = (grpc.secure_channel(address, credentials, options=options) if credentials
               else grpc.insecure_channel(address, options=options))
    token = cluster_token()
    return grpc.intercept_channel(channel, TokenMetadata(token)) if token else channel


def open_async_channel(address: str) -> grpc.aio.Channel:
    """A channel of the running event loop: its calls complete on the loop itself, with
    no hop through gRPC's threads (a hop costs a thread wake-up, ~0.3 ms here)."""
    token = cluster_token()
    credentials, options = channel_credentials(), MESSAGE_OPTIONS + RECONNECT_OPTIONS
    interceptors = async_token_interceptors(token) if token else None
    if credentials:
        return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
