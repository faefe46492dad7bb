"""Huge texts are encoded in a child process.

The Rust tokenizer lets go of the GIL while it encodes, but not while Python frees
the Encoding it returns: for a 5 MB prompt (3.2M tokens) that takes ~0.6 s, during
which no other thread of the process runs, so the server's event loop, its /health
and every stream would freeze. In a child process that cost stalls nobody; the ids
come back as one packed buffer, which becomes a list in ~50 ms.

The child (`python -m tokenizer_svc.encode_process`) imports only `tokenizers` and the
packed-ids format, gets the tokenizer's JSON on stdin, then answers requests framed on
its pipes; it exits when its stdin closes, so it never outlives the process that
started it.
"""
from __future__ import annotations

import logging
import struct
import subprocess
import sys
import threading
from typing import BinaryIO

from tokenizers import Tokenizer as RustTokenizer

from services.packed_token_ids import ID_BYTES, pack_token_ids, unpack_token_ids

logger = logging.getLogger(__name__)

# Texts longer than this (in characters) are encoded in the child: freeing the
# Encoding of 100k characters holds the GIL ~10 ms, of a megabyte ~100 ms.
HUGE_TEXT_CHARS = 100_000

_LENGTH = struct.Struct("<Q")
_REQUEST = struct.Struct("<?Q")  # add_special_tokens, then the text's UTF-8 byte count
_LIST_SLICE = 1 << 16


def _read_exactly(stream: BinaryIO, count: int) -> bytes:
    data = stream.read(count)
    if data is None or len(data) != count:
        raise EOFError(f"the tokenizer child process's pipe closed ({len(data or b'')} of {count} bytes)")
    return data


class EncodeProcess:
    """One child process with a copy of the tokenizer, started on first use and again
    after it dies; calls from several threads take turns."""

    def __init__(self, tokenizer: RustTokenizer) -> None:
        # Serialized now, at start-up: it holds the GIL ~70 ms, too long for a busy server.
        self._tokenizer_json = tokenizer.to_str().encode()
        self._lock = threading.Lock()
        self._child: subprocess.Popen[bytes] | None = None

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        with self._lock:
            try:
                return self._ask(text, add_special_tokens)
            except (EOFError, OSError) as exc:  # the child died (killed, out of memory): once more, afresh
                logger.warning("the tokenizer child process failed (%s); starting another", exc)
                self._stop()
                return self._ask(text, add_special_tokens)

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _ask(self, text: str, add_special_tokens: bool) -> list[int]:
        child = self._started()
        assert child.stdin is not None and child.stdout is not None
        data = text.encode()  # a lone surrogate raises here, as the Rust tokenizer would refuse it
        child.stdin.write(_REQUEST.pack(add_special_tokens, len(data)) + data)
        child.stdin.flush()
        (count,) = _LENGTH.unpack(_read_exactly(child.stdout, _LENGTH.size))
        ids = unpack_token_ids(_read_exactly(child.stdout, count * ID_BYTES))
        # In slices: one tolist() of millions of ids would hold the GIL for ~50 ms.
        token_ids: list[int] = []
        for start in range(0, len(ids), _LIST_SLICE):
            token_ids += ids[start:start + _LIST_SLICE].tolist()
        return token_ids

    def _started(self) -> subprocess.Popen[bytes]:
        if self._child is None or self._child.poll() is not None:
            self._child = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE)
            assert self._child.stdin is not None
            self._child.stdin.write(_LENGTH.pack(len(self._tokenizer_json)) + self._tokenizer_json)
        return self._child

    def _stop(self) -> None:
        if self._child is not None:
            self._child.kill()
            self._child.wait()
            self._child = None


def _serve(requests: BinaryIO, replies: BinaryIO) -> None:
    (size,) = _LENGTH.unpack(_read_exactly(requests, _LENGTH.size))
    tokenizer = RustTokenizer.from_str(_read_exactly(requests, size).decode())
    while header := requests.read(_REQUEST.size):
        add_special_tokens, size = _REQUEST.unpack(header)
        text = _read_exactly(requests, size).decode()
        [encoding] = tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
        ids = encoding.ids
        replies.write(_LENGTH.pack(len(ids)) + pack_token_ids(ids))
        replies.flush()


if __name__ == "__main__":
    _serve(sys.stdin.buffer, sys.stdout.buffer)
