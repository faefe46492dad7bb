"""Import this before any module that defines Triton kernels.

Triton decides at decoration time whether `@triton.jit` compiles for a GPU or runs
in its interpreter (TRITON_INTERPRET=1). A machine without a CUDA device can only
interpret, so there the interpreter is chosen unless the environment says otherwise:
the kernels then run on CPU tensors (slowly), which is how this repository tests them.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
