"""Shared fixtures. Tests run torch on one thread: on this 2-core machine a second
spinning OpenMP thread competing with other work made decode many times slower."""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

torch.set_num_threads(1)
