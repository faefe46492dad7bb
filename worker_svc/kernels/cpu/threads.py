"""The engine's CPU threading, chosen on purpose.

On a small, shared CPU, OpenMP's default spin-waiting lets idle torch threads burn
the cores that other threads (or processes) need: here, 2 threads on 2 busy cores
made decode 5-25x slower. So kvfleet asks OpenMP to sleep when idle
(OMP_WAIT_POLICY=PASSIVE, which must be set before torch loads OpenMP, hence in
`worker_svc/__init__.py`) and uses `KVFLEET_NUM_THREADS` torch threads per process,
defaulting to torch's own choice (a thread per physical core) for a single worker, and
to an even share of it for each rank of a CPU worker group (ranks with more threads
than the cores would take turns on them). A step of few tokens runs on one of them
(`step_threads`), except kvfleet's decode GEMMs, which take them all. Tests pin one thread.

kvfleet's own kernels split their work over a pool of their own (csrc/thread_pool.cpp),
not OpenMP's: while a step runs its helpers poll for the next parallel region for a
little while before they sleep, so the step's ~150 regions do not each pay a wake-up.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from worker_svc.kernels.cpu.library import thread_pool

# torch's own choice, before anything here changes it.
_TORCH_DEFAULT_THREADS = torch.get_num_threads()


def idle_threads_sleep() -> bool:
    """Whether OpenMP's idle threads sleep (OMP_WAIT_POLICY=PASSIVE, kvfleet's default), so
    that each parallel region pays for waking them. OpenMP read the policy when torch
    loaded it, so it holds for the process."""
    return os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE"


def configure_torch_threads(ranks_sharing_cores: int = 1) -> int:
    requested = os.environ.get("KVFLEET_NUM_THREADS")
    if requested:
        torch.set_num_threads(int(requested))
    elif ranks_sharing_cores > 1:
        torch.set_num_threads(max(1, _TORCH_DEFAULT_THREADS // ranks_sharing_cores))
    return torch.get_num_threads()


# Under OMP_WAIT_POLICY=PASSIVE each of a step's ~130 parallel regions (matmuls, attention)
# wakes the sleeping threads, at 0.1-0.2 ms a time. Steps of up to this many tokens ran
# faster on one thread. Decode steps of SmolLM2, 2 cores, alternated, ms on one thread
# against two:
#   rows                                   4            8           12           16
#   4-bit, 56-token contexts       11.3 / 12.1  15.5 / 15.9  19.6 / 19.6  24.7 / 23.8
#   float32, 56-token contexts     23.6 / 26.3  31.2 / 34.2  36.6 / 33.3  45.3 / 40.8
#   4-bit, 400-token contexts      13.9 / 14.0  21.8 / 20.4      -        36.4 / 30.5
#   float32, 400-token contexts    26.8 / 28.4  37.0 / 35.3      -        52.2 / 42.1
# (Before the paged attention kernels and the 4-bit path, dense decode broke even at 16.)
SINGLE_THREAD_MAX_TOKENS = 8


class _PolledStep(threading.local):
    threads = 0  # the threads decode_threads() gives in this thread's step while its pool polls; 0 outside one


_polled_step = _PolledStep()


def decode_threads() -> int:
    """In a step whose pool helpers poll (step_threads), the threads kvfleet's int16 GEMMs take
    (the AVX2 kernel, int16_gemm.py, and the AVX-512 VNNI one, vnni_gemm.py), whatever their
    size: all of the engine's, while in a step of few tokens torch's ops run on one. Waking
    no thread, a call gains from every one: one token's 4-bit projections and 8-bit LM head
    took 6.8 ms on two threads against 11.6 on one on a 2-core AVX2 EPYC, 2.7 against 4.7 on
    a 2-core Sapphire Rapids-class Xeon (benchmarks/roofline.py: the weights' read is what a
    decode step waits for, and one core alone does not saturate memory), and the 120
    projections of a 12-row step 7.3 ms against 12.3 there (those under PASSIVE's 16M
    multiply-adds had taken one thread in steps of more than 8 tokens). 0 outside such a
    step: callers then choose from torch's count."""
    return _polled_step.threads


@contextmanager
def step_threads(device: torch.device, num_tokens: int, decode_gemms: bool = False) -> Iterator[None]:
    """A CPU step: torch's ops on the calling thread alone where waking the others costs more
    than they give (OpenMP's thread count is per calling thread, so this one step's), and,
    for a model whose decode GEMMs take them (`decode_gemms`), those on all (decode_threads;
    other models' helpers keep sleeping); otherwise with the kernels' pool helpers polling
    for its parallel regions until it ends."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1:
        yield
        return
    pool = thread_pool()
    small = idle_threads_sleep() and num_tokens <= SINGLE_THREAD_MAX_TOKENS
    polled = pool is not None and (decode_gemms or not small)
    if small:
        torch.set_num_threads(1)
    if polled:
        _polled_step.threads = threads
        pool.kvfleet_pool_steps(1)
    try:
        yield
    finally:
        if small:
            torch.set_num_threads(threads)
        if polled:
            _polled_step.threads = 0
            pool.kvfleet_pool_steps(-1)


def even_shares(costs: list[int], threads: int) -> list[int]:
    """Bounds cutting `costs` into contiguous runs of about equal sum, one a thread: thread i
    takes [bounds[i], bounds[i + 1]). Fewer runs where there are fewer items than threads."""
    threads = max(1, min(threads, len(costs)))
    total, bounds, done = sum(costs), [0], 0
    for index, cost in enumerate(costs):
        done += cost
        if len(bounds) < threads and done * threads >= total * len(bounds):
            bounds.append(index + 1)
    bounds.append(len(costs))
    return bounds
