"""8-bit GGUF matrices (Q8_0) kept as stored: a signed 8-bit code per weight and, per
block of 32 weights along a row, a float16 scale: weight = code * scale. GGUF files
store the token embedding this way (SmolLM2's, which its LM head shares)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType

from worker_svc.formats.q4_weights import GROUP_SIZE

Q8_KIND = GGMLQuantizationType.Q8_0
_SCALE_BYTES = 2  # a block: its float16 scale, then 32 int8 codes


@dataclass(frozen=True)
class Q8Blocks:
    codes: torch.Tensor  # [rows, cols] int8
    scales: torch.Tensor  # [rows, cols / 32] float16, as stored

    @classmethod
    def from_gguf(cls, raw: np.ndarray) -> Q8Blocks:
        """From the tensor's bytes as rows of blocks ([rows, blocks * 34])."""
        blocks = raw.reshape(raw.shape[0], -1, _SCALE_BYTES + GROUP_SIZE)
        scales = blocks[..., :_SCALE_BYTES].copy().view(np.float16)[..., 0]
        codes = blocks[..., _SCALE_BYTES:].copy().view(np.int8).reshape(raw.shape[0], -1)
        return cls(torch.from_numpy(codes), torch.from_numpy(np.ascontiguousarray(scales)))

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    def to(self, device: torch.device) -> Q8Blocks:
        return Q8Blocks(self.codes.to(device), self.scales.to(device))

    def padded(self, rows: int) -> Q8Blocks:
        """With zero rows appended up to `rows` (a rank's vocabulary slice padded to every rank's size)."""
        extra = rows - self.shape[0]
        return Q8Blocks(torch.cat((self.codes, self.codes.new_zeros(extra, self.shape[1]))),
                        torch.cat((self.scales, self.scales.new_zeros(extra, self.scales.shape[1]))))

    def rows(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The float weights of the rows `index` names: an embedding lookup. code * scale
        is exact in float32, so these equal the dequantized embedding's rows."""
        codes = self.codes[index].to(torch.float32)
        grouped = codes.view(*codes.shape[:-1], -1, GROUP_SIZE).mul_(self.scales[index].to(torch.float32).unsqueeze(-1))
        return grouped.view(codes.shape).to(dtype)

    def dequantize(self) -> torch.Tensor:
        """The float32 weights [rows, cols]."""
        rows, cols = self.shape
        grouped = self.codes.view(rows, cols // GROUP_SIZE, GROUP_SIZE).to(torch.float32)
        return grouped.mul_(self.scales.to(torch.float32).unsqueeze(-1)).view(rows, cols)
