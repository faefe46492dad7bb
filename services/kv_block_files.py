"""A file tier of KV blocks: one file per block under a directory, named by the block's
hash (services/block_hash.py) under a key for the model and the KV layout, so a
directory that several replicas mount gives each only KV of its own model and format.

A write goes to a temporary name and is renamed into place, so a reader sees a whole
file or none, even when the writer is killed mid-write. Each file starts with a header
(magic, layout key, block hash, payload length, CRC-32) that every read checks: a
truncated, corrupt or foreign file is a miss and is deleted, never wrong KV. Recency
is the file's mtime, renewed by each read and each repeated write, so replicas sharing
a directory share one LRU order; a writer that takes the directory past its byte bound
evicts the oldest files. Every failure (a full disk, a directory gone) is a miss and a
log line: the caller recomputes.
"""
from __future__ import annotations

import logging
import os
import struct
import threading
import time
import zlib
from pathlib import Path

from services.config import EngineConfig
from services.messages import KvTierCounts

logger = logging.getLogger(__name__)

# The media of KV events and tier metrics: the device pool, and the offload tiers in the
# order a load tries them (vLLM's events name the first two GPU and CPU).
DEVICE, HOST, DISK, SHARED = "GPU", "CPU", "DISK", "SHARED"
MAGIC = b"KVFLEET1"
# magic, layout key (16 bytes), block hash (32 bytes), payload length, payload CRC-32
HEADER = struct.Struct("<8s16s32sQI")
_SUFFIX = ".kvblock"
_STALE_TEMP_S = 60.0  # a temporary file this old was left by a writer that died


class BlockFiles:
    def __init__(self, root: str | Path, layout_key: str, max_bytes: int, medium: str) -> None:
        self.medium = medium
        self.layout_key = bytes.fromhex(layout_key)
        self.directory = Path(root) / layout_key
        self.max_bytes = max_bytes
        self._lock = threading.Lock()  # counts and the byte estimate, shared by readers and writers
        self._bytes: int | None = None  # our estimate of the directory's size: None until scanned
        self.counts = KvTierCounts(medium)  # since they were last taken

    def path(self, block_hash: bytes) -> Path:
        name = block_hash.hex()
        return self.directory / name[:2] / (name + _SUFFIX)

    def contains(self, block_hash: bytes) -> bool:
        return os.path.exists(self.path(block_hash))

    def take_counts(self) -> KvTierCounts:
        with self._lock:
            counts, self.counts = self.counts, KvTierCounts(self.medium)
        return counts

    def write(self, block_hash: bytes, payload: bytes | memoryview) -> bool:
        """Stores a block unless it is there already (then its recency is renewed).
        Returns whether a file was written."""
        path = self.path(block_hash)
        try:
            os.utime(path)
            return False
        except FileNotFoundError:
            pass
        except OSError as exc:
            return self._failed("renew", path, exc)
        header = HEADER.pack(MAGIC, self.layout_key, block_hash, len(payload), zlib.crc32(payload))
        temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(temporary, "wb") as file:
                file.write(header)
                file.write(payload)
            os.replace(temporary, path)
        except OSError as exc:
            temporary.unlink(missing_ok=True)
            return self._failed("write", path, exc)
        size = HEADER.size + len(payload)
        with self._lock:
            self.counts.stored_blocks += 1
            self.counts.stored_bytes += size
            over = self._bytes is None or self._bytes + size > self.max_bytes
            if self._bytes is not None:
                self._bytes += size
        if over:
            self._evict()
        return True

    def read(self, block_hash: bytes, payload_bytes: int) -> memoryview | None:
        """The block's payload (writable, for torch.frombuffer), or None (a miss) when it
        is absent or not exactly what was written."""
        path = self.path(block_hash)
        try:
            with open(path, "rb") as file:
                data = bytearray(os.fstat(file.fileno()).st_size)
                del data[file.readinto(data):]
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._failed("read", path, exc)
            return None
        problem = _problem(data, self.layout_key, block_hash, payload_bytes)
        if problem is not None:
            self._failed("read", path, ValueError(problem))
            path.unlink(missing_ok=True)
            return None
        try:
            os.utime(path)
        except OSError:  # evicted meanwhile: what was read is still whole
            pass
        return memoryview(data)[HEADER.size:]

    def _failed(self, action: str, path: Path, exc: Exception) -> bool:
        logger.warning("KV %s tier: could not %s %s (%s); the block counts as a miss", self.medium, action, path, exc)
        with self._lock:
            self.counts.failed += 1
        return False

    def _evict(self) -> None:
        """Deletes the least recently used files until the directory is under 90% of its bound
        (measured afresh: other replicas may write to it too), and temporary files left by
        writers that died."""
        files, now = [], time.time()
        for sub in _entries(self.directory):
            for entry in _entries(sub.path):
                try:
                    stat = entry.stat()
                except OSError:
                    continue
                if entry.name.endswith(_SUFFIX):
                    files.append((stat.st_mtime, stat.st_size, entry.path))
                elif now - stat.st_mtime > _STALE_TEMP_S:
                    _unlink(entry.path)
        total = sum(size for _, size, _ in files)
        evicted: list[bytes] = []
        evicted_bytes = 0
        if total > self.max_bytes:
            files.sort()
            target = int(self.max_bytes * 0.9)
            for _, size, path in files:
                if total <= target:
                    break
                if _unlink(path):
                    total -= size
                    evicted.append(bytes.fromhex(os.path.basename(path).removesuffix(_SUFFIX)))
                    evicted_bytes += size
        with self._lock:
            self._bytes = total
            self.counts.evicted_blocks += len(evicted)
            self.counts.evicted_bytes += evicted_bytes
            self.counts.evicted_hashes += evicted


def file_tiers(config: EngineConfig, layout_key: str) -> list[BlockFiles]:
    """The file tiers a configuration asks for, in the order a load tries them."""
    tiers = ((config.kv_offloading_dir, config.kv_offloading_dir_size, DISK),
             (config.kv_shared_dir, config.kv_shared_dir_size, SHARED))
    return [BlockFiles(directory, layout_key, int(size * 2**30), medium)
            for directory, size, medium in tiers if directory is not None]


def _problem(data: bytearray, layout_key: bytes, block_hash: bytes, payload_bytes: int) -> str | None:
    if len(data) < HEADER.size:
        return f"truncated: {len(data)} bytes"
    magic, key, stored_hash, length, crc = HEADER.unpack_from(data)
    if magic != MAGIC:
        return "not a kvfleet KV block file"
    if key != layout_key or stored_hash != block_hash:
        return "the block of another model, layout or hash"
    if length != payload_bytes or len(data) != HEADER.size + length:
        return f"{len(data) - HEADER.size} payload bytes, expected {payload_bytes}"
    if zlib.crc32(memoryview(data)[HEADER.size:]) != crc:
        return "checksum mismatch"
    return None


def _entries(directory: str | Path) -> list[os.DirEntry]:
    try:
        with os.scandir(directory) as entries:
            return list(entries)
    except OSError:
        return []


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:
        return False
