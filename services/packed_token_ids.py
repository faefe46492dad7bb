"""Token ids as little-endian uint32s: TokenizeResponse.token_ids_packed, and the
tokenizer's encode child process (tokenizer_svc/encode_process.py). Millions of ids
cross in a memory copy, where a repeated protobuf field or a pickled list costs tens
of milliseconds with the GIL held."""
from __future__ import annotations

import array
import sys
from collections.abc import Sequence

ID_BYTES = 4


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    packed = array.array("I", token_ids)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def unpack_token_ids(data: bytes) -> memoryview:
    """uint32s to slice and tolist(): a view of `data`, not a copy, as millions of ids
    are tens of megabytes."""
    if sys.byteorder == "big":
        swapped = array.array("I")
        swapped.frombytes(data)
        swapped.byteswap()
        return memoryview(swapped)
    return memoryview(data).cast("I")
