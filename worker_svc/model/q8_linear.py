"""The LM head over 8-bit GGUF weights (--quantization gguf, on CPU): the token
embedding's Q8_0 blocks, which a tied head shares.

Measured on this 2-core AVX2 CPU (SmolLM2-135M's 49152 x 576 head, 2 threads): the
float32 kernel (kernels/cpu/q8_gemm.py) reads a quarter of the float32 weight's bytes and
took 8-9 against 15 ms for one row, 13-16 against 18-24 for 4 and 20 against 22 for 8,
level at 12. From there oneDNN's GEMM over packed float32 weights wins, and by far:
dequantizing the head for each step (in slices, into a scratch buffer) cost 18 ms a
slice of 4096 rows, and oneDNN ran 2x slower on the slices' plain layout than on its
packed one. So the head keeps both: the blocks for decode steps of few requests, and a
packed float32 copy (as a float32 model's head) for bigger ones; the embedding, which
the float32 model held besides, is read from the blocks.

Without AVX-512 VNNI, those few rows take the AVX2 int16 kernel (kernels/cpu/int16_gemm.py)
over the same blocks where it built: one row in 2.8 ms against 7.6 (10.9 against 4.0 GB/s
of the head's bytes, benchmarks/roofline.py, one thread, load average 3-4), 8 rows in
9.2 against 12.3 and 16 in 18 against 25 (random blocks of its shape, one thread, load
average 2.3).

Where AVX-512 VNNI runs, every step takes the int16 kernel (kernels/cpu/vnni_gemm.py)
instead, and no float32 copy is kept (113 MB for SmolLM2). Measured on an AVX-512 EPYC
(the 49152 x 576 head, 2 threads, best of 7, two runs): 1 row in 0.33-0.45 ms against
1.0-1.1 for the float32 kernel, 12 rows in 1.6-2.0 against 6.3-6.5, and against oneDNN's
packed GEMM 64 rows in 7.0 against 10.0-10.2 and 256 in 43 against 50-51.
"""
from __future__ import annotations

import torch
from torch import nn

from worker_svc.formats.q8_weights import Q8Blocks
from worker_svc.kernels.cpu import int16_gemm, q8_gemm, vnni_gemm
from worker_svc.kernels.cpu.vnni_gemm import Q8Panels
from worker_svc.model.layers import Linear

KERNEL_MAX_ROWS = 12  # steps of at most this many rows take the 8-bit kernel


class Q8Linear(nn.Module):
    def __init__(self, blocks: Q8Blocks, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = blocks.shape
        self.blocks = blocks
        self.vnni = vnni_gemm.load()
        self.panels = None if self.vnni is None else Q8Panels.from_blocks(blocks)
        self.kernel = q8_gemm.load()  # None where it could not be built: every step takes the dense head
        # The same blocks, faster than `kernel` at every size it serves; not where the VNNI one runs.
        self.int16 = None if self.panels is not None else int16_gemm.load()
        self.dense: Linear | None = None
        if self.panels is None:
            self.dense = Linear(self.in_features, self.out_features, bias=False)
            self.dense.weight = nn.Parameter(blocks.dequantize().to(dtype), requires_grad=False)
            self.dense.pack_for_cpu()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.panels is not None:
            out = self.vnni.linear(self.panels, rows.to(torch.float32), None).to(x.dtype)
        elif self.int16 is not None and rows.shape[0] <= KERNEL_MAX_ROWS:
            out = self.int16.q8_linear(self.blocks, rows.to(torch.float32)).to(x.dtype)
        elif self.kernel is not None and rows.shape[0] <= KERNEL_MAX_ROWS:
            out = self.kernel.linear(self.blocks, rows.to(torch.float32).contiguous()).to(x.dtype)
        else:
            out = self.dense(rows)
        return out.view(*x.shape[:-1], self.out_features)

