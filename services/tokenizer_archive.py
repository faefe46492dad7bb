"""A tokenizer's files as one zip archive, streamed in chunks with a SHA-256 on the
last (the engine protocol's GetTokenizer shape), so a gateway or router can
detokenize without access to the model's files."""
from __future__ import annotations

import hashlib
import io
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path

CHUNK_BYTES = 1 << 20


class BadTokenizerArchive(ValueError):
    """The chunks do not add up to the archive their checksum names."""


def pack(directory: Path) -> bytes:
    """Every file directly in `directory`, zipped in name order (so equal files give equal bytes)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in sorted(p for p in directory.iterdir() if p.is_file()):
            info = zipfile.ZipInfo(path.name, date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, path.read_bytes())
    return buffer.getvalue()


def chunks(archive: bytes) -> Iterator[tuple[bytes, str]]:
    """(data, sha256) per chunk; the checksum only on the last one."""
    digest = hashlib.sha256(archive).hexdigest()
    count = max(1, -(-len(archive) // CHUNK_BYTES))
    for index in range(count):
        data = archive[index * CHUNK_BYTES : (index + 1) * CHUNK_BYTES]
        yield data, digest if index == count - 1 else ""


def unpack(received: Iterable[tuple[bytes, str]], directory: Path) -> None:
    """Checks the chunks against the final checksum and extracts them into `directory`."""
    data, digest = bytearray(), ""
    for chunk, checksum in received:
        data += chunk
        digest = checksum or digest
    if not digest or hashlib.sha256(data).hexdigest() != digest:
        raise BadTokenizerArchive("the tokenizer archive's checksum does not match its bytes")
    with zipfile.ZipFile(io.BytesIO(bytes(data))) as archive:
        for name in archive.namelist():
            if Path(name).name != name:  # flat archives only: nothing may land outside `directory`
                raise BadTokenizerArchive(f"unexpected path {name!r} in the tokenizer archive")
        archive.extractall(directory)
