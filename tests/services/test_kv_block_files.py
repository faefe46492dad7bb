"""A file tier's blocks on a real directory: whole files or none, every read checked,
LRU eviction under the byte bound, and every fault a miss with a log line."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.kv_block_files import HEADER, BlockFiles

KEY = "ab" * 16
PAYLOAD = bytes(range(256)) * 16  # 4 KiB


def block_hash(index: int) -> bytes:
    return index.to_bytes(32, "big")


def test_a_block_reads_back_as_written_and_only_under_its_own_key(tmp_path: Path) -> None:
    files = BlockFiles(tmp_path, KEY, 2**20, "DISK")
    assert files.write(block_hash(1), PAYLOAD)
    assert not files.write(block_hash(1), PAYLOAD)  # there already: its recency renewed instead
    assert bytes(files.read(block_hash(1), len(PAYLOAD))) == PAYLOAD
    assert files.read(block_hash(2), len(PAYLOAD)) is None
    other_model = BlockFiles(tmp_path, "cd" * 16, 2**20, "DISK")
    assert not other_model.contains(block_hash(1)) and other_model.read(block_hash(1), len(PAYLOAD)) is None
    assert files.take_counts().stored_blocks == 1


@pytest.mark.parametrize("damage", ["truncated", "corrupted", "foreign", "wrong size"])
def test_a_damaged_file_is_a_miss_logged_and_deleted(tmp_path: Path, damage: str, caplog) -> None:
    files = BlockFiles(tmp_path, KEY, 2**20, "DISK")
    files.write(block_hash(1), PAYLOAD)
    path = files.path(block_hash(1))
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "corrupted":
        data[HEADER.size + 100] ^= 0xFF
    elif damage == "foreign":  # another tool's file under our name
        data = bytearray(b"GGUF" + bytes(len(data) - 4))
    path.write_bytes(data)
    expected = len(PAYLOAD) + (1 if damage == "wrong size" else 0)
    assert files.read(block_hash(1), expected) is None
    assert not path.exists()
    assert files.take_counts().failed == 1
    assert "counts as a miss" in caplog.text


def test_the_least_recently_used_blocks_go_when_the_bound_is_passed(tmp_path: Path) -> None:
    size = HEADER.size + len(PAYLOAD)
    files = BlockFiles(tmp_path, KEY, 10 * size, "DISK")
    for index in range(10):
        files.write(block_hash(index), PAYLOAD)
        os.utime(files.path(block_hash(index)), (1000 + index, 1000 + index))  # a distinct age each
    files.read(block_hash(0), len(PAYLOAD))  # the oldest, used again: now the newest
    files.write(block_hash(10), PAYLOAD)  # past the bound: down to 90% of it
    kept = [index for index in range(11) if files.contains(block_hash(index))]
    assert kept == [0, 3, 4, 5, 6, 7, 8, 9, 10]
    counts = files.take_counts()
    assert counts.evicted_blocks == 2 and counts.evicted_hashes == [block_hash(1), block_hash(2)]


def test_a_full_disk_is_a_failed_write_and_no_partial_file(small_tmpfs: Path, caplog) -> None:
    files = BlockFiles(small_tmpfs, KEY, 2**30, "DISK")  # a bound the disk cannot hold
    written = [files.write(block_hash(index), PAYLOAD * 16) for index in range(40)]  # 64 KiB each, 1 MiB disk
    assert written[0] and not written[-1]
    assert files.take_counts().failed > 0 and "No space left" in caplog.text
    assert not list(small_tmpfs.rglob("*.tmp"))
    for index, ok in enumerate(written):
        assert files.contains(block_hash(index)) == ok
        assert (files.read(block_hash(index), len(PAYLOAD) * 16) is not None) == ok


def test_a_writer_killed_mid_write_leaves_no_block_and_its_leftover_is_swept(tmp_path: Path) -> None:
    big = 256 * 2**20  # long enough to be killed mid-write
    writer = subprocess.Popen([sys.executable, "-c", (
        "import sys; from services.kv_block_files import BlockFiles; "
        f"BlockFiles(sys.argv[1], {KEY!r}, 2**40, 'SHARED').write(bytes(32), bytes({big}))"), str(tmp_path)],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    files = BlockFiles(tmp_path, KEY, 2**40, "SHARED")
    deadline = time.monotonic() + 30
    while not list(tmp_path.rglob("*.tmp")) and time.monotonic() < deadline:
        time.sleep(0.005)
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    [leftover] = list(tmp_path.rglob("*.tmp"))
    assert not files.contains(bytes(32)) and files.read(bytes(32), big) is None
    old = time.time() - 120
    os.utime(leftover, (old, old))
    files.max_bytes = 0  # the next write sweeps the directory
    files.write(block_hash(1), PAYLOAD)
    assert not leftover.exists()
