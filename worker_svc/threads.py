"""The engine's CPU threading, chosen on purpose.

On a small, shared CPU, OpenMP's default spin-waiting lets idle torch threads burn
the cores that other threads (or processes) need: here, 2 threads on 2 busy cores
made decode 5-25x slower. So kvfleet asks OpenMP to sleep when idle
(OMP_WAIT_POLICY=PASSIVE, which must be set before torch loads OpenMP, hence in
`worker_svc/__init__.py`) and uses `KVFLEET_NUM_THREADS` torch threads per process,
defaulting to torch's own choice (a thread per physical core) for a single worker, and
to an even share of it for each rank of a CPU worker group (ranks with more threads
than the cores would take turns on them). Tests pin one thread.
"""
from __future__ import annotations

import os

import torch

# torch's own choice, before anything here changes it.
_TORCH_DEFAULT_THREADS = torch.get_num_threads()


def configure_torch_threads(ranks_sharing_cores: int = 1) -> int:
    requested = os.environ.get("KVFLEET_NUM_THREADS")
    if requested:
        torch.set_num_threads(int(requested))
    elif ranks_sharing_cores > 1:
        torch.set_num_threads(max(1, _TORCH_DEFAULT_THREADS // ranks_sharing_cores))
    return torch.get_num_threads()
