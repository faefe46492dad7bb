"""4-bit GGUF matrices (Q4_0, Q4_1) kept as stored: a 4-bit code per weight and, per
block of 32 weights along a row, a scale and an offset: weight = code * scale + offset."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType

GROUP_SIZE = 32  # weights per GGUF block
# Bytes before a block's 16 bytes of codes: Q4_0 has a float16 scale, Q4_1 a scale and a minimum.
_HEADER_BYTES = {GGMLQuantizationType.Q4_0: 2, GGMLQuantizationType.Q4_1: 4}
Q4_KINDS = frozenset(_HEADER_BYTES)


@dataclass(frozen=True)
class Q4Blocks:
    codes: torch.Tensor  # [rows, cols] uint8, 0..15
    scales: torch.Tensor  # [rows, cols / 32] float32
    offsets: torch.Tensor  # [rows, cols / 32] float32

    @classmethod
    def from_gguf(cls, raw: np.ndarray, kind: GGMLQuantizationType) -> Q4Blocks:
        """From the tensor's bytes as rows of blocks ([rows, blocks * block bytes])."""
        header = _HEADER_BYTES[kind]
        blocks = raw.reshape(raw.shape[0], -1, header + GROUP_SIZE // 2)
        scales = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        packed = blocks[..., header:]
        # A block's byte j holds weight j in its low nibble and weight j + 16 in its high one.
        codes = np.concatenate((packed & 0x0F, packed >> 4), axis=-1).reshape(raw.shape[0], -1)
        if kind is GGMLQuantizationType.Q4_1:
            offsets = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        else:  # Q4_0 codes are signed around 8
            offsets = -8.0 * scales
        return cls(torch.from_numpy(codes), torch.from_numpy(scales), torch.from_numpy(offsets))

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + self.offsets.nbytes

    def to(self, device: torch.device) -> Q4Blocks:
        return Q4Blocks(self.codes.to(device), self.scales.to(device), self.offsets.to(device))

    def map_rows(self, reorder: Callable[[torch.Tensor], torch.Tensor]) -> Q4Blocks:
        """The same weights with their rows reordered by `reorder` (a function of a row-major tensor)."""
        return Q4Blocks(reorder(self.codes).contiguous(), reorder(self.scales).contiguous(),
                        reorder(self.offsets).contiguous())

    @staticmethod
    def cat(parts: list[Q4Blocks]) -> Q4Blocks:
        """One matrix of the parts' rows, as fused projections need."""
        return Q4Blocks(*(torch.cat([getattr(part, field) for part in parts]) for field in ("codes", "scales",
                                                                                            "offsets")))

    def dequantize(self, out: torch.Tensor) -> torch.Tensor:
        """The float weights [rows, cols], written into `out` (at least rows * cols elements)."""
        rows, cols = self.codes.shape
        grouped = out[: rows * cols].view(rows, cols // GROUP_SIZE, GROUP_SIZE)
        # Three vectorized passes over a buffer the cache holds: 5x faster here than one
        # mul mixing uint8 and float, which takes torch's slow casting loop.
        grouped.copy_(self.codes.view(grouped.shape)).mul_(self.scales.unsqueeze(-1))
        return grouped.add_(self.offsets.unsqueeze(-1)).view(rows, cols)
