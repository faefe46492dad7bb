"""How kvfleet's roles open gRPC channels, with limits their servers share.

A step plan carrying several long prompts in full (new requests) can exceed gRPC's
default 4 MiB message limit, so both ends raise it.
"""
from __future__ import annotations

import grpc

MAX_MESSAGE_BYTES = 256 * 2**20
MESSAGE_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def open_channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=MESSAGE_OPTIONS)
