"""Content hashes of full KV blocks, reproducible across processes and machines.

The hash of block i of a request is

    sha256( parent || n || token_0 .. token_{n-1} || extra )

where `parent` is the 32-byte hash of block i-1 (32 zero bytes for block 0), `n`
is the number of tokens in the block and each token id is a little-endian uint32,
and `extra` is the UTF-8 of the JSON object of the request's extra keys (`lora_id`,
`cache_salt`; absent keys left out) with sorted keys and no spaces. Only full
blocks are hashed. Chaining makes a block's hash stand for its whole prefix, so
two requests share block i only if they agree on every token before it and on
their extra keys. An outside router can compute the same hashes from token ids.
"""
from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence

ROOT_PARENT = bytes(32)


def extra_keys_bytes(cache_salt: str | None = None, lora_id: int | None = None) -> bytes:
    keys = {name: value for name, value in (("cache_salt", cache_salt), ("lora_id", lora_id)) if value is not None}
    return json.dumps(keys, sort_keys=True, separators=(",", ":")).encode() if keys else b""


def hash_block(parent: bytes, token_ids: Sequence[int], extra: bytes) -> bytes:
    payload = struct.pack(f"<I{len(token_ids)}I", len(token_ids), *token_ids)
    return hashlib.sha256(parent + payload + extra).digest()


def extend_block_hashes(
    hashes: list[bytes], token_ids: Sequence[int], block_size: int, extra: bytes
) -> None:
    """Append the hashes of the full blocks of `token_ids` not hashed yet."""
    parent = hashes[-1] if hashes else ROOT_PARENT
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], extra)
        hashes.append(parent)
