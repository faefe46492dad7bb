"""A GGUF file's metadata and tensor directory, read in milliseconds.

gguf.GGUFReader builds a numpy view for every item of every array (each of 49k
vocabulary tokens), which takes seconds; the checks made before loading need only
the scalar fields, and loading only where each tensor lies. Arrays are skipped here,
their lengths kept, but for those asked for (the grammar compiler reads the vocabulary).
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_MAGIC = b"GGUF"
# GGUF value type -> struct format of its scalar; 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_LENGTH = struct.Struct("<Q")


class BadGGUF(ValueError):
    """Not a GGUF file this reader understands."""


@dataclass(frozen=True)
class GGUFTensor:
    kind: int  # GGML type number
    dims: tuple[int, ...]  # GGUF's order: the fastest-varying dimension first
    offset: int  # of its data, from the file's start


@dataclass(frozen=True)
class GGUFHeader:
    fields: dict[str, Any]  # scalars and strings; an array's value is its length, or its list if asked for
    tensors: dict[str, GGUFTensor]


class _Cursor:
    def __init__(self, data: mmap.mmap) -> None:
        self.data = data
        self.offset = 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.data, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("Q")
        text = self.data[self.offset : self.offset + length].decode("utf-8", errors="replace")
        self.offset += length
        return text

    def skip_strings(self, count: int) -> None:
        # A vocabulary is ~50k strings, each skipped by its length prefix: one tight loop, not a call each.
        data, offset, unpack = self.data, self.offset, _LENGTH.unpack_from
        for _ in range(count):
            offset += 8 + unpack(data, offset)[0]
        self.offset = offset

    def value(self, kind: int, whole: bool = False) -> Any:
        """An array's length, or with `whole` its items."""
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.scalar("I"), self.scalar("Q")
            if whole:
                return [self.value(item_kind, whole) for _ in range(count)]
            if item_kind in _SCALARS:
                self.offset += count * struct.calcsize(_SCALARS[item_kind])
            elif item_kind == _STRING:
                self.skip_strings(count)
            else:
                for _ in range(count):
                    self.value(item_kind)
            return count
        raise BadGGUF(f"unknown GGUF value type {kind}")


def read_gguf_header(path: Path, arrays_read: tuple[str, ...] = ()) -> GGUFHeader:
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != _MAGIC:
            raise BadGGUF(f"{path} is not a GGUF file")
        cursor = _Cursor(data)
        cursor.offset = 4
        version = cursor.scalar("I")
        if version < 2:
            raise BadGGUF(f"{path}: GGUF version {version} is too old (2 or later is read)")
        num_tensors, num_fields = cursor.scalar("Q"), cursor.scalar("Q")
        fields = {}
        for _ in range(num_fields):
            key = cursor.string()
            fields[key] = cursor.value(cursor.scalar("I"), whole=key in arrays_read)
        directory = []
        for _ in range(num_tensors):
            name = cursor.string()
            dims = tuple(cursor.scalar("Q") for _ in range(cursor.scalar("I")))
            directory.append((name, cursor.scalar("I"), dims, cursor.scalar("Q")))
        # Tensor data follows the directory, aligned; each offset counts from there.
        alignment = fields.get("general.alignment", 32)
        data_start = cursor.offset + (-cursor.offset % alignment)
        tensors = {name: GGUFTensor(kind, dims, data_start + offset) for name, kind, dims, offset in directory}
        return GGUFHeader(fields, tensors)
