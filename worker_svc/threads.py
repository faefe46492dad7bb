"""The engine's CPU threading, chosen on purpose.

On a small, shared CPU, OpenMP's default spin-waiting lets idle torch threads burn
the cores that other threads (or processes) need: here, 2 threads on 2 busy cores
made decode 5-25x slower. So kvfleet asks OpenMP to sleep when idle
(OMP_WAIT_POLICY=PASSIVE, which must be set before torch loads OpenMP, hence in
`worker_svc/__init__.py`) and uses `KVFLEET_NUM_THREADS` torch threads, defaulting to
every core. Tests pin one thread.
"""
from __future__ import annotations

import os

import torch


def configure_torch_threads() -> int:
    requested = os.environ.get("KVFLEET_NUM_THREADS")
    if requested:
        torch.set_num_threads(int(requested))
    return torch.get_num_threads()
