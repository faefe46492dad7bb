"""The messages of a prefill/decode KV handoff (docs/disaggregation.md).

`KvTransferParams` is vLLM's `kv_transfer_params`, with its keys: a request carries
`do_remote_decode` to a producer (compute the prompt's KV and hold it), whose final
output carries back `do_remote_prefill` with where the blocks are (`remote_host`,
`remote_port`: its worker; `remote_block_ids`; `remote_engine_id`: its scheduler;
`remote_request_id`: whose blocks they are), which the request then carries to a
consumer. The consumer's worker fetches the blocks from the producer's worker with
`FetchKvBlocks` (a gRPC stream of `KvBlock`s), never through a scheduler or gateway: the
blocks' bytes in the stream, or, with vLLM's NixlConnector named, the stream naming the
producer's blocks and the consumer reading them over NIXL.
"""
from __future__ import annotations

from typing import Annotated

import msgspec

# What a client may send: a port a socket can have, block ids a pool can have.
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
BlockId = Annotated[int, msgspec.Meta(ge=0)]


class KvTransferParams(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=False):
    do_remote_prefill: bool = False
    do_remote_decode: bool = False
    remote_engine_id: str | None = None
    remote_block_ids: list[BlockId] | None = None
    remote_host: str | None = None
    remote_port: Port | None = None
    remote_request_id: str | None = None
    tp_size: Annotated[int, msgspec.Meta(ge=1)] = 1
    # kvfleet's, not vLLM's: the producer is still computing the prompt and publishes its
    # full blocks as each prefill chunk ends; the consumer fetches them by their place in
    # the prompt while the next chunk computes (no remote_block_ids: they are not all known).
    remote_streamed: bool = False

    @property
    def fetchable(self) -> bool:
        """Whether it says where blocks wait: otherwise the consumer computes the prompt
        itself, as vLLM's connector does with incomplete parameters."""
        return bool(self.do_remote_prefill and (self.remote_block_ids or self.remote_streamed) and self.remote_host
                    and self.remote_port is not None)

    def as_dict(self) -> dict:
        return msgspec.to_builtins(self)


class RemoteBlocks(msgspec.Struct, array_like=True, omit_defaults=True):
    """Where a KvLoad's blocks come from when a producer holds them: the third item of
    each of its blocks is then the producer's block id."""

    address: str  # host:port of the producer's worker
    request_id: str  # the producer's request, whose blocks they are
    by_position: bool = False  # the third items are places in the prompt, not block ids (remote_streamed)
    nixl: bool = False  # read them over NIXL (the consumer's scheduler names NixlConnector)


class KvFetchRequest(msgspec.Struct, omit_defaults=True):
    request_id: str  # the producer's request holding the blocks
    block_ids: list[int]  # the producer's blocks, in the order wanted
    layout: str  # the consumer's KV layout (dtype and block shape): a producer of another refuses
    # block_ids are places in the request's prompt (its 0th full block, ...), served as the
    # producer's prefill publishes them (remote_streamed)
    by_position: bool = False
    # The consumer reads the blocks over NIXL: the stream says which block holds each, no bytes.
    nixl: bool = False


class KvBlock(msgspec.Struct, array_like=True):
    """One block's KV, every layer's keys and values: [layer][k|v][token][head][dim]. Over
    NIXL only the places of a run of blocks, every one the producer holds at that moment
    from `index` on: the consumer reads their bytes from the producer's memory itself, in
    one READ."""

    index: int  # its position in KvFetchRequest.block_ids; -1: the NixlAgentInfo, in the payload
    payload: bytes  # the block's bytes (empty over NIXL)
    blocks: list[int] = []  # over NIXL: the producer's blocks that hold positions index, index + 1, ...


class NixlAgentInfo(msgspec.Struct, array_like=True):
    """A producer worker's NIXL agent, first in a fetch over NIXL: what the consumer needs
    to read its blocks (each layer's cache is [k|v][block][token][head][dim], contiguous)."""

    name: str
    metadata: bytes  # the agent's, for the consumer's add_remote_agent
    mem_type: str  # DRAM or VRAM
    device_id: int
    num_blocks: int
    layer_addresses: list[int]  # each layer's cache, where it starts
